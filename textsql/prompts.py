"""The source and prompt format, built and read: what a model reads for a question (T5's prefixed source, a causal LM's
plain or chat prompt, fitted to a length), and the source settings a dataset and a fine-tuned model record and are
checked against. Prep, evaluation, infer, compare and GRPO build every source here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.families import CAUSAL, family_of
from textsql.wikisql.cells import DEFAULT_MAX_VALUES, DEFAULT_VALUES_PER_COLUMN, cell_matches
from textsql.wikisql.format import SOURCE_FORMATS, VALUES_FORMAT

# Where a fine-tuned model records what it was trained to read (the T5 convention for task prefixes).
MODEL_CONFIG_KEY = "textsql"
# What a question+header+values source also depends on, recorded in the data's metadata and the model's config.
VALUES_SETTINGS = ("values_per_column", "max_values", "max_source_length")

# A source's sections (source_text): T5's leads after the question, the names and cells joined by the separator; the
# tiny tokenizers' training text (textsql.tiny) is made of the same pieces.
HEADER_SEPARATOR = " | "
HEADER_LEAD = " columns: "
VALUES_LEAD = " values: "
VALUE_LINK = " = "  # column = cell

# How a prompt is laid out: "seq2seq" (the source an encoder reads; the target is separate) or "causal" (one text a
# decoder-only LM continues with the SQL; textsql.families decides which a model takes).
LAYOUTS = ("seq2seq", "causal")
PROMPT_QUESTION, PROMPT_COLUMNS, PROMPT_VALUES, PROMPT_SQL = (
    "### Question: ",
    "### Columns: ",
    "### Values: ",
    "### SQL:\n",
)


def _one_line(text) -> str:
    return " ".join(str(text).split())


def source_text(
    question: str,
    header: list[str] | None,
    prefix: str,
    source_format: str,
    layout: str = "seq2seq",
    max_columns: int | None = None,
    values: list[tuple[str, str]] | None = None,
) -> str:
    """What the model reads for a question: the prefix and the question, and with 'question+header' (or
    'question+header+values') the column names (the first `max_columns` of them when given); with
    'question+header+values' then `values`, (column name, cell) pairs best first, as `column = cell` (no section when
    there are none). A causal LM reads a plain prompt it continues with the SQL (no prefix): `### Question: ...`,
    `### Columns: a | b`, `### Values: b = Utah Jazz | a = 1998`, then `### SQL:` and a new line; T5 reads
    `prefix question columns: a | b values: b = Utah Jazz | a = 1998`."""
    if source_format not in SOURCE_FORMATS:
        raise TextsqlError(f"Unknown source format '{source_format}'; textsql knows {', '.join(SOURCE_FORMATS)}.")
    if layout not in LAYOUTS:
        raise TextsqlError(f"Unknown prompt layout '{layout}'; textsql knows {', '.join(LAYOUTS)}.")
    columns = listed = None
    if source_format != "question":
        if header is None:
            raise TextsqlError(f"--source_format {source_format} needs the question's table; this question has none.")
        columns = HEADER_SEPARATOR.join(_one_line(name) for name in header[:max_columns])
    if source_format == VALUES_FORMAT and values:
        listed = HEADER_SEPARATOR.join(_one_line(column) + VALUE_LINK + _one_line(cell) for column, cell in values)
    question = " ".join(question.split()) if layout == "causal" else question
    if layout == "causal":
        lines = [PROMPT_QUESTION + question] + ([PROMPT_COLUMNS + columns] if columns is not None else [])
        lines += [PROMPT_VALUES + listed] if listed else []
        return "\n".join(lines) + "\n" + PROMPT_SQL
    return (
        prefix
        + question
        + (HEADER_LEAD + columns if columns is not None else "")
        + (VALUES_LEAD + listed if listed else "")
    )


@dataclass
class FittedSource:
    """A source as fitted_source built it: its text, its ids (when fitted with a tokenizer), how many cell values it
    lists, and how many values and columns were left out to fit."""

    text: str
    ids: list[int] | None = None
    values: int = 0
    values_dropped: int = 0
    columns_cut: int = 0


def table_values(question: str, table: dict | None, settings: dict) -> list[tuple[str, str]]:
    """The (column name, cell) pairs a 'question+header+values' source lists for the question, best first
    (textsql.wikisql.cells), within the settings' values_per_column and max_values; none for another format."""
    if settings.get("source_format") != VALUES_FORMAT or table is None:
        return []
    matches = cell_matches(
        question,
        table,
        settings.get("values_per_column", DEFAULT_VALUES_PER_COLUMN),
        settings.get("max_values", DEFAULT_MAX_VALUES),
    )
    return [(table["header"][match.column], match.cell) for match in matches]


