"""Batched SQL generation with a fine-tuned model, scored the WikiSQL way: predictions.jsonl and eval_metrics.json."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from textsql.checkpoints import verify_checkpoint
from textsql.errors import TextsqlError

PREDICTIONS_FILE = "predictions.jsonl"
METRICS_FILE = "eval_metrics.json"
DECODINGS = ("greedy", "execution_guided")
DTYPES = ("float32", "bfloat16")


@dataclass
class InferArguments:
    """Which model, which questions, and how to decode."""

    model_dir: str = field(metadata={"help": "A fine-tuned model folder (the run folder of any strategy) or a hub name."})
    dataset_dir: str = field(default="data/wikisql", metadata={"help": "Prepared dataset (textsql prep) holding the split and its tables."})
    split: str = field(default="test", metadata={"help": "Split to score: test, validation or train."})
    question: list[str] = field(default_factory=list, metadata={"help": "Questions typed by you, instead of a split: --question 'How many ...?' 'Which ...?'"})
    table_id: str | None = field(default=None, metadata={"help": "With --question: the table the questions are about, to parse and execute the SQL."})
    max_examples: int | None = field(default=None, metadata={"help": "Score only the first N examples of the split."})
    batch_size: int = field(default=64, metadata={"help": "Questions per generate() call."})
    decoding: str = field(
        default="greedy",
        metadata={"help": "greedy (with --num_beams > 1: the top beam of beam search), or execution_guided: of the "
                  "--num_beams candidates, the best-scored one that parses against the table's header and executes (and, "
                  "without aggregation, returns a row); the top beam when none does."},
    )
    num_beams: int = field(default=1, metadata={"help": "1 for greedy decoding, more for beam search (at least 2 with execution_guided)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Longest SQL to generate, in tokens."})
    device: str = field(default="auto", metadata={"help": "auto (GPU when there is one), cuda, or cpu."})
    dtype: str = field(
        default="float32",
        metadata={"help": "Weights' dtype at inference: float32 (every strategy saves the model in it, so scores compare), "
                  "or bfloat16 (faster on Ampere and newer GPUs)."},
    )
    output_dir: str | None = field(default=None, metadata={"help": "Where predictions.jsonl and eval_metrics.json go (default: the model folder)."})
    show_examples: int = field(default=5, metadata={"help": "How many examples to print in the walkthrough's format."})

    def __post_init__(self):
        if self.batch_size < 1 or self.num_beams < 1 or self.max_new_tokens < 1:
            raise TextsqlError("--batch_size, --num_beams and --max_new_tokens must be at least 1.")
        if self.max_examples is not None and self.max_examples < 1:
            raise TextsqlError("--max_examples must be a positive number (or left out for the whole split).")
        if self.device not in ("auto", "cuda", "cpu"):
            raise TextsqlError(f"--device must be auto, cuda or cpu, not '{self.device}'.")
        if self.dtype not in DTYPES:
            raise TextsqlError(f"--dtype must be one of {', '.join(DTYPES)}, not '{self.dtype}'.")
        check_decoding(self.decoding, self.num_beams)


def check_decoding(decoding: str, num_beams: int, flag: str = "--") -> None:
    if decoding not in DECODINGS:
        raise TextsqlError(f"{flag}decoding must be one of {', '.join(DECODINGS)}, not '{decoding}'.")
    if num_beams < 1:
        raise TextsqlError(f"{flag}num_beams must be at least 1.")
    if decoding == "execution_guided" and num_beams < 2:
        raise TextsqlError(f"{flag}decoding execution_guided chooses among beam-search candidates: pass {flag}num_beams 4 (at least 2).")


def decoding_label(decoding: str, num_beams: int) -> str:
    if decoding == "execution_guided":
        return f"execution-guided ({num_beams} beams)"
    return "greedy" if num_beams == 1 else f"beam search ({num_beams} beams)"


def pick_device(choice: str):
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise TextsqlError("--device cuda was asked for, but no CUDA GPU is visible; use --device auto or cpu.")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def generate_sql(model, tokenizer, sources: list[str], *, batch_size: int = 64, num_beams: int = 1, num_candidates: int = 1,
                 max_new_tokens: int = 128, synced_gpus: bool = False, progress: bool = True, device=None) -> list[list[str]]:
    """The `num_candidates` best generations (beam order) for each source, batch by batch, longest first so each batch
    pads little; input order kept."""
    import torch
    from tqdm.auto import tqdm

    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    outputs: list[list[str]] = [[] for _ in sources]
    # Under ZeRO-3 parameters are placeholders, so the caller names the device.
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    batches = range(0, len(order), batch_size)
    for start in tqdm(batches, desc="generating", unit="batch", disable=not progress):
        indices = order[start : start + batch_size]
        encoded = tokenizer([sources[i] for i in indices], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            generated = model.generate(**encoded, num_beams=num_beams, num_return_sequences=num_candidates,
                                       max_new_tokens=max_new_tokens, synced_gpus=synced_gpus)
        texts = [" ".join(text.split()) for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]
        for n, i in enumerate(indices):
            outputs[i] = texts[n * num_candidates : (n + 1) * num_candidates]
    model.train(was_training)
    return outputs


def choose_prediction(candidates: list[str], table: dict | None, decoding: str) -> tuple[str, int]:
    """(prediction, its rank among the candidates): the top one, or with execution_guided the first that executes
    plausibly on the table (textsql.sql.executes_plausibly), falling back to the top one."""
    from textsql.sql import executes_plausibly

    if decoding == "execution_guided" and table is not None:
        for rank, text in enumerate(candidates):
            if executes_plausibly(text, table):
                return text, rank
    return candidates[0], 0


@dataclass
class ScoringSet:
    """Questions with their gold SQL, structured queries and tables, ready to generate for and score."""

    sources: list[str]
    questions: list[str]
    table_ids: list[str]
    gold_texts: list[str]
    gold_queries: list[dict | None]
    tables: dict[str, dict]


def load_scoring_set(dataset_dir: str, split: str, max_examples: int | None = None, prepared: tuple | None = None) -> ScoringSet:
    """The split's questions, gold queries and tables; `prepared` is load_prepared(dataset_dir) when the caller has it."""
    from textsql.data import load_prepared, load_tables, source_text

    dataset, metadata = prepared if prepared is not None else load_prepared(dataset_dir)
    if split not in dataset:
        raise TextsqlError(f"'{dataset_dir}' has no '{split}' split; it has {', '.join(dataset)}.")
    rows = dataset[split]
    if max_examples:
        rows = rows.select(range(min(max_examples, len(rows))))
    tables = load_tables(dataset_dir)
    source_format = metadata.get("source_format", "question")

    def header(table_id: str):
        return tables[table_id]["header"] if table_id in tables else None

    return ScoringSet(
        sources=[source_text(q, header(t), metadata["source_prefix"], source_format) for q, t in zip(rows["question"], rows["table_id"])],
        questions=list(rows["question"]),
        table_ids=list(rows["table_id"]),
        gold_texts=list(rows["target"]),
        gold_queries=[json.loads(s) if s else None for s in rows["sql"]],
        tables=tables,
    )


