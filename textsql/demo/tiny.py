"""The tiny demo (--tiny, and where the real model cannot be had): generated WikiSQL-format data, a locally trained
tokenizer and a tiny T5 or causal LM, and a short ZeRO-2 run on this machine."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from textsql.arguments.decoding import execution_guided
from textsql.arguments.demo import DEMO_FAMILIES, DEMO_MODEL_FAMILIES, DemoArguments
from textsql.arguments.infer import InferArguments
from textsql.arguments.prep import PrepArguments
from textsql.arguments.training import DataArguments, ModelArguments, TextsqlTrainingArguments
from textsql.demo.steps import demo_step
from textsql.evaluate import load_scoring_set, score_predictions
from textsql.families import AUTO, best_setting, family_named
from textsql.infer import run_inference
from textsql.paths import DEMO_RUNS_DIR, METADATA_FILE
from textsql.prep import prepare_dataset
from textsql.prepared import load_prepared
from textsql.tiny import corpus_for_tokenizer, make_tiny_causal_model, make_tiny_model
from textsql.train.estimate import TrainingTimer
from textsql.train.run import train
from textsql.wikisql.format import render_sql
from textsql.wikisql.release import read_jsonl
from textsql.wikisql.synthetic import generate_wikisql

DEMO_PREFIX = "translate English to SQL: "
DEMO_ACCURACY_NOTE = (
    "note: this checks the pipeline, not the recipe's accuracy: a tiny model trained from scratch for minutes on a CPU "
    "learns the query's shape (the parts above), not to copy values from the question (the tiny T5: 1-6% execution accuracy, "
    "whatever the data size or format). `textsql demo` without --tiny fine-tunes a pretrained model (SmolLM2-135M-"
    "Instruct) on real WikiSQL lines on this CPU and scores it; recipes/ has larger ones (t5-small, Qwen2.5) for a GPU."
)


def release_records(folder: Path) -> tuple[list[dict], list[dict]]:
    """(questions, tables) of every split in a release-format folder."""

    questions, tables = [], []
    for path in sorted(folder.glob("*.jsonl")):
        (tables if path.name.endswith(".tables.jsonl") else questions).extend(read_jsonl(path))
    return questions, tables


def build_assets(
    workdir: Path,
    *,
    train_tables: int = 300,
    questions_per_table: int = 10,
    d_model: int = 128,
    num_layers: int = 2,
    seed: int = 0,
    source_format: str = AUTO,
    family: str = "t5",
) -> tuple[Path, Path]:
    """Generated release files, a tiny model folder (T5, or with family "causal" a Qwen2-shaped causal LM) and the
    prepared dataset (one folder per family and source format: the family's best, auto, in data/ or data-causal/);
    reused when already there. Returns (data_dir, model_dir)."""

    model_name, _, data_name = DEMO_FAMILIES[family]
    workdir = Path(workdir)
    raw_dir, model_dir = workdir / "wikisql-generated", workdir / model_name
    best = best_setting("source_format", AUTO, family_named(DEMO_MODEL_FAMILIES[family]))  # generated data has tables
    source_format = best_setting("source_format", source_format, family_named(DEMO_MODEL_FAMILIES[family]))
    data_dir = workdir / (data_name if source_format == best else f"{data_name}-{source_format}")
    if not (raw_dir / "train.jsonl").exists():
        held_out = max(1, train_tables // 5)
        generate_wikisql(
            raw_dir,
            train_tables=train_tables,
            dev_tables=held_out,
            test_tables=held_out,
            questions_per_table=questions_per_table,
            seed=seed,
        )
    if not (model_dir / "config.json").exists():
        # The tokenizer sees every split's text, as a pretrained tokenizer has seen the web; the model sees only train.
        questions, tables = release_records(raw_dir)
        if family == "causal":  # a causal LM's prompt has no task prefix (textsql.prep)
            make_tiny_causal_model(
                model_dir,
                corpus_for_tokenizer(questions, tables, prefix="", layout="causal"),
                hidden_size=d_model,
                num_layers=num_layers,
                seed=seed,
            )
        else:
            # No dropout: the tiny model underfits in the demo's short run, and dropout only slows it down.
            make_tiny_model(
                model_dir,
                corpus_for_tokenizer(questions, tables, prefix=DEMO_PREFIX),
                d_model=d_model,
                num_layers=num_layers,
                d_ff=4 * d_model,
                dropout_rate=0.0,
                seed=seed,
            )
    metadata = data_dir / METADATA_FILE
    # an older textsql's demo folder may hold another format there (it prepared the question alone): prepared again
    if not metadata.exists() or json.loads(metadata.read_text()).get("source_format") != source_format:
        prepare_dataset(
            PrepArguments(
                source=str(raw_dir),
                model_id=str(model_dir),
                output_dir=str(data_dir),
                source_prefix=DEMO_PREFIX,
                source_format=source_format,
                overwrite=True,
            )
        )
    return data_dir, model_dir


def demo_training(args: DemoArguments, data_dir: Path, model_dir: Path):
    """(model, data, training arguments) of the demo's run: a tiny model learns from many small, fast updates. The run
    goes to runs/<the model's folder name> (runs/tiny-qwen2), where the README's and the notebooks' next steps find it."""
    runs_root = Path(args.workdir) / DEMO_RUNS_DIR
    training = TextsqlTrainingArguments(
        runs_root=str(runs_root),
        output_dir=str(runs_root / DEMO_FAMILIES[args.family][0]),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=2e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=50,
        logging_steps=50,
        seed=args.seed,
        deepspeed=None if args.deepspeed == "none" else args.deepspeed,
        overwrite=True,  # the demo's own folder: running it again trains again
    )
    return (
        ModelArguments(model_id=str(model_dir)),
        DataArguments(dataset_dir=str(data_dir)),  # the SQL scored once, at the end (200 validation questions)
        training,
    )


@dataclass
class DemoResult:
    """What the demo did: the run's summary, its scores on the generated test split and a trivial baseline's."""

    summary: object  # textsql.run_summary.RunSummary
    test_metrics: dict
    baseline_metrics: dict
    mean_real_tokens_per_example: float


DEMO_STEPS = 4
# The demo's tensors are tiny (batches of 16 x ~40 tokens, width 128): a second OpenMP thread gains little, and where
# another process holds a core it waits at every operation's barrier. Measured on 2 cores at load 5-7, 100 steps of the
# demos' trainings: one thread 5-7x the samples/s of two, the T5's and the causal LM's alike (bench/README.md,
# "demo_speed.py").
DEMO_THREADS = 1


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op threads set to `count` inside, as they were after; OMP_NUM_THREADS too, which accelerate reads:
    where it is unset, accelerate sets torch's threads to the cores per rank when a CPU run starts its process group
    (ZeRO on the CPU), over what was set here."""
    import torch

    before, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(count)
    os.environ["OMP_NUM_THREADS"] = str(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if variable is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = variable


def demo_train(args: DemoArguments, data_dir: Path, model_dir: Path, echo=print):
    """The demo's training on one thread, timed by its first steps: (run summary, estimated seconds or None)."""
    examples = json.loads((data_dir / METADATA_FILE).read_text())["examples"]
    timer = TrainingTimer(echo, examples.get("validation", 0))
    with torch_threads(DEMO_THREADS):
        summary = train(*demo_training(args, data_dir, model_dir), callbacks=[timer])
    return summary, timer.estimate_s


def run_tiny_demo(args: DemoArguments, echo=print) -> DemoResult:
    """Build the assets, train, score the model on the generated test split and a trivial baseline, saying what each
    step is and how long it took."""
    import datasets

    datasets.disable_progress_bars()  # the terminal shows training's progress bar, not one per file written
    questions = args.train_tables * args.questions_per_table
    _, model_name, _ = DEMO_FAMILIES[args.family]
    echo(
        f"textsql demo: {questions:,} generated training questions, a {model_name} trained for {args.epochs:g} epochs with "
        f"{args.deepspeed}; its first training steps are timed to tell how long the rest takes on this machine. "
        f"Shorter: --epochs 2 or --train_tables 100 (the scores drop). Everything goes to "
        f"{Path(args.workdir).absolute()}."
    )
    with demo_step(
        echo,
        1,
        f"data, tokenizer and model: generated WikiSQL, a tokenizer trained on it, a {model_name}, prep",
        DEMO_STEPS,
    ):
        data_dir, model_dir = build_assets(
            Path(args.workdir),
            train_tables=args.train_tables,
            questions_per_table=args.questions_per_table,
            d_model=args.d_model,
            num_layers=args.num_layers,
            seed=args.seed,
            source_format=args.source_format,
            family=args.family,
        )
    with demo_step(echo, 2, f"training ({args.deepspeed}; the progress bar shows the steps left)", DEMO_STEPS):
        summary, _ = demo_train(args, data_dir, model_dir, echo)
    metadata = json.loads((data_dir / METADATA_FILE).read_text())
    beams = 4 if execution_guided(args.decoding) else 1
    scoring = "scoring the test split as WikiSQL's evaluate.py does"
    with demo_step(echo, 3, scoring, DEMO_STEPS), torch_threads(DEMO_THREADS):
        test = run_inference(
            InferArguments(
                model_dir=summary.output_dir,
                dataset_dir=str(data_dir),
                split="test",
                show_examples=3,
                decoding=args.decoding,
                num_beams=beams,
            ),
            echo=echo,
        )
    with demo_step(echo, 4, "a trivial baseline for comparison", DEMO_STEPS):
        baseline = trivial_baseline(data_dir)
    return DemoResult(summary, test, baseline, metadata["lengths"]["train"]["mean_tokens_per_example"])


def trivial_baseline(data_dir: Path) -> dict:
    """Scores of a model that ignores the question: the training split's most common aggregation over the first column, no conditions."""
    from collections import Counter

    prepared = load_prepared(data_dir)
    train = load_scoring_set(str(data_dir), "train", prepared=prepared)
    agg = Counter(q["agg"] for q in train.gold_queries if q).most_common(1)[0][0]
    test = load_scoring_set(str(data_dir), "test", prepared=prepared)
    guesses = [render_sql({"sel": 0, "agg": agg, "conds": []}, test.tables[t]["header"]) for t in test.table_ids]
    return score_predictions(test, guesses)[1]
