"""`textsql demo`: the real SmolLM2-135M-Instruct fine-tuned on the shipped WikiSQL lines and scored before and after;
with --tiny generated data and a tiny T5 (or causal LM: --family causal) trained with ZeRO-2; the scores and summary."""

from __future__ import annotations

import shlex
from pathlib import Path

from textsql.arguments.demo import DemoArguments
from textsql.cli.parsing import parse_arguments
from textsql.demo import run_demo
from textsql.demo.real import format_real_demo
from textsql.demo.tiny import DEMO_ACCURACY_NOTE, DemoResult
from textsql.evaluate import format_components
from textsql.paths import SUMMARY_FILE
from textsql.run_summary import format_summary


def demo_command(argv: list[str]) -> int:
    args = parse_arguments(DemoArguments, "demo", argv)
    result = run_demo(args)
    if not isinstance(result, DemoResult):
        return print_real_demo(result)
    print("\n=== textsql demo: run summary ===")
    print(format_summary(result.summary))
    print(f"mean real tokens per example: {result.mean_real_tokens_per_example:.1f}")
    test, baseline = result.test_metrics, result.baseline_metrics
    print(
        f"test split: execution {test['execution_accuracy']:.1%}, logical form {test['logical_form_accuracy']:.1%}, "
        f"exact match {test['exact_match']:.1%}  (trivial baseline: execution {baseline['execution_accuracy']:.1%})"
    )
    print(format_components(test["components"]))
    print(DEMO_ACCURACY_NOTE)
    print(f"full summary: {result.summary.output_dir}/{SUMMARY_FILE}")
    runs_root = Path(result.summary.output_dir).parent
    other = (
        "  textsql demo --tiny --family causal                 # the same with a tiny causal LM (Qwen2-shaped)\n"
        if args.family == "t5"
        else "  notebooks/finetune_causal_lm.ipynb           # LoRA, merge, quantize, compare (docs/causal-lm.md)\n"
    )
    print(
        "\nnext:\n"
        f"  textsql tensorboard --runs_root {runs_root}    # the losses, in a browser (127.0.0.1)\n"
        "  the README's quick start                     # prep, check-config, plan, train, infer, report on this data\n"
        f"{other}"
        "  bash scripts/bootstrap.sh lab                # the same steps as notebooks, in JupyterLab"
    )
    return 0


def print_real_demo(result) -> int:
    """The real demo's run summary, its report (textsql.demo.real.format_real_demo) and what to try next."""
    print("\n=== textsql demo: run summary ===")
    print(format_summary(result.summary))
    print(format_real_demo(result))
    run, runs_root = result.summary.output_dir, Path(result.summary.output_dir).parent
    asked = result.after_records[0]  # a question of yours goes the same way, about any table in the data folder
    print(
        "\nnext:\n"
        f"  textsql infer --model_dir {run} --dataset_dir {result.data_dir} --question "
        f"{shlex.quote(asked['question'])} --table_id {asked['table_id']}\n"
        f"  textsql compare before={result.model_dir} after={run} --dataset_dir {result.data_dir}   # side by side, in a browser\n"
        f"  textsql tensorboard --runs_root {runs_root}    # the losses (127.0.0.1)\n"
        "  docs/real-model.md                           # the full recipes: 76-79% on all 1,062 test questions\n"
        "  bash scripts/bootstrap.sh lab                # the same steps as notebooks, in JupyterLab"
    )
    return 0
