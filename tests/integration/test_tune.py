"""`textsql tune` end to end on the tiny T5 on the CPU: real trainings in child processes, a refused and a failing
candidate reported, the best repeated, the results kept (a second run measures nothing), and the recipe trains."""

import json

import pytest
import yaml


@pytest.mark.slow
def test_tune_reports_failures_resumes_and_its_recipe_trains(assets, tmp_path, textsql_in_process):
    data_dir, model_dir = assets
    contradicting = tmp_path / "contradicting.json"  # passes as a file, fails in the training: micro-batch 3 is not 16
    contradicting.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 3,
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"},
            }
        )
    )
    tune_dir, runs = tmp_path / "tune", tmp_path / "runs"
    argv = [
        "tune",
        "--model_id",
        str(model_dir),
        "--dataset_dir",
        str(data_dir),
        "--tune_dir",
        str(tune_dir),
        "--global_batch_size",
        "16",
        "--micro_batches",
        "16",
        "--strategies",
        f"none,fsdp_full_shard,{contradicting}",
        "--warmup_steps",
        "2",
        "--timed_steps",
        "3",
        "--repeat_top",
        "1",
        "--",
        "--learning_rate",
        "1e-3",
        "--max_steps",
        "4",
        "--runs_root",
        str(runs),
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--dataloader_num_workers",
        "0",
    ]
    status, out, err = textsql_in_process(argv)
    assert status == 0, out + err
    assert "[1/2] none-mb16-acc1: training 2 + 3 steps" in out and "samples/s" in out
    assert "winner: none-mb16-acc1" in out
    lines = {line.split(" |")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert (
        "| ok |" in lines["none-mb16-acc1 **winner** (default)"]
        and "| 2 |" in lines["none-mb16-acc1 **winner** (default)"]
    )
    assert "failed: The DeepSpeed config contradicts the training arguments" in lines["contradicting-mb16-acc1"]
    assert "refused: fsdp_full_shard needs GPUs" in lines["fsdp_full_shard-mb16-acc1"]
    results = [json.loads(line) for line in (tune_dir / "tune_results.jsonl").read_text().splitlines()]
    assert [(r["key"], r["repeat"], r["status"]) for r in results] == [
        ("none-mb16-acc1", 0, "ok"),
        ("contradicting-mb16-acc1", 0, "failed"),
        ("none-mb16-acc1", 1, "ok"),
    ]
    assert (tune_dir / "tune_table.md").read_text().startswith("| candidate |") and (
        tune_dir / "tune_plot.png"
    ).stat().st_size
    assert (tune_dir / "logs" / "contradicting-mb16-acc1-r0.log").read_text()  # the failed training's output

    # Again: every candidate is in the results already, nothing is trained.
    status, out, err = textsql_in_process(argv)
    assert status == 0 and out.count("measured before, kept") == 3 and "training 2 + 3 steps" not in out
    assert len((tune_dir / "tune_results.jsonl").read_text().splitlines()) == 3

    recipe = tune_dir / "tune_recipe.yaml"
    values = yaml.safe_load(recipe.read_text())
    assert values["per_device_train_batch_size"] == 16 and values["gradient_accumulation_steps"] == 1
    assert values["model_id"] == str(model_dir) and values["max_steps"] == 4 and "deepspeed" not in values
    status, out, err = textsql_in_process(["train", str(recipe)])
    assert status == 0, err
    (run,) = runs.glob("tiny-t5-none-ws1-bs16*")  # the recipe's settings that differ from the defaults follow
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["global_step"] == 4
