"""SQL quality of the demo-sized model: each source format x each decoding, scored as WikiSQL's evaluate.py scores.

    python bench/sql_quality.py                              # demo sizes: 300 training tables, tiny T5, 8 epochs
    python bench/sql_quality.py --epochs 2 --output q.json   # quicker

For each --source_format it prepares the generated data (textsql.demo.tiny.build_assets), trains the demo's tiny T5 from
scratch in a child process (textsql.train.local_launch.run_training, no DeepSpeed: the strategy does not change what is learned),
then scores the generated test split with greedy and execution-guided decoding (textsql.infer.run_inference). It
prints one JSON object: per format and decoding the execution, logical-form and exact-match accuracy, the component
accuracies and how often execution-guided decoding changed the answer, with the machine and the training figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)

DECODINGS = (("greedy", 1), ("execution_guided", 4))


def train_one(args, source_format: str) -> tuple[dict, Path]:
    """(run summary, prepared data folder) of the demo-sized model trained on one source format."""
    from textsql.arguments.demo import DemoArguments
    from textsql.demo.tiny import build_assets, demo_training
    from textsql.train.local_launch import run_training

    demo = DemoArguments(
        workdir=str(Path(args.workdir) / source_format),
        deepspeed="none",
        train_tables=args.train_tables,
        epochs=args.epochs,
        seed=args.seed,
        source_format=source_format,
    )
    data_dir, model_dir = build_assets(
        Path(demo.workdir),
        train_tables=demo.train_tables,
        questions_per_table=demo.questions_per_table,
        d_model=demo.d_model,
        num_layers=demo.num_layers,
        seed=demo.seed,
        source_format=source_format,
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return run_training(*demo_training(demo, data_dir, model_dir), echo=lambda line: None), data_dir


def score(run_dir: str, data_dir: Path, decoding: str, beams: int, output_dir: Path) -> dict:
    from textsql.arguments.infer import InferArguments
    from textsql.infer import run_inference

    metrics = run_inference(
        InferArguments(
            model_dir=run_dir,
            dataset_dir=str(data_dir),
            split="test",
            decoding=decoding,
            num_beams=beams,
            output_dir=str(output_dir),
            show_examples=0,
        ),
        echo=lambda line: None,
    )
    keep = (
        "examples",
        "execution_accuracy",
        "logical_form_accuracy",
        "exact_match",
        "parse_errors",
        "components",
        "decoding",
        "queries_per_second",
    )
    return {key: metrics[key] for key in keep}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="question,question+header", help="Comma-separated source formats.")
    parser.add_argument("--train_tables", type=int, default=300)
    parser.add_argument("--epochs", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "textsql-bench-quality"))
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    args = parser.parse_args(argv)
    started = time.time()
    results = []
    for source_format in args.formats.split(","):
        summary, data_dir = train_one(args, source_format)
        for decoding, beams in DECODINGS:
            scored = score(
                summary.output_dir, data_dir, decoding, beams, Path(args.workdir) / source_format / f"scored-{decoding}"
            )
            results.append(
                {
                    "source_format": source_format,
                    "decoding": decoding,
                    "num_beams": beams,
                    **scored,
                    "training": {
                        k: getattr(summary, k)
                        for k in ("parameters", "global_step", "epochs", "train_runtime", "train_loss", "eval_loss")
                    },
                }
            )
    report = {
        "benchmark": "sql_quality",
        "date": time.strftime("%Y-%m-%d"),
        "wall_seconds": round(time.time() - started, 1),
        "data": f"generated WikiSQL-format, {args.train_tables} training tables x 10 questions; test split on other tables",
        "machine": machine(),
        "results": results,
    }
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
