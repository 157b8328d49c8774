"""Batched SQL generation with a fine-tuned model, scored the WikiSQL way: predictions.jsonl and eval_metrics.json."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

from textsql.arguments.infer import InferArguments
from textsql.errors import TextsqlError
from textsql.evaluate import (
    choose_prediction,
    constrained,
    decode_and_score,
    execution_guided,
    format_metrics,
    generate_sql,
    load_scoring_set,
)
from textsql.families import best_setting, family_of
from textsql.loading import load_for_inference
from textsql.paths import METRICS_FILE, PREDICTIONS_FILE
from textsql.prepared import load_prepared, load_tables
from textsql.prompts import check_source_settings, model_source
from textsql.wikisql.sql import SQLExecutionError, SQLParseError, execute_query, parse_sql


def run_inference(args: InferArguments, echo=print) -> dict:
    """Generate for a split (or typed questions), score, write the two files, print examples and scores; returns the metrics."""
    prepared = load_prepared(args.dataset_dir)
    metadata = prepared[1]
    model, tokenizer = load_for_inference(args.model_dir, args.device, args.dtype)
    check_source_settings(model.config, metadata, args.dataset_dir)
    # auto: the model family's best decoding (textsql.families.best_settings); greedy for questions without a table
    has_tables = bool(args.table_id) if args.question else metadata.get("has_tables", True)
    args = replace(args, decoding=best_setting("decoding", args.decoding, family_of(model.config), has_tables))
    if args.question:
        return answer_questions(args, model, tokenizer, metadata, echo)
    scoring = load_scoring_set(
        args.dataset_dir, args.split, args.max_examples, prepared=prepared, spread=args.spread_examples
    )
    started = time.perf_counter()
    records, metrics = decode_and_score(
        model,
        tokenizer,
        scoring,
        decoding=args.decoding,
        num_beams=args.num_beams,
        compare_to_greedy=args.compare_to_greedy,
        greedy_predictions=read_greedy_predictions(args.greedy_predictions, scoring.questions),
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        echo=echo,
    )
    seconds = time.perf_counter() - started
    metrics.update(
        split=args.split,
        generation_seconds=round(seconds, 3),
        queries_per_second=round(len(records) / seconds, 2),
        model_dir=args.model_dir,
        dataset_dir=args.dataset_dir,
        device=str(next(model.parameters()).device),
        dtype=args.dtype,
        source_format=metadata.get("source_format", "question"),
        arguments=asdict(args),
    )
    output_dir = Path(args.output_dir or args.model_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / PREDICTIONS_FILE, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    (output_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    for record in records[: args.show_examples]:
        echo(format_example(record))
    echo(format_metrics(metrics))
    echo(f"wrote {output_dir / PREDICTIONS_FILE} and {output_dir / METRICS_FILE}")
    return metrics


def read_predictions(path: str | Path) -> list[dict]:
    """The records of a predictions.jsonl that run_inference wrote, in its order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def read_greedy_predictions(path: str | None, questions: list[str]) -> list[str] | None:
    """The predicted SQL of a greedy run's predictions.jsonl, checked to answer these questions in this order."""
    if path is None:
        return None
    try:
        records = read_predictions(path)
    except (OSError, ValueError) as error:
        raise TextsqlError(f"--greedy_predictions {path} cannot be read as predictions.jsonl: {error}") from None
    if [record.get("question") for record in records] != questions:
        raise TextsqlError(
            f"--greedy_predictions {path} answers other questions than these {len(questions)}: pass the "
            "predictions.jsonl of a greedy `textsql infer` with the same --dataset_dir, --split and --max_examples."
        )
    return [record["predicted_sql"] for record in records]


def answer_questions(args: InferArguments, model, tokenizer, metadata: dict, echo) -> dict:
    """Typed questions: print the SQL, and when a table is named, its parse and result."""
    source_format = metadata.get("source_format", "question")
    table = None
    if args.table_id:
        table = load_tables(args.dataset_dir).get(args.table_id)
        if table is None:
            raise TextsqlError(f"Table '{args.table_id}' is not in '{args.dataset_dir}/tables.jsonl'.")
    elif source_format != "question" or args.decoding != "greedy":
        raise TextsqlError(
            f"The model reads '{source_format}' sources and decodes {args.decoding}: name the questions' table with "
            "--table_id (an id from tables.jsonl)."
        )
    sources = [model_source(q, table, metadata, tokenizer) for q in args.question]
    candidates = generate_sql(
        model,
        tokenizer,
        sources,
        batch_size=args.batch_size,
        num_beams=args.num_beams,
        num_candidates=args.num_beams if execution_guided(args.decoding) else 1,
        max_new_tokens=args.max_new_tokens,
        progress=False,
        constrain_to=[(q, table) for q in args.question] if constrained(args.decoding) else None,
    )
    answers = []
    for question, options in zip(args.question, candidates):
        predicted, _ = choose_prediction(options, table, args.decoding)
        answer = {"question": question, "predicted_sql": predicted}
        if table is not None:
            try:
                answer["parsed"] = parse_sql(predicted, table["header"], table.get("rows"))
                answer["result"] = execute_query(answer["parsed"], table)
            except (SQLParseError, SQLExecutionError) as error:
                answer["error"] = str(error)
        echo(
            f"Test Instruction: {question}\nModel Prediction: {predicted}"
            + (f"\nResult: {answer.get('result', answer.get('error'))}" if table else "")
            + "\n"
        )
        answers.append(answer)
    return {"answers": answers}


def shorten_repeats(text: str, keep: int = 3) -> str:
    """A word or a piece repeated many times in a row (an untrained model's "Week Week Week ..." or "uiluiluil...")
    shown once with a count, so one example stays one line; the files keep the text as generated."""
    text = re.sub(rf"(\S+)(?: \1){{{keep},}}", lambda m: f"{m.group(1)} … (×{len(m.group(0).split())})", text)
    # a piece of 2 to 12 characters 5 times or more: long enough that a number like 100000 is left alone
    return re.sub(r"(\S{2,12}?)\1{4,}", lambda m: f"{m.group(1)} … (×{len(m.group(0)) // len(m.group(1))})", text)


def format_example(record: dict) -> str:
    """The walkthrough's format, plus what the scorer said."""
    if record.get("parse_error"):
        verdict = "unparseable: " + shorten_repeats(record["parse_error"])
    elif record["execution_match"]:
        verdict = "execution ✓"
    else:
        verdict = "execution ✗; wrong: " + ", ".join(record.get("wrong_parts") or ["the result only"])
    return (
        f"Test Instruction: {record['question']}\nModel Prediction: {shorten_repeats(record['predicted_sql'])}\n"
        f"Expected Answer: {record['gold_sql']}\n({verdict})\n"
    )
