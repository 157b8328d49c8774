"""`textsql infer` end to end on a trained tiny model, and execution accuracy scored during training."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_infer_writes_predictions_and_metrics_that_agree(trained_run, cpu_env, tmp_path):
    run_dir, data_dir = trained_run
    out = tmp_path / "scored"
    done = subprocess.run(
        [sys.executable, "-m", "textsql.cli", "infer", "--model_dir", str(run_dir), "--dataset_dir", str(data_dir), "--split", "test",
         "--max_examples", "80", "--batch_size", "32", "--output_dir", str(out), "--show_examples", "2"],
        capture_output=True, text=True, env=cpu_env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("Test Instruction:") == 2 and "Model Prediction:" in done.stdout and "Expected Answer:" in done.stdout
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert len(records) == metrics["examples"] == 80
    assert {"question", "table_id", "gold_sql", "predicted_sql", "parsed", "parse_error", "exact_match", "logical_form_match", "execution_match"} <= set(records[0])
    mean = lambda key: sum(bool(r[key]) for r in records) / len(records)  # noqa: E731
    assert metrics["exact_match"] == pytest.approx(mean("exact_match"))
    assert metrics["logical_form_accuracy"] == pytest.approx(mean("logical_form_match"))
    assert metrics["execution_accuracy"] == pytest.approx(mean("execution_match"))
    assert metrics["parse_errors"] == sum(r["parse_error"] is not None for r in records)
    assert sum(group["count"] for group in metrics["by_aggregation"].values()) == 80
    assert sum(group["count"] for group in metrics["by_num_conditions"].values()) == 80
    assert metrics["queries_per_second"] > 0 and metrics["decoding"] == "greedy" and metrics["split"] == "test"
    from textsql.data import load_prepared

    dataset, _ = load_prepared(data_dir)
    assert [r["gold_sql"] for r in records] == dataset["test"]["target"][:80]


@pytest.mark.slow
def test_typed_questions_with_beam_search(trained_run, cpu_env):
    run_dir, data_dir = trained_run
    from textsql.data import load_prepared, load_tables

    dataset, _ = load_prepared(data_dir)
    row = dataset["test"][0]
    assert row["table_id"] in load_tables(data_dir)
    done = subprocess.run(
        [sys.executable, "-m", "textsql.cli", "infer", "--model_dir", str(run_dir), "--dataset_dir", str(data_dir),
         "--question", row["question"], "How many rows are there?", "--table_id", row["table_id"], "--num_beams", "3"],
        capture_output=True, text=True, env=cpu_env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("Model Prediction: ") == 2 and f"Test Instruction: {row['question']}" in done.stdout
    assert done.stdout.count("Result: ") == 2


def test_training_scored_execution_accuracy_at_each_evaluation(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = trained_run
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert 0.0 <= summary["execution_accuracy"] <= 1.0
    assert [h["step"] for h in summary["execution_accuracy_history"]] == [30, 60, 60]  # two evaluations, then the final one
    (event_dir,) = {p.parent for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(event_dir))
    accumulator.Reload()
    assert "eval/execution_accuracy" in accumulator.Tags()["scalars"]


def test_bad_inference_input_is_one_paragraph(trained_run, cpu_env, tmp_path):
    run_dir, data_dir = trained_run
    for argv, message in [
        (["--model_dir", str(run_dir), "--dataset_dir", str(data_dir), "--split", "nope"], "has no 'nope' split"),
        (["--model_dir", str(tmp_path / "missing-model"), "--dataset_dir", str(data_dir)], "not a usable model folder"),
        (["--model_dir", str(run_dir), "--dataset_dir", str(data_dir), "--batch_size", "0"], "must be at least 1"),
    ]:
        done = subprocess.run([sys.executable, "-m", "textsql.cli", "infer", *argv], capture_output=True, text=True, env=cpu_env, timeout=300)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
