"""Prepare WikiSQL for training: load a source, tokenize it as the model's family reads it (T5: a prefixed source and
a separate target; a causal LM: prompt and SQL in one sequence), no fixed padding, report lengths, save to disk."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from textsql import __version__
from textsql.arguments.prep import DEFAULT_MAX_VALUES, DEFAULT_VALUES_PER_COLUMN, PrepArguments
from textsql.errors import TextsqlError
from textsql.families import AUTO, CAUSAL, best_setting, family_named, family_of
from textsql.hub import load_tokenizer, model_family
from textsql.paths import METADATA_FILE, TABLES_FILE, TOKENIZER_DIR
from textsql.vocabulary import add_characters, byte_level, missing_characters
from textsql.wikisql.cells import cell_matches
from textsql.wikisql.format import VALUES_FORMAT, Example, WikiSQLData, source_text
from textsql.wikisql.release import load_wikisql
from textsql.wikisql.sql import SQLParseError, parse_sql, same_logical_form
from textsql.wikisql.synthetic import generate_wikisql

logger = logging.getLogger(__name__)

# A source without a dev split (a subset, the release slice in shared/real) gets this fraction of train's tables held out
# as validation by default, so that a default `textsql train`, which evaluates each epoch, can.
DEFAULT_VALIDATION_FROM_TRAIN = 0.1
PERCENTILES = (50, 90, 95, 99, 100)
# Where a fine-tuned model records what it was trained to read (the T5 convention for task prefixes).
MODEL_CONFIG_KEY = "textsql"
# What a question+header+values source also depends on, recorded in the data's metadata and the model's config.
VALUES_SETTINGS = ("values_per_column", "max_values", "max_source_length")


def load_source(args: PrepArguments) -> WikiSQLData:
    """The raw examples: generated into output_dir/source, or read from the given source."""
    if args.source == "generate":
        held_out_tables = max(1, args.generate_train_tables // 5)
        folder = generate_wikisql(
            Path(args.output_dir) / "source",
            train_tables=args.generate_train_tables,
            dev_tables=held_out_tables,
            test_tables=held_out_tables,
            questions_per_table=args.generate_questions_per_table,
            seed=args.seed,
        )
        data = load_wikisql(str(folder))
        data.source = "generate"
        return data
    return load_wikisql(args.source)


def prepare_dataset(args: PrepArguments):
    """Load, tokenize, report and save; returns the saved folder. The prep notebook and `textsql prep` call this."""
    output_dir = Path(args.output_dir)
    if (output_dir / METADATA_FILE).exists() and not args.overwrite:
        raise TextsqlError(
            f"'{output_dir}' already holds a prepared dataset. Pass --overwrite (overwrite=True in a notebook) to "
            "replace it, or prepare into another folder."
        )
    data = load_source(args)  # the user's data first: a missing folder is named before any model is looked for
    family = model_family(args.model_id)
    base_tokenizer = load_tokenizer(args.model_id)
    if not data.splits.get("train"):
        raise TextsqlError(
            f"Source '{args.source}' has no train split; found splits: {', '.join(data.splits) or 'none'}."
        )
    data = validation_split(data, args)  # before generated questions join train: validation stays the source's
    if args.generated_train:
        data = with_generated_train(data, args)
    if args.source_format == AUTO:  # the family's best (textsql.families.best_settings), said in one line
        args = replace(args, source_format=best_setting("source_format", AUTO, family, bool(data.tables)))
        why = f"the best measured for {family.name}" if data.tables else "the source has no tables"
        logger.info("source format: %s (%s; --source_format question: the walkthrough's)", args.source_format, why)
    if args.source_format != "question" and not data.tables:
        raise TextsqlError(
            f"--source_format {args.source_format} needs the tables, and '{args.source}' has none. Use the WikiSQL "
            "release files or a hub copy with a 'table' column, or --source_format question."
        )
    if args.prompt_format == "chat" and not family.causal:
        raise TextsqlError(
            f"--prompt_format chat lays a causal LM's prompt out in its chat template; '{args.model_id}' is a "
            f"{family.name} model, which reads a prefixed source. Leave --prompt_format out (plain)."
        )
    if args.prompt_format == "chat" and not getattr(base_tokenizer, "chat_template", None):
        raise TextsqlError(
            f"The tokenizer of '{args.model_id}' has no chat template (chat_template in tokenizer_config.json or a "
            "chat_template.jinja file), so --prompt_format chat cannot lay the prompt out. Use --prompt_format plain."
        )
    splits = {name: examples[: args.max_examples_per_split] for name, examples in data.splits.items()}
    prefix = "" if family.causal else args.source_prefix  # a causal LM reads a plain prompt (source_text)
    settings = {**asdict(args), "source_prefix": prefix, "layout": family.kind, "prompt_format": None}
    values = {
        name: [table_values(e.question, data.tables.get(e.table_id), settings) for e in examples]
        for name, examples in splits.items()
    }
    sources = {  # whole and plain, as the tokenizer check reads them; fitted to --max_source_length below
        name: [
            fitted_source(e.question, data.tables.get(e.table_id), settings, values=listed).text
            for e, listed in zip(examples, values[name])
        ]
        for name, examples in splits.items()
    }
    # Every character the model reads or learns to write must be one it can produce: add what the tokenizer lacks. It
    # reads every split's sources (questions, columns, cells: inputs) and learns train's answers; the held-out answers
    # are what it is scored on, never read here.
    missing = missing_characters(
        base_tokenizer,
        (text for name in splits for text in sources[name] + [e.target for e in splits[name] if name == "train"]),
    )
    tokenizer = base_tokenizer
    if byte_level(base_tokenizer):
        logger.info(
            "'%s' is a byte-level BPE tokenizer: it writes every character, so nothing is added to its vocabulary%s.",
            args.model_id,
            f" (yet it cannot produce {missing['unknown']})" if missing["unknown"] else "",
        )
    if missing["unknown"]:
        tokenizer = add_characters(base_tokenizer, missing["unknown"], output_dir / TOKENIZER_DIR)
        logger.info(
            "Added %d characters that '%s' cannot produce to its vocabulary: %s",
            len(missing["unknown"]),
            args.model_id,
            ", ".join(repr(c) for c in missing["unknown"]),
        )
    settings["prompt_format"] = args.prompt_format if family.causal else None
    fits = {
        name: [
            fitted_source(
                e.question, data.tables.get(e.table_id), settings, tokenizer, args.max_source_length, values=listed
            )
            for e, listed in zip(examples, values[name])
        ]
        for name, examples in splits.items()
    }
    if family.causal:
        dataset, fitted = tokenize_causal(splits, fits, tokenizer, args)
    else:
        dataset = tokenize_splits(splits, {name: [f.text for f in fits[name]] for name in splits}, tokenizer)
        fitted = {name: {"values_dropped": sum(bool(f.values_dropped) for f in fits[name])} for name in splits}
    for name, counts in fitted.items():
        if counts["values_dropped"]:
            logger.info(
                "%s: %d sources over %d tokens lost cell values (the worst matches first) to fit",
                name,
                counts["values_dropped"],
                args.max_source_length,
            )
    values_listed = {  # as fitted, before --overlong drops any
        name: {
            "sources": len(fits[name]),
            "prompts_with_values": sum(bool(f.values) for f in fits[name]),
            "values": sum(f.values for f in fits[name]),
        }
        for name in splits
    }
    report = length_report(dataset, args.max_source_length, args.max_target_length)
    lost = characters_lost_in_targets(dataset, tokenizer, data.tables)
    recovered = lost["column_names_recovered"]
    if recovered["examples"]:
        logger.info(
            "%d target SQL strings come back from '%s' with column names rewritten (%s); scoring matches "
            "column names as the tokenizer writes them, so they still score right.",
            recovered["examples"],
            args.model_id,
            ", ".join(f"{c!r} x{n}" for c, n in recovered["characters"].items()),
        )
    if lost["examples"]:
        logger.warning(
            "%d target SQL strings do not survive tokenize -> decode with '%s' (characters it rewrites: %s); the model "
            "cannot generate them exactly, so those examples cannot be scored right.",
            lost["examples"],
            args.model_id,
            ", ".join(f"{c!r} x{n}" for c, n in lost["characters"].items()),
        )
    if not family.causal:  # a causal LM's examples were fitted or dropped as they were tokenized
        dataset = apply_overlong_policy(dataset, report, args)
    output_dir.mkdir(parents=True, exist_ok=True)
    dataset.save_to_disk(str(output_dir))
    _save_tables(output_dir, data, splits)
    metadata = {
        "source": data.source if args.source != "generate" else "generate",
        "tokenizer": args.model_id,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "base_tokenizer_fingerprint": tokenizer_fingerprint(base_tokenizer),
        "tokenizer_dir": TOKENIZER_DIR if tokenizer is not base_tokenizer else None,
        "added_characters": missing["unknown"],
        "characters_changed_by_normalizer": missing["normalized"],
        "source_prefix": prefix,
        "source_format": args.source_format,
        "layout": family.kind,
        "prompt_format": args.prompt_format if family.causal else None,
        "model_family": family.name,
        "byte_level": byte_level(base_tokenizer),
        "prompts_fitted": fitted,
        "values_per_column": args.values_per_column,
        "max_values": args.max_values,
        "values_listed": values_listed if args.source_format == VALUES_FORMAT else None,
        "max_source_length": args.max_source_length,
        "max_target_length": args.max_target_length,
        "overlong": args.overlong,
        "examples": {name: len(split) for name, split in dataset.items()},
        "lengths": report,
        "targets_lost_in_tokenization": lost,
        "has_tables": bool(data.tables),
        "arguments": asdict(args),
        "textsql_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (output_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    return output_dir


def validation_split(data: WikiSQLData, args: PrepArguments) -> WikiSQLData:
    """The source's own validation split; else, with --validation_from_train, that fraction of train's tables held out
    (whole tables, as WikiSQL's own splits are: a question on a table seen in training would flatter the score); else a
    warning now rather than training stopping at its first evaluation."""
    if data.splits.get("validation"):
        if args.validation_from_train:
            raise TextsqlError(
                f"'{args.source}' has its own validation (dev) split, so --validation_from_train "
                f"{args.validation_from_train:g} would set part of train aside for nothing. Leave the flag out."
            )
        return data
    train = data.splits["train"]
    fraction = DEFAULT_VALIDATION_FROM_TRAIN if args.validation_from_train is None else args.validation_from_train
    if not fraction:
        logger.warning(
            "'%s' has no validation (dev) split and --validation_from_train is 0, so the prepared data has none: train "
            "it with --eval_strategy no (`textsql train` evaluates each epoch by default).",
            args.source,
        )
        return data
    keys = [example.table_id or f"#{i}" for i, example in enumerate(train)]  # a copy without tables: each question
    count = Counter(keys)
    tables = sorted(count)
    import numpy as np  # here, not at the top: the planner and most commands' --help import this module

    np.random.default_rng(args.seed).shuffle(tables)
    held_out, taken = set(), 0
    for table in tables:
        if taken >= fraction * len(train):
            break
        held_out.add(table)
        taken += count[table]
    if len(held_out) == len(tables):
        raise TextsqlError(
            f"'{args.source}' has {len(tables)} table(s) in its train split: holding out whole tables as validation "
            "would leave nothing to train on. Use a source with a dev split, or a larger train split."
        )
    validation = [e for e, key in zip(train, keys) if key in held_out]
    kept = [e for e, key in zip(train, keys) if key not in held_out]
    data.splits = {**data.splits, "train": kept, "validation": validation}
    logger.warning(
        "'%s' has no validation (dev) split: %d questions on %d of train's %d tables are held out as validation "
        "(--validation_from_train %g).",
        args.source,
        len(validation),
        len(held_out),
        len(tables),
        fraction,
    )
    return data


GENERATED_TABLE_PREFIX = "generated-"  # generated tables' ids in a mixed train split: never a real table's id


def with_generated_train(data: WikiSQLData, args: PrepArguments) -> WikiSQLData:
    """The source with about args.generated_train generated questions (on generated tables, their ids prefixed so
    that none meets a real table's) added to its train split."""
    tables_needed = max(1, -(-args.generated_train // args.generate_questions_per_table))
    folder = generate_wikisql(
        Path(args.output_dir) / "generated-train",
        train_tables=tables_needed,
        dev_tables=0,
        test_tables=0,
        questions_per_table=args.generate_questions_per_table,
        seed=args.seed,
    )
    generated = load_wikisql(str(folder))
    extra = [
        Example(e.question, e.target, GENERATED_TABLE_PREFIX + e.table_id, e.sql)
        for e in generated.splits["train"][: args.generated_train]
    ]
    tables = {
        GENERATED_TABLE_PREFIX + key: {**table, "id": GENERATED_TABLE_PREFIX + key}
        for key, table in generated.tables.items()
    }
    logger.warning(
        "Added %d generated questions on %d generated tables to the %d of train (--generated_train).",
        len(extra),
        len({e.table_id for e in extra}),
        len(data.splits["train"]),
    )
    data.splits = {**data.splits, "train": data.splits["train"] + extra}
    data.tables = {**data.tables, **{key: tables[key] for key in {e.table_id for e in extra}}}
    return data


def tokenize_splits(splits: dict[str, list[Example]], sources: dict[str, list[str]], tokenizer):
    """Tokenized DatasetDict: input_ids, attention_mask, labels (unpadded) plus the question, target, query and the
    source text itself (what evaluation gives the model again: its values as prep fitted them).

    `sources` holds, per split, the text the model reads for each example (see fitted_source).
    """
    from datasets import Dataset, DatasetDict

    result = {}
    for name, examples in splits.items():
        encoded = tokenizer(sources[name], truncation=False)
        targets = tokenizer(text_target=[e.target for e in examples], truncation=False)
        result[name] = Dataset.from_dict(
            {
                "question": [e.question for e in examples],
                "target": [e.target for e in examples],
                "table_id": [e.table_id for e in examples],
                "sql": [json.dumps(e.sql) if e.sql is not None else "" for e in examples],
                "source": sources[name],
                "input_ids": encoded["input_ids"],
                "attention_mask": encoded["attention_mask"],
                "labels": targets["input_ids"],
            }
        )
    return DatasetDict(result)


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
    """A causal LM's prompt: the plain layout (textsql.wikisql.format.source_text), or with prompt_format 'chat' those
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


def tokenize_causal(
    splits: dict[str, list[Example]], fits: dict[str, list[FittedSource]], tokenizer, args: PrepArguments
):
    """(DatasetDict, what was fitted) for a causal LM: each example one `input_ids` sequence, the prompt
    (source_text's causal layout, as fitted_source fitted it to --max_source_length) and then the SQL and EOS, with
    `labels` -100 on the prompt: the model learns to write the SQL and to stop, never the prompt. Padding comes at
    collation, masked there by position.

    What still does not fit (a question alone too long, an SQL over --max_target_length) is an error with --overlong
    error, else dropped; counted per split in the returned dict with the prompts that lost values or columns
    (values_dropped, columns_cut, dropped)."""
    from datasets import Dataset, DatasetDict

    eos = tokenizer.eos_token_id
    if eos is None:
        raise TextsqlError(
            f"The tokenizer of '{args.model_id}' has no end-of-sequence token, so the model could never learn where "
            "a query ends. Use a tokenizer whose tokenizer_config.json names eos_token."
        )
    result, fitted, overlong = {}, {}, {}
    for name, examples in splits.items():
        rows = {
            key: []
            for key in ("question", "target", "table_id", "sql", "prompt", "input_ids", "attention_mask", "labels")
        }
        cut = values_dropped = dropped = 0
        for example, fit in zip(examples, fits[name], strict=True):
            prompt, prompt_ids = fit.text, fit.ids
            cut += bool(fit.columns_cut)
            values_dropped += bool(fit.values_dropped)
            answer_ids = tokenizer(example.target, add_special_tokens=False)["input_ids"] + [eos]
            if len(prompt_ids) > args.max_source_length or len(answer_ids) > args.max_target_length:
                dropped += 1
                continue
            rows["question"].append(example.question)
            rows["target"].append(example.target)
            rows["table_id"].append(example.table_id)
            rows["sql"].append(json.dumps(example.sql) if example.sql is not None else "")
            rows["prompt"].append(prompt)
            rows["input_ids"].append(prompt_ids + answer_ids)
            rows["attention_mask"].append([1] * (len(prompt_ids) + len(answer_ids)))
            rows["labels"].append([-100] * len(prompt_ids) + answer_ids)
        result[name] = Dataset.from_dict(rows)
        fitted[name] = {"values_dropped": values_dropped, "columns_cut": cut, "dropped": dropped}
        if dropped:
            overlong[name] = dropped
        if cut:
            logger.info(
                "%s: %d prompts over %d tokens lost columns from the end of their list",
                name,
                cut,
                args.max_source_length,
            )
    if overlong:
        counts = "; ".join(f"{name}: {n}" for name, n in overlong.items())
        if args.overlong == "error":
            raise TextsqlError(
                f"Some examples do not fit even with their column lists cut ({counts}): a question over "
                f"--max_source_length {args.max_source_length} tokens or an SQL over --max_target_length "
                f"{args.max_target_length}. Raise them, or pass --overlong drop to leave those examples out."
            )
        logger.warning("Dropping examples that do not fit even with their column lists cut: %s", counts)
    return DatasetDict(result), fitted


def characters_lost_in_targets(dataset, tokenizer, tables: dict[str, dict] | None = None) -> dict:
    """Targets whose decode(encode(text)) differs, and the characters missing (after prep's additions, only characters
    the tokenizer's normalizer rewrites can be left), told apart by what they change:

    "examples"/"characters": lost: the text as the tokenizer gives it back reads as another query (a value such as
    `Ranma ½` comes back as `Ranma 1⁄2`, and WikiSQL compares values as written), or there is no table to tell;
    "column_names_recovered": only column names changed (`Area (km²)` comes back as `Area (km2)`), which scoring
    matches in their normalized form, so the query read back is the gold one.
    """
    lost: Counter = Counter()
    recovered: Counter = Counter()
    lost_examples = recovered_examples = 0
    for split in dataset.values():
        answers = [[i for i in labels if i != -100] for labels in split["labels"]]  # a causal LM's prompt is -100
        decoded_texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
        for index, (target, decoded) in enumerate(zip(split["target"], decoded_texts)):
            decoded = " ".join(decoded.split())
            if decoded == target:
                continue
            changed = set(target) - set(decoded)
            if _reads_as_gold(decoded, split[index], tables or {}):
                recovered_examples += 1
                recovered.update(changed)
            else:
                lost_examples += 1
                lost.update(changed)
    return {
        "examples": lost_examples,
        "characters": dict(lost.most_common(20)),
        "column_names_recovered": {"examples": recovered_examples, "characters": dict(recovered.most_common(20))},
    }


def _reads_as_gold(text: str, row: dict, tables: dict[str, dict]) -> bool:
    """`text` parses against the row's table into the row's gold query (by WikiSQL's logical form)."""
    table = tables.get(row["table_id"])
    if table is None or not row["sql"]:
        return False
    try:
        return same_logical_form(parse_sql(text, table["header"], table.get("rows")), json.loads(row["sql"]))
    except SQLParseError:
        return False


def length_report(dataset, max_source_length: int, max_target_length: int) -> dict:
    """Token-length percentiles per split, mean real tokens per example, and how many exceed the max lengths. A causal
    LM's source is its prompt (the -100 labels) and its target the rest of its one sequence."""
    import numpy as np  # here, not at the top: the planner and most commands' --help import this module

    report = {}
    for name, split in dataset.items():
        labels = split["labels"]
        causal = "prompt" in split.column_names  # prompt and answer in one sequence
        if causal:
            source = np.array([sum(1 for i in ids if i == -100) for ids in labels], dtype=int)
            target = np.array([len(ids) for ids in labels], dtype=int) - source
        else:
            source = np.array([len(ids) for ids in split["input_ids"]], dtype=int)
            target = np.array([len(ids) for ids in labels], dtype=int)
        if not len(source):
            source = target = np.zeros(1, dtype=int)
        report[name] = {
            "source_percentiles": {f"p{p}": int(np.percentile(source, p)) for p in PERCENTILES},
            "target_percentiles": {f"p{p}": int(np.percentile(target, p)) for p in PERCENTILES},
            "mean_tokens_per_example": float((source.sum() + target.sum()) / max(len(split), 1)),
            "source_over_max": int((source > max_source_length).sum()),
            "target_over_max": int((target > max_target_length).sum()),
            "examples": len(split),
        }
        if causal:  # the whole sequence a batch is padded to (longest_lengths)
            report[name]["sequence_percentiles"] = {
                f"p{p}": int(np.percentile(source + target, p)) for p in PERCENTILES
            }
    return report


def longest_lengths(split_report: dict) -> tuple[int, int]:
    """(source, target) a batch of this split is padded to at worst, from its length_report entry. A causal LM's prompt
    and SQL are one sequence, and the longest prompt and the longest SQL are seldom one example's (real WikiSQL with
    Qwen2's tokenizer: 137 + 75 apart, 188 together): its source is the longest sequence less the longest SQL, so the
    two add up to the longest sequence (reports from before the sequence was recorded give the two maxima)."""
    source, target = split_report["source_percentiles"]["p100"], split_report["target_percentiles"]["p100"]
    if "sequence_percentiles" in split_report:
        source = max(split_report["sequence_percentiles"]["p100"] - target, 0)
    return int(source), int(target)


def format_length_report(report: dict) -> str:
    lines = [f"{'split':<11}{'n':>7}  source p50/p95/p99/max   target p50/p95/p99/max   over max (src/tgt)"]
    for name, r in report.items():
        s, t = r["source_percentiles"], r["target_percentiles"]
        lines.append(
            f"{name:<11}{r['examples']:>7}  {s['p50']:>5}/{s['p95']}/{s['p99']}/{s['p100']:<10}"
            f"  {t['p50']:>5}/{t['p95']}/{t['p99']}/{t['p100']:<10}  {r['source_over_max']}/{r['target_over_max']}"
        )
    return "\n".join(lines)


def format_layout(metadata: dict) -> str:
    """One line on how the data was laid out: T5's source and target, or a causal LM's one sequence with what was fitted,
    and whether the tokenizer writes every character (byte-level BPE) or had characters added."""
    if metadata.get("layout", "seq2seq") == "causal":
        fitted = metadata.get("prompts_fitted", {})
        cut = sum(split["columns_cut"] for split in fitted.values())
        dropped = sum(split["dropped"] for split in fitted.values())
        line = (
            f"layout: causal LM ({metadata.get('model_family')}): prompt + SQL + EOS in one sequence, the prompt "
            f"masked; {cut} prompts lost columns to fit, {dropped} examples dropped"
        )
    else:
        line = f"layout: seq2seq ({metadata.get('model_family', 't5')}): source and target apart"
    if metadata.get("values_listed"):  # question+header+values
        listed = metadata["values_listed"].values()
        lost = sum(split.get("values_dropped", 0) for split in metadata.get("prompts_fitted", {}).values())
        line += (
            f"; cell values listed in {sum(split['prompts_with_values'] for split in listed)} of "
            f"{sum(split['sources'] for split in listed)} sources ({sum(split['values'] for split in listed)} values), "
            f"{lost} sources lost values to fit"
        )
    if metadata.get("byte_level"):
        return line + "; byte-level BPE: every character can be written, nothing added"
    added = metadata.get("added_characters") or {}
    return line + (f"; {len(added)} characters added to the tokenizer" if added else "")


def apply_overlong_policy(dataset, report: dict, args: PrepArguments):
    """Never truncate silently: error (default), truncate or drop, always saying how many."""
    overlong = {
        name: (r["source_over_max"], r["target_over_max"])
        for name, r in report.items()
        if r["source_over_max"] or r["target_over_max"]
    }
    if not overlong:
        return dataset
    counts = "; ".join(
        f"{name}: {s} questions over {args.max_source_length} tokens, {t} targets over {args.max_target_length}"
        for name, (s, t) in overlong.items()
    )
    if args.overlong == "error":
        raise TextsqlError(
            f"Some examples are longer than the max lengths ({counts}). Raise --max_source_length/--max_target_length, "
            "or pass --overlong truncate or --overlong drop."
        )
    logger.warning(
        "%s examples over the max lengths: %s", "Truncating" if args.overlong == "truncate" else "Dropping", counts
    )
    if args.overlong == "drop":
        return dataset.filter(
            lambda row: len(row["input_ids"]) <= args.max_source_length and len(row["labels"]) <= args.max_target_length
        )
    return dataset.map(lambda row: _truncate(row, args.max_source_length, args.max_target_length))


def _truncate(row: dict, max_source: int, max_target: int) -> dict:
    # Keep the final </s> so the model still learns where a query ends.
    def cut(ids, n):
        return ids if len(ids) <= n else ids[: n - 1] + ids[-1:]

    input_ids = cut(row["input_ids"], max_source)
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": cut(row["labels"], max_target)}


def _save_tables(output_dir: Path, data: WikiSQLData, splits: dict[str, list[Example]]) -> None:
    """The tables the kept questions refer to, for executing queries later."""
    used = {e.table_id for examples in splits.values() for e in examples}
    with open(output_dir / TABLES_FILE, "w", encoding="utf-8") as f:
        for table_id in sorted(used & data.tables.keys()):
            f.write(json.dumps(data.tables[table_id]) + "\n")


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary, so training can refuse data tokenized with another tokenizer."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def check_prepared(path: str | Path) -> Path:
    """The folder, when it holds a prepared dataset (cheap: nothing is loaded); else a clear error naming the absolute
    path looked at and how to make it."""
    path = Path(path)
    if not (path / METADATA_FILE).is_file():
        where = "does not exist" if not path.exists() else f"has no {METADATA_FILE}"
        raise TextsqlError(
            f"'{path}' is not a prepared textsql dataset: {path.absolute()} {where}. Run `textsql prep --source ... "
            f"--output_dir {path}` first (or the prep_dataset notebook), or pass the folder prep wrote."
        )
    return path


def load_prepared(path: str | Path):
    """The saved DatasetDict and its metadata, or a clear error saying how to make it."""
    from datasets import load_from_disk

    path = check_prepared(path)
    return load_from_disk(str(path)), json.loads((path / METADATA_FILE).read_text())


def prepared_family(metadata: dict):
    """The model family a prepared dataset was tokenized for (data of an older textsql names none: T5's)."""
    return family_named(metadata.get("model_family", "t5"))


def load_tables(path: str | Path) -> dict[str, dict]:
    tables_file = Path(path) / TABLES_FILE
    if not tables_file.is_file():
        return {}
    with open(tables_file, encoding="utf-8") as f:
        return {t["id"]: t for t in map(json.loads, f)}


def tokenizer_for_training(model_tokenizer, dataset_dir: str | Path, metadata: dict):
    """The tokenizer to train with: the model's own, or the prepared data's copy of it with the characters it lacked.

    Refuses data tokenized with another tokenizer.
    """

    have = tokenizer_fingerprint(model_tokenizer)
    if have == metadata.get("tokenizer_fingerprint") or "tokenizer_fingerprint" not in metadata:
        return model_tokenizer
    if metadata.get("tokenizer_dir") and have == metadata.get("base_tokenizer_fingerprint"):
        return load_tokenizer(str(Path(dataset_dir) / metadata["tokenizer_dir"]))
    raise TextsqlError(
        f"'{dataset_dir}' was tokenized with '{metadata.get('tokenizer')}', whose vocabulary differs from this model's "
        "tokenizer. Run `textsql prep` again with --model_id set to the model you train."
    )


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
