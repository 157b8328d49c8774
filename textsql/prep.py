"""Prepare WikiSQL for training: load a source, tokenize it as the model's family reads it (T5: a prefixed source and
a separate target; a causal LM: prompt and SQL in one sequence), no fixed padding, report lengths, save to disk (the
folder's format: textsql.prepared; the sources' format: textsql.prompts)."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from textsql import __version__
from textsql.arguments.prep import PrepArguments
from textsql.errors import TextsqlError
from textsql.families import AUTO, best_setting
from textsql.hub import load_tokenizer, model_family
from textsql.paths import METADATA_FILE, TOKENIZER_DIR
from textsql.prepared import save_prepared
from textsql.prompts import FittedSource, fitted_source, table_values
from textsql.vocabulary import add_characters, byte_level, missing_characters, tokenizer_fingerprint
from textsql.wikisql.format import VALUES_FORMAT, Example, WikiSQLData
from textsql.wikisql.release import load_wikisql
from textsql.wikisql.sql import SQLParseError, parse_sql, same_logical_form
from textsql.wikisql.synthetic import generate_wikisql

logger = logging.getLogger(__name__)

# A source without a dev split (a subset, the release slice in shared/real) gets this fraction of train's tables held out
# as validation by default, so that a default `textsql train`, which evaluates each epoch, can.
DEFAULT_VALIDATION_FROM_TRAIN = 0.1
PERCENTILES = (50, 90, 95, 99, 100)


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
    data = _split_source(data, args)
    args = _settle_formats(args, data, family, base_tokenizer)
    splits = {name: examples[: args.max_examples_per_split] for name, examples in data.splits.items()}
    settings, values, sources = _whole_sources(splits, data.tables, family, args)
    tokenizer, missing = _complete_tokenizer(base_tokenizer, splits, sources, output_dir, args.model_id)
    settings["prompt_format"] = args.prompt_format if family.causal else None
    fits = _fit_sources(splits, data.tables, settings, values, tokenizer, args.max_source_length)
    dataset, fitted = _tokenize(splits, fits, tokenizer, family, args)
    report = length_report(dataset, args.max_source_length, args.max_target_length)
    lost = _check_targets(dataset, tokenizer, data.tables, args.model_id)
    if not family.causal:  # a causal LM's examples were fitted or dropped as they were tokenized
        dataset = apply_overlong_policy(dataset, report, args)
    metadata = {
        "source": data.source if args.source != "generate" else "generate",
        "tokenizer": args.model_id,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "base_tokenizer_fingerprint": tokenizer_fingerprint(base_tokenizer),
        "tokenizer_dir": TOKENIZER_DIR if tokenizer is not base_tokenizer else None,
        "added_characters": missing["unknown"],
        "characters_changed_by_normalizer": missing["normalized"],
        "source_prefix": settings["source_prefix"],
        "source_format": args.source_format,
        "layout": family.kind,
        "prompt_format": settings["prompt_format"],
        "model_family": family.name,
        "byte_level": byte_level(base_tokenizer),
        "prompts_fitted": fitted,
        "values_per_column": args.values_per_column,
        "max_values": args.max_values,
        "values_listed": _values_listed(fits) if args.source_format == VALUES_FORMAT else None,
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
    return save_prepared(output_dir, dataset, data, splits, metadata)


def _split_source(data: WikiSQLData, args: PrepArguments) -> WikiSQLData:
    """The source's splits as prep keeps them: a train split required, validation held out of it where the source has
    none, then the generated questions (--generated_train) added to train."""
    if not data.splits.get("train"):
        raise TextsqlError(
            f"Source '{args.source}' has no train split; found splits: {', '.join(data.splits) or 'none'}."
        )
    data = validation_split(data, args)  # before generated questions join train: validation stays the source's
    if args.generated_train:
        data = with_generated_train(data, args)
    return data


def _settle_formats(args: PrepArguments, data: WikiSQLData, family, base_tokenizer) -> PrepArguments:
    """The arguments with --source_format auto settled (the family's best, textsql.families.best_settings, said in one
    line), refused where the source or the model cannot have the formats asked for."""
    if args.source_format == AUTO:
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
    return args


def _whole_sources(splits: dict[str, list[Example]], tables: dict, family, args: PrepArguments):
    """(settings, values, sources): how the sources are built (the prompt format set once the tokenizer is final), each
    example's listed cell values, and its source whole and plain, as the tokenizer check reads it (fitted to
    --max_source_length only once the tokenizer is final)."""
    prefix = "" if family.causal else args.source_prefix  # a causal LM reads a plain prompt (source_text)
    settings = {**asdict(args), "source_prefix": prefix, "layout": family.kind, "prompt_format": None}
    values = {
        name: [table_values(e.question, tables.get(e.table_id), settings) for e in examples]
        for name, examples in splits.items()
    }
    whole = _fit_sources(splits, tables, settings, values)
    return settings, values, {name: [fit.text for fit in fits] for name, fits in whole.items()}


def _fit_sources(splits, tables: dict, settings: dict, values: dict, tokenizer=None, max_length: int | None = None):
    """Each split's sources (fitted_source, with each example's listed values): fitted with a tokenizer, else whole."""
    return {
        name: [
            fitted_source(e.question, tables.get(e.table_id), settings, tokenizer, max_length, values=listed)
            for e, listed in zip(examples, values[name])
        ]
        for name, examples in splits.items()
    }


def _complete_tokenizer(base_tokenizer, splits: dict[str, list[Example]], sources: dict, output_dir: Path, model_id):
    """(tokenizer, missing): the model's tokenizer, or a copy saved in the folder with the characters it cannot
    produce added. Every character the model reads or learns to write must be one it can produce: it reads every
    split's sources (questions, columns, cells: inputs) and learns train's answers; the held-out answers are what it
    is scored on, never read here."""
    missing = missing_characters(
        base_tokenizer,
        (text for name in splits for text in sources[name] + [e.target for e in splits[name] if name == "train"]),
    )
    if byte_level(base_tokenizer):
        logger.info(
            "'%s' is a byte-level BPE tokenizer: it writes every character, so nothing is added to its vocabulary%s.",
            model_id,
            f" (yet it cannot produce {missing['unknown']})" if missing["unknown"] else "",
        )
    if not missing["unknown"]:
        return base_tokenizer, missing
    tokenizer = add_characters(base_tokenizer, missing["unknown"], output_dir / TOKENIZER_DIR)
    logger.info(
        "Added %d characters that '%s' cannot produce to its vocabulary: %s",
        len(missing["unknown"]),
        model_id,
        ", ".join(repr(c) for c in missing["unknown"]),
    )
    return tokenizer, missing


def _tokenize(splits: dict[str, list[Example]], fits: dict[str, list[FittedSource]], tokenizer, family, args):
    """(dataset, what was fitted per split): the family's layout (tokenize_causal, tokenize_splits), the sources that
    lost cell values to fit said."""
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
    return dataset, fitted


def _values_listed(fits: dict[str, list[FittedSource]]) -> dict:
    """Per split, the sources and how many list cell values, and how many values, as fitted (before --overlong)."""
    return {
        name: {
            "sources": len(split),
            "prompts_with_values": sum(bool(f.values) for f in split),
            "values": sum(f.values for f in split),
        }
        for name, split in fits.items()
    }


def _check_targets(dataset, tokenizer, tables: dict, model_id: str) -> dict:
    """characters_lost_in_targets, said: the column names a tokenizer rewrites (scoring still matches them) as
    information, the targets the model cannot write exactly as a warning."""
    lost = characters_lost_in_targets(dataset, tokenizer, tables)
    recovered = lost["column_names_recovered"]
    if recovered["examples"]:
        logger.info(
            "%d target SQL strings come back from '%s' with column names rewritten (%s); scoring matches "
            "column names as the tokenizer writes them, so they still score right.",
            recovered["examples"],
            model_id,
            ", ".join(f"{c!r} x{n}" for c, n in recovered["characters"].items()),
        )
    if lost["examples"]:
        logger.warning(
            "%d target SQL strings do not survive tokenize -> decode with '%s' (characters it rewrites: %s); the model "
            "cannot generate them exactly, so those examples cannot be scored right.",
            lost["examples"],
            model_id,
            ", ".join(f"{c!r} x{n}" for c, n in lost["characters"].items()),
        )
    return lost


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
