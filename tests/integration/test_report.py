"""The benchmark report: two real tiny runs (no DeepSpeed, ZeRO-2) -> table rows, Markdown, CSV, PNGs; plus row rules on made-up summaries."""

import json
import shutil
from pathlib import Path

import pytest

GIB = 1024**3
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "benchmark_report.ipynb"
EVAL_METRICS = {
    "split": "test",
    "examples": 96,
    "exact_match": 0.25,
    "logical_form_accuracy": 0.3,
    "execution_accuracy": 0.375,
    "parse_errors": 4,
    "queries_per_second": 50.0,
    "by_aggregation": {},
    "by_num_conditions": {},
    "components": {
        "select_column": 0.9,
        "aggregation": 0.8,
        "where_number": 0.7,
        "where_column": 0.6,
        "where_operator": 0.55,
        "where_value": 0.4,
    },
    "decoding": {
        "method": "execution_guided",
        "num_beams": 4,
        "label": "execution-guided (4 beams)",
        "changed": 3,
        "changed_share": 0.03,
    },
}


@pytest.fixture(scope="module")
def runs_copy(two_tiny_runs, tmp_path_factory):
    """The shared two runs, copied without model weights, with an eval_metrics.json beside the ZeRO-2 run's summary."""
    runs_root, summaries = two_tiny_runs
    copy = tmp_path_factory.mktemp("report") / "runs"
    shutil.copytree(runs_root, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "tokenizer*"))
    (copy / summaries["zero2"]["run"] / "eval_metrics.json").write_text(json.dumps(EVAL_METRICS))
    return copy, summaries


def assert_not_blank(png: Path, min_size=(250, 600)):
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[0] >= min_size[0] and pixels.shape[1] >= min_size[1], pixels.shape
    assert pixels[..., :3].var() > 1e-3, f"{png.name} is blank"
    colored = (pixels[..., :3].max(axis=-1) - pixels[..., :3].min(axis=-1) > 0.3).mean()
    assert colored > 0.002, f"{png.name} has no coloured bars or lines"


