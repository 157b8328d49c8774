"""`textsql infer` end to end on a trained tiny model, and execution accuracy scored during training."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_train_argv


@pytest.mark.slow
def test_infer_writes_predictions_and_metrics_that_agree(trained_run, cpu_env, tmp_path):
    run_dir, data_dir = trained_run
    out = tmp_path / "scored"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "textsql.cli",
            "infer",
            "--model_dir",
            str(run_dir),
            "--dataset_dir",
            str(data_dir),
            "--split",
            "test",
            "--max_examples",
            "80",
            "--batch_size",
            "32",
            "--output_dir",
            str(out),
            "--show_examples",
            "2",
        ],
        capture_output=True,
        text=True,
        env=cpu_env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (
        done.stdout.count("Test Instruction:") == 2
        and "Model Prediction:" in done.stdout
        and "Expected Answer:" in done.stdout
    )
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert len(records) == metrics["examples"] == 80
    assert {
        "question",
        "table_id",
        "gold_sql",
        "predicted_sql",
        "parsed",
        "parse_error",
        "exact_match",
        "logical_form_match",
        "execution_match",
        "components",
        "wrong_parts",
        "candidate_rank",
        "decoding_changed",
    } <= set(records[0])
    mean = lambda key: sum(bool(r[key]) for r in records) / len(records)  # noqa: E731
    assert metrics["exact_match"] == pytest.approx(mean("exact_match"))
    assert metrics["logical_form_accuracy"] == pytest.approx(mean("logical_form_match"))
    assert metrics["execution_accuracy"] == pytest.approx(mean("execution_match"))
    assert metrics["parse_errors"] == sum(r["parse_error"] is not None for r in records)
    assert sum(group["count"] for group in metrics["by_aggregation"].values()) == 80
    assert sum(group["count"] for group in metrics["by_num_conditions"].values()) == 80
    assert metrics["queries_per_second"] > 0 and metrics["split"] == "test"
    # the default (auto): the family's best, constrained, so every answer parses; told against greedy's answers
    assert metrics["decoding"]["method"] == "constrained" and metrics["parse_errors"] == 0
    assert "against_greedy" in metrics["decoding"] and metrics["arguments"]["decoding"] == "constrained"
    for name, accuracy in metrics["components"].items():
        assert accuracy == pytest.approx(sum(r["components"][name] for r in records) / len(records))
    assert "parts right: select column" in done.stdout
    from textsql.prepared import load_prepared

    dataset, _ = load_prepared(data_dir)
    assert [r["gold_sql"] for r in records] == dataset["test"]["target"][:80]


@pytest.mark.slow
def test_typed_questions_with_beam_search(trained_run, cpu_env):
    run_dir, data_dir = trained_run
    from textsql.prepared import load_prepared, load_tables

    dataset, _ = load_prepared(data_dir)
    row = dataset["test"][0]
    assert row["table_id"] in load_tables(data_dir)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "textsql.cli",
            "infer",
            "--model_dir",
            str(run_dir),
            "--dataset_dir",
            str(data_dir),
            "--question",
            row["question"],
            "How many rows are there?",
            "--table_id",
            row["table_id"],
            "--num_beams",
            "3",
        ],
        capture_output=True,
        text=True,
        env=cpu_env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("Model Prediction: ") == 2 and f"Test Instruction: {row['question']}" in done.stdout
    assert done.stdout.count("Result: ") == 2


def test_training_scored_execution_accuracy_at_each_evaluation(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = trained_run
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert 0.0 <= summary["execution_accuracy"] <= 1.0
    assert [h["step"] for h in summary["execution_accuracy_history"]] == [
        30,
        60,
    ]  # the evaluation at the last step is the final one
    (event_dir,) = {p.parent for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(event_dir))
    accumulator.Reload()
    assert "eval/execution_accuracy" in accumulator.Tags()["scalars"]


def test_bad_inference_input_is_one_paragraph(trained_run, textsql_in_process, tmp_path):
    run_dir, data_dir = trained_run
    for argv, message in [
        (["--model_dir", str(run_dir), "--dataset_dir", str(data_dir), "--split", "nope"], "has no 'nope' split"),
        (["--model_dir", str(tmp_path / "missing-model"), "--dataset_dir", str(data_dir)], "There is no folder"),
        (["--model_dir", str(run_dir), "--dataset_dir", str(data_dir), "--batch_size", "0"], "must be at least 1"),
    ]:
        status, _, err = textsql_in_process(["infer", *argv])
        assert status == 2 and message in err and "Traceback" not in err, err[-2000:]


@pytest.mark.slow
def test_question_plus_header_model_trains_and_scores_greedy_and_execution_guided(
    header_assets, assets, tmp_path, monkeypatch, restored_environ
):
    """End to end in this process: prep's added '<' reaches the model (embeddings grown), evaluation during training and
    `infer` both read question+header sources, execution-guided decoding says what it changed, against the top beam and
    against greedy, constrained decoding writes only queries that parse (with the tokenizer prep extended), and the
    model refuses data in the other format."""
    from transformers import AutoTokenizer

    from textsql.arguments.infer import InferArguments
    from textsql.arguments.training import parse_arguments
    from textsql.errors import TextsqlError
    from textsql.evaluate import format_metrics
    from textsql.infer import run_inference
    from textsql.prepared import load_tables
    from textsql.train.run import train
    from textsql.wikisql.sql import executes_plausibly

    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    data_dir, _ = header_assets
    summary = train(
        *parse_arguments(
            tiny_train_argv(
                header_assets,
                str(tmp_path / "runs"),
                max_steps=40,
                per_device_train_batch_size=16,
                learning_rate="3e-3",
                warmup_steps=4,
                logging_steps=10,
                eval_strategy="steps",
                eval_steps=40,
                save_strategy="no",
                max_eval_samples=16,
                execution_accuracy_samples=16,
                execution_accuracy_decoding="execution_guided",
                execution_accuracy_num_beams=3,
                dataloader_num_workers=0,
            )
        )
    )
    run_dir = Path(summary.output_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["task_specific_params"]["textsql"]["source_format"] == "question+header"
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(run_dir))  # grown for the added '<'
    assert (
        AutoTokenizer.from_pretrained(run_dir).decode(
            AutoTokenizer.from_pretrained(run_dir)("a < b")["input_ids"], skip_special_tokens=True
        )
        == "a < b"
    )
    assert summary.execution_accuracy is not None

    scored = {}
    for decoding, beams, questions in (
        ("greedy", 1, 40),
        ("execution_guided", 4, 40),
        ("constrained+execution_guided", 3, 16),
    ):
        out = tmp_path / decoding
        metrics = run_inference(
            InferArguments(
                model_dir=str(run_dir),
                dataset_dir=str(data_dir),
                split="test",
                max_examples=questions,
                decoding=decoding,
                num_beams=beams,
                output_dir=str(out),
                show_examples=0,
            ),
            echo=lambda line: None,
        )
        records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
        assert metrics["source_format"] == "question+header" and metrics["examples"] == len(records) == questions
        assert metrics["decoding"]["changed"] == sum(r["decoding_changed"] for r in records)
        scored[decoding] = (metrics, records)
    _, guided = scored["execution_guided"]
    tables = load_tables(data_dir)
    for record in guided:  # a later beam is taken only when it executes plausibly
        assert record["candidate_rank"] == 0 or executes_plausibly(record["predicted_sql"], tables[record["table_id"]])
        assert record["candidate_rank"] > 0 or not record["decoding_changed"]
    assert scored["greedy"][0]["decoding"]["changed"] == 0 and "against_greedy" not in scored["greedy"][0]["decoding"]
    greedy_metrics, greedy_records = scored["greedy"]
    guided_metrics, guided_records = scored["execution_guided"]  # the greedy pass infer adds is greedy's own
    assert [r["greedy_sql"] for r in guided_records] == [r["predicted_sql"] for r in greedy_records]
    assert guided_metrics["decoding"]["greedy_execution_accuracy"] == greedy_metrics["execution_accuracy"]
    for decoding in ("execution_guided", "constrained+execution_guided"):
        metrics, records = scored[decoding]
        block = metrics["decoding"]
        fixed = sum(r["execution_match"] and not r["greedy_execution_match"] for r in records)
        broken = sum(r["greedy_execution_match"] and not r["execution_match"] for r in records)
        assert block["against_greedy"] == {"fixed": fixed, "broken": broken, "net": fixed - broken}
        assert block["top_candidate_against_greedy"]["net"] + block["choice_against_top_candidate"]["net"] == (
            fixed - broken
        )
        assert "fixed" in format_metrics(metrics) and "execution filter" in format_metrics(metrics)
    constrained_metrics, constrained_records = scored["constrained+execution_guided"]
    assert constrained_metrics["parse_errors"] == 0 and constrained_metrics["decoding"]["unconstrained_questions"] == 0
    assert not any((r["execution_error"] or "").startswith("predicted") for r in constrained_records)

    with pytest.raises(TextsqlError, match="question\\+header.*--source_format question"):
        run_inference(InferArguments(model_dir=str(run_dir), dataset_dir=str(assets[0]), split="test", max_examples=4))


@pytest.mark.slow
def test_question_format_model_scores_with_execution_guided_decoding(trained_run, tmp_path):
    """The other half of the end-to-end pair: the question-format model (trained_run), scored with execution guidance."""
    from textsql.arguments.infer import InferArguments
    from textsql.infer import run_inference
    from textsql.prepared import load_tables
    from textsql.wikisql.sql import executes_plausibly

    run_dir, data_dir = trained_run
    metrics = run_inference(
        InferArguments(
            model_dir=str(run_dir),
            dataset_dir=str(data_dir),
            split="test",
            max_examples=40,
            decoding="execution_guided",
            num_beams=3,
            output_dir=str(tmp_path),
            show_examples=0,
        ),
        echo=lambda line: None,
    )
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert metrics["source_format"] == "question" and metrics["decoding"]["label"] == "execution-guided (3 beams)"
    assert metrics["decoding"]["changed"] == sum(r["decoding_changed"] for r in records) and len(records) == 40
    tables = load_tables(data_dir)
    assert all(
        r["candidate_rank"] == 0 or executes_plausibly(r["predicted_sql"], tables[r["table_id"]]) for r in records
    )
