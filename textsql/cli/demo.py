"""`textsql demo`: generated data, a tiny T5 (or causal LM: --family causal) trained with ZeRO-2 on this machine, its
scores and summary."""

from __future__ import annotations

from pathlib import Path

from textsql.arguments.demo import DemoArguments
from textsql.cli.parsing import parse_arguments
from textsql.demo import DEMO_ACCURACY_NOTE, run_demo
from textsql.evaluate import format_components
from textsql.paths import SUMMARY_FILE
from textsql.run_summary import format_summary


def demo_command(argv: list[str]) -> int:
    args = parse_arguments(DemoArguments, "demo", argv)
    result = run_demo(args)
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
        "  textsql demo --family causal                 # the same with a tiny causal LM (Qwen2-shaped)\n"
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