def fitted_source(
    question: str,
    table: dict | None,
    settings: dict,
    tokenizer=None,
    max_length: int | None = None,
    values: list[tuple[str, str]] | None = None,
) -> FittedSource:
    """What the model reads for a question about `table` (release format: header, rows; or None), laid out as
    `settings` say (a prepared dataset's metadata, or prep's: source_format, source_prefix, layout, prompt_format,
    values_per_column, max_values), the one place prep, evaluation, infer and compare build sources. With a tokenizer
    and max_length it is fitted as prep fits it: listed cell values dropped from the end (the worst match first) until
    it fits, then, for a causal LM, columns from the end of its list; what still does not fit is left to the caller
    (prep's --overlong). `values`: table_values' pairs when the caller has them already."""
    header = table["header"] if table else None
    source_format = settings.get("source_format", "question")
    layout = settings.get("layout", "seq2seq")
    values = table_values(question, table, settings) if values is None else values

    def render(listed: int, max_columns: int | None = None) -> str:
        if layout == CAUSAL:
            return causal_prompt(
                question, header, source_format, settings.get("prompt_format"), tokenizer, max_columns, values[:listed]
            )
        return source_text(
            question, header, settings.get("source_prefix", ""), source_format, layout, None, values[:listed]
        )

    kept = len(values)
    text = render(kept)
    if tokenizer is None or max_length is None:
        return FittedSource(text, values=kept)
    ids = tokenizer(text)["input_ids"]
    while len(ids) > max_length and kept:
        kept -= 1
        text = render(kept)
        ids = tokenizer(text)["input_ids"]
    columns_cut = 0
    if len(ids) > max_length and layout == CAUSAL and header is not None and source_format != "question":
        for keep in range(len(header) - 1, -1, -1):
            text = render(0, keep)
            ids = tokenizer(text)["input_ids"]
            columns_cut = len(header) - keep
            if len(ids) <= max_length:
                break
    return FittedSource(text, ids, kept, len(values) - kept, columns_cut)