def test_report_rows_match_the_run_summaries(runs_copy, tmp_path, capsys):
    import pandas as pd

    from textsql.cli.report import report_cli

    runs_root, summaries = runs_copy
    out = tmp_path / "report"
    assert report_cli(["--runs_root", str(runs_root), "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| model | technique | nodes |" in printed and f"wrote {out / 'report.csv'}" in printed

    table = pd.read_csv(out / "report.csv")
    assert list(table["technique"]) == ["none", "zero2"]  # ordered: no DeepSpeed first
    for (_, row), label in zip(table.iterrows(), ["none", "zero2"]):
        summary = summaries[label]
        memory = summary["peak_memory_per_rank"]
        assert row["run"] == summary["run"] and row["model"] == "tiny-t5"
        assert row["nodes"] == 1 and row["world_size"] == summary["world_size"] == 1
        assert row["epochs"] == pytest.approx(summary["epochs"])
        assert row["duration_s"] == pytest.approx(summary["train_runtime"])
        assert row["samples_per_s"] == pytest.approx(summary["train_samples_per_second"])
        assert row["real_tokens_per_s"] == pytest.approx(summary["real_tokens_per_second"])
        assert row["memory_per_pod_gib"] == pytest.approx(max(m["cpu_peak_rss_bytes"] for m in memory) / GIB)
        assert row["memory_measure"].startswith("CPU peak RSS")  # no GPU here: labelled as such
        assert pd.isna(row["planned_memory_gib"]) and pd.isna(
            row["memory_vs_plan"]
        )  # the planner predicts GPU memory only
        assert row["eval_loss"] == pytest.approx(summary["eval_loss"])
        assert row["precision"] == "fp32"
    assert pd.isna(table.loc[0, "execution_accuracy"])  # no eval_metrics.json for the run without DeepSpeed
    assert (
        table.loc[1, "execution_accuracy"] == pytest.approx(0.375)
        and table.loc[1, "accuracy_split"] == "test (96 questions)"
    )
    assert (
        table.loc[1, "logical_form_accuracy"] == pytest.approx(0.3)
        and table.loc[1, "decoding"] == "execution-guided (4 beams)"
    )
    assert [table.loc[1, c] for c in ("select_column", "where_column", "where_value")] == [0.9, 0.6, 0.4]
    assert pd.isna(table.loc[0, "where_value"])

    markdown = (out / "report.md").read_text()
    assert "| model | technique | nodes | ranks | epochs | duration (s) | samples/s |" in markdown
    assert "| tiny-t5 | zero2 | 1 | 1 |" in markdown and "37.5%" in markdown  # shares as percentages, as everywhere
    assert (
        "| sel | agg | W# | Wcol | Wop | Wval |" in markdown
        and "| 90.0% | 80.0% | 70.0% | 60.0% | 55.0% | 40.0% |" in markdown
    )
    assert "![time_memory](time_memory.png)" in markdown and "![loss_curves](loss_curves.png)" in markdown
    for png in ("time_memory.png", "loss_curves.png"):
        assert_not_blank(out / png)


@pytest.mark.slow
def test_flops_profiler_figures_reach_the_summary_and_the_report(two_tiny_runs, tmp_path):
    """Both shared runs profiled step 3 (--flops_profiler 3): without DeepSpeed through a FlopsProfiler on the model,
    under ZeRO-2 through the engine's config block; DeepSpeed's own numbers in the summary, its table in the folder."""
    import pandas as pd

    from textsql.report import build_report
    from textsql.run_summary import format_summary, read_summary

    runs_root, summaries = two_tiny_runs
    table = build_report(runs_root, tmp_path / "report", plots=False).table
    for label, by in (("none", "FlopsProfiler on the model"), ("zero2", "DeepSpeed engine")):
        profile = summaries[label]["flops_profile"]
        assert profile["profiled"] is True and profile["step"] == 3 and by in profile["by"], profile
        assert profile["forward_flops"] > 0 and profile["forward_macs"] > 0 and profile["parameters"] > 0
        assert profile["flops_per_step"] == 3 * profile["forward_flops"]  # forward + backward, no accumulation
        assert 0 < profile["forward_latency_s"] < profile["step_latency_s"] < 60  # DeepSpeed's timer, not since 1970
        assert profile["tflops_per_gpu"] == pytest.approx(profile["flops_per_step"] / profile["step_latency_s"] / 1e12)
        assert profile["mfu"] is None and profile["peak"] == "no peak known (CPU)"
        row = table[table["technique"] == label].iloc[0]
        assert row["tflops_per_gpu"] == pytest.approx(profile["tflops_per_gpu"]) and pd.isna(row["mfu"])
        folder = runs_root / summaries[label]["run"]
        modules = (folder / "flops_profile.txt").read_text()
        assert "DeepSpeed Flops Profiler" in modules and "T5ForConditionalGeneration" in modules
        assert "T5Block" in modules and "T5Attention" in modules
        lines = format_summary(read_summary(folder))
        assert "flops profile  step 3: " in lines and "no peak known (CPU); per module: flops_profile.txt" in lines
    # The same tiny model and batch size: DeepSpeed's engine and the direct profiler count alike.
    assert summaries["none"]["flops_profile"]["parameters"] == summaries["zero2"]["flops_profile"]["parameters"]


@pytest.mark.slow
def test_deepspeed_monitors_and_comms_logger_write_into_the_run_folder(two_tiny_runs):
    """The ZeRO-2 run had --ds_monitor csv,tensorboard --comms_logger True."""
    import csv

    runs_root, summaries = two_tiny_runs
    folder = runs_root / summaries["zero2"]["run"]
    rows = list(csv.reader((folder / "ds_monitor" / "csv" / "Train_Samples_lr.csv").open()))
    assert rows[0] == ["step", "lr"] and len(rows) == 1 + 12  # one learning rate per optimizer step
    assert (folder / "ds_monitor" / "csv" / "Train_Samples_elapsed_time_ms_forward.csv").is_file()
    assert list((folder / "ds_monitor" / "tensorboard").glob("events.out.tfevents.*"))
    table = (folder / "comms_summary.txt").read_text()
    assert table.startswith("Comm. Op") and "all_reduce" in table
    operations = summaries["zero2"]["comms_summary"]["operations"]
    assert operations["all_reduce"]["count"] > 0 and operations["all_reduce"]["bytes"] > 0
    # Each operation's own latency (DeepSpeed 0.19.8 records running totals; textsql keeps the differences): the
    # collectives' time cannot exceed the run's.
    assert 0 < sum(o["total_latency_ms"] for o in operations.values()) / 1000 < summaries["zero2"]["train_runtime"] + 60
    none = runs_root / summaries["none"]["run"]
    assert not (none / "ds_monitor").exists() and not (none / "comms_summary.txt").exists()
    assert summaries["none"]["comms_summary"] is None


def test_loss_curves_come_from_the_tensorboard_events(runs_copy):
    from textsql.report import find_runs, load_scalars, run_event_dirs

    runs_root, summaries = runs_copy
    records = {r.summary.strategy_label: r for r in find_runs(runs_root)}
    for label, summary in summaries.items():
        dirs = run_event_dirs(records[label])
        assert dirs and all(d.is_relative_to(runs_root / summary["run"] / "tensorboard") for d in dirs)
        scalars = load_scalars(dirs)
        train = scalars["train/loss"]
        assert [step for step, _ in train][-1] == 12 and len(train) == 7  # logging_first_step, then every 2 steps
        assert train[0][1] == pytest.approx(summary["first_logged_loss"], abs=1e-3)
        assert train[-1][1] == pytest.approx(summary["last_logged_loss"], abs=1e-3)
        assert scalars["eval/loss"][-1][1] == pytest.approx(summary["eval_loss"], abs=1e-4)


@pytest.mark.slow
def test_benchmark_report_notebook_executes(runs_copy, tmp_path):
    import nbformat
    import papermill

    runs_root, summaries = runs_copy
    executed = tmp_path / "executed.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(executed),
        parameters={"runs_root": str(runs_root), "output_dir": str(tmp_path / "nb-report")},
        cwd=str(tmp_path),
        kernel_name="python3",
        progress_bar=False,
    )
    outputs = [o for c in nbformat.read(executed, as_version=4).cells for o in c.get("outputs", [])]
    text = json.dumps(outputs)
    assert all(s["run"] in text for s in summaries.values())
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2
    assert (tmp_path / "nb-report" / "report.csv").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# Row rules on made-up summaries (no training)
# ---------------------------------------------------------------------------------------------------------------------


def fake_summary(run, model, label, hosts, *, gpu_reserved=None, rss=2 * GIB, **extra):
    ranks = [{"rank": i, "host": host, "cpu_peak_rss_bytes": rss + i, "device": "cpu"} for i, host in enumerate(hosts)]
    if gpu_reserved:
        for rank, reserved in zip(ranks, gpu_reserved):
            rank.update(
                device="NVIDIA A100-PCIE-40GB", cuda_max_allocated_bytes=reserved // 2, cuda_max_reserved_bytes=reserved
            )
    summary = {
        "run": run,
        "model_id": model,
        "world_size": len(hosts),
        "strategy": {"label": label},
        "precision": "bf16",
        "train_runtime": 742.0,
        "train_samples_per_second": 227.7,
        "real_tokens_per_second": 9000.0,
        "epochs": 3.0,
        "eval_loss": 0.05,
        "peak_memory_per_rank": ranks,
        "tensorboard_dir": f"/home/cdsw/runs/{run}/tensorboard",
    }
    summary.update(extra)
    return summary


def write_run(root: Path, summary: dict, eval_metrics: dict | None = None) -> Path:
    folder = root / summary["run"]
    folder.mkdir(parents=True)
    (folder / "run_summary.json").write_text(json.dumps(summary))
    if eval_metrics is not None:
        (folder / "eval_metrics.json").write_text(json.dumps(eval_metrics))
    return folder


def test_nodes_gpu_memory_accuracy_and_order_from_made_up_runs(tmp_path):
    import pandas as pd

    from textsql.report import build_report

    root = tmp_path / "runs"
    write_run(
        root,
        fake_summary(
            "t5-large-zero1-ws3-bs32",
            "/models/t5-large/",
            "zero1",
            ["pod-a", "pod-b", "pod-c"],
            gpu_reserved=[13 * GIB, 12 * GIB, 14 * GIB],
            execution_accuracy=0.5,
            arguments={"data": {"execution_accuracy_samples": 200}},
            memory_check={"comparable": True, "predicted_reserved_bytes": 12.5 * GIB, "ratio": 1.12},
            flops_profile={"step": 10, "profiled": True, "tflops_per_gpu": 2.35, "mfu": 2.35 / 312},
        ),
    )
    write_run(
        root,
        fake_summary(
            "t5-small-zero3_offload-ws4-bs32",
            "t5-small",
            "zero3_offload",
            ["pod-a", "pod-a", "pod-b", "pod-b"],
            gpu_reserved=[3 * GIB, 3 * GIB, 3 * GIB, 5 * GIB],
            execution_accuracy=0.1,
        ),
        EVAL_METRICS,
    )
    write_run(
        root,
        fake_summary(
            "t5-small-none-ws1-bs32", "t5-small", "none", ["pod-a"], gpu_reserved=[3 * GIB], eval_loss=float("nan")
        ),
    )
    (root / "broken").mkdir()
    (root / "broken" / "run_summary.json").write_text("{not json")
    report = build_report(root, plots=False)

    table = report.table
    assert list(table["run"]) == [
        "t5-large-zero1-ws3-bs32",
        "t5-small-none-ws1-bs32",
        "t5-small-zero3_offload-ws4-bs32",
    ]
    large, small, offload = (row for _, row in table.iterrows())
    assert large["model"] == "t5-large" and large["nodes"] == 3 and large["memory_per_pod_gib"] == pytest.approx(14.0)
    assert large["memory_measure"].startswith("GPU reserved")
    assert large["planned_memory_gib"] == pytest.approx(12.5) and large["memory_vs_plan"] == pytest.approx(1.12)
    assert (
        large["execution_accuracy"] == 0.5 and large["accuracy_split"] == "validation (200 questions, end of training)"
    )
    assert offload["nodes"] == 2 and offload["world_size"] == 4 and offload["memory_per_pod_gib"] == pytest.approx(5.0)
    assert offload["execution_accuracy"] == 0.375  # eval_metrics.json wins over the summary's in-training value
    assert small["nodes"] == 1 and pd.isna(small["eval_loss"]) and pd.isna(small["execution_accuracy"])
    assert large["tflops_per_gpu"] == 2.35 and large["mfu"] == pytest.approx(2.35 / 312)  # --flops_profiler's step
    assert "| 9,000 | 2.3500 | 0.8% | 14.00 |" in report.markdown
    assert len(report.skipped) == 1 and "broken" in report.skipped[0]
    assert (
        "| t5-small | none | 1 | 1 | 3.00 | 742.0 | 227.7 | 9,000 | – | – | 3.00 | GPU reserved (max over ranks) |"
        + " – |" * 13
        + " bf16 |"
        in report.markdown
    )
    assert report.files["csv"] == root / "report" / "report.csv" and not report.plots


def test_no_runs_is_an_error_with_exit_status_2(tmp_path, capsys):
    from textsql.cli.report import report_cli

    (tmp_path / "runs").mkdir()
    assert report_cli(["--runs_root", str(tmp_path / "runs")]) == 2
    assert "No finished runs" in capsys.readouterr().err
    assert report_cli(["--runs_root", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# The throughput benchmark's two recipes are what they claim (no timing here: bench/ only prints figures)
# ---------------------------------------------------------------------------------------------------------------------


def test_throughput_bench_recipes_differ_only_as_documented(assets, tmp_path):
    import importlib.util

    from textsql.hub import load_tokenizer

    spec = importlib.util.spec_from_file_location(
        "train_throughput", Path(__file__).resolve().parents[2] / "bench" / "train_throughput.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data_dir, model_dir = assets
    tokenizer = load_tokenizer(str(model_dir))
    subset = bench.training_subset(data_dir, 64, seed=0)
    batches = {}
    for recipe in bench.RECIPES:
        model = bench.build_model("cpu-small", tokenizer, seed=0)
        trainer, collator = bench.make_trainer(recipe, model, tokenizer, subset, 2, 32, str(tmp_path / recipe))
        batches[recipe] = next(iter(trainer.get_train_dataloader()))
        assert (
            trainer.args.bf16 is False and trainer.args.optim.value == "adamw_torch"
        )  # no GPU: same precision and optimizer
    walkthrough, textsql = batches["walkthrough"], batches["textsql"]
    assert "attention_mask" not in walkthrough and walkthrough["input_ids"].shape == walkthrough["labels"].shape == (
        32,
        96,
    )
    assert (walkthrough["labels"] == tokenizer.pad_token_id).any() and not (
        walkthrough["labels"] == -100
    ).any()  # padding in the loss
    assert (
        textsql["input_ids"].shape[1] < 96
        and (textsql["labels"] == -100).any()
        and (textsql["attention_mask"] == 0).any()
    )
    real = sum(len(ids) for ids in subset["input_ids"])
    assert sum(int(b["attention_mask"].sum()) for b in trainer.get_train_dataloader()) == real
    from textsql.train.speed import example_counts, training_flops

    flops = training_flops(bench.build_model("t5-small", tokenizer, 0).config, example_counts(96, 96))
    assert (
        0.4 < flops / (6 * 60.5e6 * 192) < 0.8
    )  # ~half of 6·N·tokens: each T5 weight sees either the source or the target