def score_predictions(scoring: ScoringSet, predictions: list[str]) -> tuple[list[dict], dict]:
    """Per-example records for predictions.jsonl and the aggregate metrics."""
    from textsql.sql import aggregate_metrics, exact_match, score_prediction

    records, scored, gold_queries = [], [], []
    for i, predicted in enumerate(predictions):
        table = scoring.tables.get(scoring.table_ids[i])
        gold_query = scoring.gold_queries[i]
        if table is None or gold_query is None:
            # Hub copies without tables: only the exact string match can be judged.
            result = {"exact_match": exact_match(predicted, scoring.gold_texts[i]),
                      "logical_form_match": None, "execution_match": None, "parsed": None, "parse_error": "no table to parse against"}
        else:
            result = score_prediction(predicted, scoring.gold_texts[i], gold_query, table)
            scored.append(result)
            gold_queries.append(gold_query)
        records.append({
            "question": scoring.questions[i], "table_id": scoring.table_ids[i], "gold_sql": scoring.gold_texts[i],
            "predicted_sql": predicted, **result,
        })
    if not scored:
        raise TextsqlError("None of these examples has a table, so logical-form and execution accuracy cannot be computed; use a dataset prepared from the release files or the HF wikisql layout.")
    return records, aggregate_metrics(scored, gold_queries)


def decode_and_score(model, tokenizer, scoring: ScoringSet, *, decoding: str = "greedy", num_beams: int = 1, **generate_kwargs) -> tuple[list[dict], dict]:
    """Generate for every question of `scoring` with the decoding asked for, then score: (records, metrics).

    With execution_guided each record says which beam was taken ("candidate_rank") and whether that changed the
    answer from the top beam; the metrics count how often.
    """
    candidates = generate_sql(model, tokenizer, scoring.sources, num_beams=num_beams,
                              num_candidates=num_beams if decoding == "execution_guided" else 1, **generate_kwargs)
    chosen = [choose_prediction(options, scoring.tables.get(table_id), decoding) for options, table_id in zip(candidates, scoring.table_ids)]
    records, metrics = score_predictions(scoring, [text for text, _ in chosen])
    for record, (text, rank), options in zip(records, chosen, candidates):
        record["candidate_rank"] = rank
        record["decoding_changed"] = text != options[0]
    changed = sum(record["decoding_changed"] for record in records)
    metrics["decoding"] = {"method": decoding, "num_beams": num_beams, "label": decoding_label(decoding, num_beams),
                           "changed": changed, "changed_share": changed / len(records) if records else 0.0}
    return records, metrics


def load_model_for_inference(model_dir: str, device_choice: str, dtype: str = "float32"):
    import torch

    from textsql.hub import load_seq2seq_model, load_tokenizer

    if Path(model_dir).is_dir():
        verify_checkpoint(model_dir, recursive=False)  # pytorch_model.bin and the like are pickles: checked before loading
    tokenizer = load_tokenizer(model_dir)
    model = load_seq2seq_model(model_dir, dtype=getattr(torch, dtype)).to(pick_device(device_choice))
    return model, tokenizer