def causal_prompt(
    question: str,
    header: list[str] | None,
    source_format: str,
    prompt_format: str,
    tokenizer=None,
    max_columns: int | None = None,
    values: list[tuple[str, str]] | None = None,
) -> str:
    """A causal LM's prompt: the plain layout (source_text), or with prompt_format 'chat' those
    lines as the user's message in the tokenizer's chat template, up to the assistant's turn. The template's own BOS is
    left to the tokenizer, which adds it (or not) like for any text, so prep and generation tokenize alike."""
    plain = source_text(question, header, "", source_format, CAUSAL, max_columns=max_columns, values=values)
    if prompt_format != "chat":
        return plain
    if tokenizer is None:
        raise TextsqlError("A chat prompt needs the model's tokenizer (its chat template).")
    messages = [{"role": "user", "content": plain.rstrip("\n")}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    bos = tokenizer.bos_token
    return prompt[len(bos) :] if bos and prompt.startswith(bos) else prompt


def model_source(question: str, table: dict | None, metadata: dict, tokenizer=None) -> str:
    """What a model trained on this prepared data reads for a question (typed, or of a split) about `table` (release
    format, or None): the T5 source or the causal LM's prompt, built as prep built it: with the tokenizer, fitted to
    the data's --max_source_length as prep fitted it (fitted_source); without, whole (a chat prompt needs the
    tokenizer)."""
    max_length = metadata.get("max_source_length") if tokenizer is not None else None
    return fitted_source(question, table, metadata, tokenizer, max_length).text


def source_settings(metadata: dict) -> dict:
    """How a dataset's sources were built: what a model trained on it must be given at inference, too."""
    settings = {"source_prefix": metadata["source_prefix"], "source_format": metadata.get("source_format", "question")}
    if metadata.get("prompt_format"):  # a causal LM's: plain or chat
        settings["prompt_format"] = metadata["prompt_format"]
    if settings["source_format"] == VALUES_FORMAT:  # which cells are listed, and the budget they were fitted to
        for key in VALUES_SETTINGS:
            settings[key] = metadata.get(key)
    return settings


def record_source_settings(model_config, metadata: dict) -> None:
    """Write the dataset's source settings into the model's config, so every saved copy of the model carries them."""
    params = dict(getattr(model_config, "task_specific_params", None) or {})
    params[MODEL_CONFIG_KEY] = source_settings(metadata)
    model_config.task_specific_params = params


def fine_tuned_settings(model_config) -> dict | None:
    """The source settings a model was fine-tuned with by textsql (record_source_settings), None for any other model."""
    return (getattr(model_config, "task_specific_params", None) or {}).get(MODEL_CONFIG_KEY)


def check_source_settings(model_config, metadata: dict, dataset_dir: str | Path) -> None:
    """Refuse data whose sources differ from what the model was fine-tuned to read (a model not fine-tuned by textsql
    carries no settings and accepts any), and data laid out for another model family (T5's or a causal LM's)."""
    family = family_of(model_config)
    layout = metadata.get("layout", "seq2seq")
    if layout != family.kind:
        raise TextsqlError(
            f"'{dataset_dir}' was prepared for a {layout} model ({metadata.get('model_family', 't5')}), and this is a "
            f"{family.kind} {family.name} model. Run `textsql prep` again with --model_id set to the model you use."
        )
    trained = fine_tuned_settings(model_config)
    if not trained:
        return
    given = source_settings(metadata)
    if trained.get("source_format") != given["source_format"]:
        raise TextsqlError(
            f"This model was fine-tuned on sources in the '{trained.get('source_format')}' format, but '{dataset_dir}' was "
            f"prepared with --source_format {given['source_format']}. Prepare the data again with --source_format "
            f"{trained.get('source_format')} (or train a model on this format)."
        )
    if trained.get("prompt_format", "plain") != given.get("prompt_format", "plain") and family.causal:
        raise TextsqlError(
            f"This model was fine-tuned on {trained.get('prompt_format', 'plain')} prompts, but '{dataset_dir}' was "
            f"prepared with --prompt_format {given.get('prompt_format', 'plain')}. Prepare the data again with "
            f"--prompt_format {trained.get('prompt_format', 'plain')}."
        )
    changed = [key for key in VALUES_SETTINGS[:2] if given.get(key) != trained.get(key)]
    if changed and given["source_format"] == VALUES_FORMAT:
        flags = " ".join(f"--{key} {trained.get(key)}" for key in changed)
        raise TextsqlError(
            f"This model was fine-tuned on sources listing cell values with {flags}, but '{dataset_dir}' was prepared "
            f"with {' '.join(f'--{key} {given.get(key)}' for key in changed)}. Prepare the data again with {flags}."
        )
    if trained.get("source_prefix") != given["source_prefix"]:
        raise TextsqlError(
            f"This model was fine-tuned with the prefix {trained.get('source_prefix')!r}, but '{dataset_dir}' was prepared with "
            f"{given['source_prefix']!r}. Prepare the data again with --source_prefix {trained.get('source_prefix')!r}."
        )


def metadata_for_model(model_config, metadata: dict, dataset_dir: str | Path) -> dict:
    """How a model reads this dataset's questions (what model_source takes): the dataset's own settings where it was
    prepared for the model's family and in the format the model reads (check_source_settings), else the settings the
    model was fine-tuned with, so that a T5 run and a causal LM run, or two runs fine-tuned on other source formats
    (the question alone, the question and its columns), answer the same questions about the same tables side by side
    (textsql compare). A model of the other family that textsql did not fine-tune carries none and is refused."""
    family = family_of(model_config)
    layout = metadata.get("layout", "seq2seq")
    if layout == family.kind:
        try:
            check_source_settings(model_config, metadata, dataset_dir)
            return metadata
        except TextsqlError:
            pass  # fine-tuned on other sources than the dataset's (so it carries its settings): read as it learned to
    trained = fine_tuned_settings(model_config)
    if not trained:
        raise TextsqlError(
            f"'{dataset_dir}' was prepared for a {layout} model ({metadata.get('model_family', 't5')}), and this "
            f"{family.kind} {family.name} model was not fine-tuned by textsql, so how it reads a question is unknown. "
            "Compare it on data prepared for it (`textsql prep --model_id` it), or compare a run fine-tuned from it."
        )
    return {**trained, "layout": family.kind, "model_family": family.name}