def run_inference(args: InferArguments, echo=print) -> dict:
    """Generate for a split (or typed questions), score, write the two files, print examples and scores; returns the metrics."""
    from textsql.data import check_source_settings, load_prepared

    prepared = load_prepared(args.dataset_dir)
    metadata = prepared[1]
    model, tokenizer = load_model_for_inference(args.model_dir, args.device, args.dtype)
    check_source_settings(model.config, metadata, args.dataset_dir)
    if args.question:
        return answer_questions(args, model, tokenizer, metadata, echo)
    scoring = load_scoring_set(args.dataset_dir, args.split, args.max_examples, prepared=prepared)
    started = time.perf_counter()
    records, metrics = decode_and_score(model, tokenizer, scoring, decoding=args.decoding, num_beams=args.num_beams,
                                        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - started
    metrics.update(
        split=args.split, generation_seconds=round(seconds, 3), queries_per_second=round(len(records) / seconds, 2),
        model_dir=args.model_dir, dataset_dir=args.dataset_dir, device=str(next(model.parameters()).device), dtype=args.dtype,
        source_format=metadata.get("source_format", "question"), arguments=asdict(args),
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


def answer_questions(args: InferArguments, model, tokenizer, metadata: dict, echo) -> dict:
    """Typed questions: print the SQL, and when a table is named, its parse and result."""
    from textsql.data import load_tables, source_text
    from textsql.sql import SQLExecutionError, SQLParseError, execute_query, parse_sql

    source_format = metadata.get("source_format", "question")
    table = None
    if args.table_id:
        table = load_tables(args.dataset_dir).get(args.table_id)
        if table is None:
            raise TextsqlError(f"Table '{args.table_id}' is not in '{args.dataset_dir}/tables.jsonl'.")
    elif source_format != "question" or args.decoding == "execution_guided":
        raise TextsqlError(f"The model reads '{source_format}' sources and decodes {args.decoding}: name the questions' table with "
                           "--table_id (an id from tables.jsonl).")
    sources = [source_text(q, table["header"] if table else None, metadata["source_prefix"], source_format) for q in args.question]
    candidates = generate_sql(model, tokenizer, sources, batch_size=args.batch_size, num_beams=args.num_beams,
                              num_candidates=args.num_beams if args.decoding == "execution_guided" else 1,
                              max_new_tokens=args.max_new_tokens, progress=False)
    answers = []
    for question, options in zip(args.question, candidates):
        predicted, _ = choose_prediction(options, table, args.decoding)
        answer = {"question": question, "predicted_sql": predicted}
        if table is not None:
            try:
                answer["parsed"] = parse_sql(predicted, table["header"])
                answer["result"] = execute_query(answer["parsed"], table)
            except (SQLParseError, SQLExecutionError) as error:
                answer["error"] = str(error)
        echo(f"Test Instruction: {question}\nModel Prediction: {predicted}" + (f"\nResult: {answer.get('result', answer.get('error'))}" if table else "") + "\n")
        answers.append(answer)
    return {"answers": answers}


def format_example(record: dict) -> str:
    """The walkthrough's format, plus what the scorer said."""
    if record.get("parse_error"):
        verdict = "unparseable: " + record["parse_error"]
    elif record["execution_match"]:
        verdict = "execution ✓"
    else:
        verdict = "execution ✗; wrong: " + ", ".join(record.get("wrong_parts") or ["the result only"])
    return (f"Test Instruction: {record['question']}\nModel Prediction: {record['predicted_sql']}\n"
            f"Expected Answer: {record['gold_sql']}\n({verdict})\n")


def format_components(components: dict) -> str:
    """The parts of the query right (textsql.sql.COMPONENTS), in one line."""
    return "parts right: " + ", ".join(f"{name.replace('_', ' ')} {share:.1%}" for name, share in components.items())


def format_metrics(metrics: dict) -> str:
    decoding = metrics.get("decoding", {})
    changed = f"; execution-guided changed {decoding['changed']}" if decoding.get("method") == "execution_guided" else ""
    lines = [f"{metrics['examples']} examples ({metrics.get('split', '')}, {decoding.get('label', 'greedy')}): "
             f"execution {metrics['execution_accuracy']:.1%}, logical form {metrics['logical_form_accuracy']:.1%}, "
             f"exact match {metrics['exact_match']:.1%} ({metrics['parse_errors']} unparseable{changed}; "
             f"{metrics.get('queries_per_second', 0):.1f} questions/s)"]
    if metrics.get("components"):
        lines.append(format_components(metrics["components"]))
    return "\n".join(lines)


def infer_cli(argv: list[str]) -> int:
    from textsql.cli import parse_arguments

    args = parse_arguments(InferArguments, "infer", argv)
    run_inference(args)
    return 0
