"""textsql tune's decisions, fed: candidates from the planner at a fixed global batch, the timed throughput from the
trainer's per-step log, failures named, the simpler setting within the tolerance, and results kept per settings."""

import json

import pytest

from textsql.arguments.training import arguments_dict, parse_arguments
from textsql.arguments.tune import TuneArguments
from textsql.errors import TextsqlError
from textsql.strategy.devices import NodeDevices
from textsql.tune.choose import choose_winner, repeat_rounds, summarize
from textsql.tune.measure import failure_reason, failure_status, recipe_arguments, refused_here, timed_throughput
from textsql.tune.report import TuneResult, format_table, recipe_values
from textsql.tune.space import (
    Candidate,
    candidate_arguments,
    lever_candidates,
    micro_batch_choices,
    plan_candidates,
    strategy_choices,
    strategy_values,
)
from textsql.tune.store import read_results


def test_micro_batches_keep_the_global_batch():
    assert micro_batch_choices(32) == [1, 2, 4, 8, 16, 32]
    assert micro_batch_choices(24) == [1, 2, 4, 8]
    assert micro_batch_choices(32, "16,8") == [8, 16]
    with pytest.raises(TextsqlError, match="do not divide the global batch per rank"):
        micro_batch_choices(32, "12")


def test_strategies_that_apply_here():
    on_cpu = strategy_choices("", "cpu", 1)
    assert "none" in on_cpu and "zero2" in on_cpu and not any(s.startswith("fsdp") for s in on_cpu)
    one_pod = strategy_choices("", "cuda", 1)
    assert "fsdp_full_shard" in one_pod and "fsdp_hybrid_shard" not in one_pod  # the same as full shard on one pod
    assert "fsdp_hybrid_shard" in strategy_choices("", "cuda", 2)
    with pytest.raises(TextsqlError, match="Unknown strategies"):
        strategy_choices("zero4", "cuda", 1)
    assert strategy_values("fsdp_shard_grad_op") == {"deepspeed": None, "fsdp_config": "fsdp_shard_grad_op"}
    assert strategy_values("zero3") == {"deepspeed": "zero3", "fsdp_config": None}


def test_fsdp_candidates_are_refused_on_the_cpu_with_the_reason():
    kept, refused = refused_here(
        [Candidate("none", 8, 1), Candidate("fsdp_full_shard", 8, 1)], "cpu", NodeDevices((), 2)
    )
    assert [c.key for c in kept] == ["none-mb8-acc1"]
    assert refused[0]["status"] == "refused" and "fsdp_full_shard needs GPUs" in refused[0]["error"]


def test_candidates_from_the_planner_on_a_gpu(tmp_path):
    (tmp_path / "textsql_data.json").write_text(
        json.dumps({"lengths": {"train": {"source_percentiles": {"p100": 64}, "target_percentiles": {"p100": 48}}}})
    )
    args = TuneArguments(model_id="t5-large", dataset_dir=str(tmp_path), global_batch_size=256)
    candidates, left_out = plan_candidates(
        args, ["none", "zero3", "fsdp_full_shard"], [32, 64, 128], 2, "cuda", "bf16", 40.0
    )
    keys = {c.key for c in candidates}
    assert "none-mb32-acc4" in keys and all(c.predicted_gpu_gb for c in candidates)
    default = next(c for c in candidates if c.default)
    assert default.key == "none-mb32-acc4"  # textsql train's own micro-batch, accumulated to the global batch
    assert "none-mb128-acc1" in {r["key"] for r in left_out}  # t5-large without sharding, at 128 per GPU
    assert all(r["status"] == "predicted not to fit" and r["predicted_gpu_gb"] > 36 for r in left_out)
    assert all(c.predicted_gpu_gb <= 36 for c in candidates)  # 40 GB less the 10% margin


def test_lora_candidates_beside_every_setting_with_the_planners_lora_prediction(tmp_path):
    (tmp_path / "textsql_data.json").write_text(
        json.dumps({"lengths": {"train": {"source_percentiles": {"p100": 64}, "target_percentiles": {"p100": 48}}}})
    )
    args = TuneArguments(model_id="t5-large", dataset_dir=str(tmp_path), global_batch_size=64, lora=True)
    candidates, _ = plan_candidates(
        args, ["none", "zero2", "fsdp_full_shard"], [32], 1, "cuda", "bf16", 80.0, {"lora_rank": 16}
    )
    by_key = {c.key: c for c in candidates}
    assert set(by_key) == {f"{s}-mb32-acc2{a}" for s in ("none", "zero2", "fsdp_full_shard") for a in ("", "-lora")}
    full, lora = by_key["none-mb32-acc2"], by_key["none-mb32-acc2-lora"]
    assert lora.adapter == "lora" and lora.predicted_gpu_gb < full.predicted_gpu_gb  # no gradients or Adam states
    assert by_key["fsdp_full_shard-mb32-acc2-lora"].predicted_gpu_gb is None  # the planner has no FSDP LoRA model
    values = candidate_arguments(arguments_dict(*parse_arguments([])), lora, args, tmp_path / "run")[2]
    assert values.lora and values.per_device_train_batch_size == 32 and values.gradient_accumulation_steps == 2
    assert not candidate_arguments(arguments_dict(*parse_arguments([])), full, args, tmp_path / "run")[2].lora
    recipe = recipe_values(
        {"strategy": "zero2", "micro_batch": 32, "accumulation": 2, "adapter": "lora"},
        *parse_arguments(["--lora_rank", "16"]),
        args,
    )
    assert recipe["lora"] is True and recipe["lora_rank"] == 16 and recipe["deepspeed"] == "zero2"


def test_tune_arguments_refuse_a_timed_first_step_and_give_a_limit():
    with pytest.raises(TextsqlError, match="start-up"):
        TuneArguments(warmup_steps=0)
    with pytest.raises(TextsqlError, match="candidate_timeout_s"):
        TuneArguments(candidate_timeout_s=-1)
    with pytest.raises(TextsqlError, match="--tolerance is a fraction"):
        TuneArguments(tolerance=5)
    assert TuneArguments(warmup_steps=3, timed_steps=20).timeout_s == 900 + 30 * 23
    assert TuneArguments(candidate_timeout_s=5).timeout_s == 5


def test_timed_throughput_leaves_the_warmup_out():
    history = [
        {"step": 1, "loss": 9, "samples_per_second": 1.0},
        {"step": 2, "loss": 8, "samples_per_second": 2.0},
        {"step": 3, "loss": 7, "samples_per_second": 10.0},
        {"step": 4, "loss": 6, "samples_per_second": 40.0},
        {"step": 4, "train_runtime": 9.0},
    ]
    rate, seconds = timed_throughput(history, warmup_steps=2, samples_per_step=20)
    assert seconds == pytest.approx((2.0 + 0.5) / 2)  # 20/10 s and 20/40 s
    assert rate == pytest.approx(40 / 2.5)
    assert timed_throughput(history, warmup_steps=4, samples_per_step=20) is None


def test_failures_are_named():
    text = "W1124 noise\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n[ERROR] [launch.py] exits"
    assert failure_status(text) == "out of memory" and failure_reason(text).startswith("torch.OutOfMemoryError")
    text = "noise\ntextsql train: The DeepSpeed config contradicts the training arguments: ...\n[ERROR] [launch.py]"
    assert failure_status(text) == "failed"
    assert failure_reason(text).startswith("The DeepSpeed config contradicts")
    # A cluster launch's error quotes the failing rank's lines ("  | ..."; "  rank N | ..." when a node was lost).
    for quote in ("  | ", "  rank 1 | "):
        launch = f"Rank 1 failed first.\n{quote}textsql train: Out of disk.\nLaunch again with the same arguments."
        assert failure_reason(launch) == "Out of disk."


def row(key, strategy, accumulation, rate, status="ok", repeat=0, levers=()):
    return {
        "levers": list(levers),
        "key": key,
        "repeat": repeat,
        "status": status,
        "strategy": strategy,
        "micro_batch": 32 // accumulation,
        "accumulation": accumulation,
        "adapter": "",
        "default": key == "none-mb32-acc1",
        "predicted_gpu_gb": None,
        "predicted_fits": None,
        "samples_per_second": rate,
        "peak_memory_bytes": 1,
        "memory_kind": "CPU RSS",
        "error": None if status == "ok" else "why",
    }


def test_a_simpler_setting_within_the_tolerance_wins():
    rows = [
        row("zero2-mb32-acc1", "zero2", 1, 100.0),
        row("zero2-mb32-acc1", "zero2", 1, 104.0, repeat=1),
        row("none-mb16-acc2", "none", 2, 99.0),
        row("none-mb32-acc1", "none", 1, 90.0),
        row("zero3-mb32-acc1", "zero3", 1, None, status="out of memory"),
    ]
    table = summarize(rows)
    assert [e["key"] for e in table] == ["zero2-mb32-acc1", "none-mb16-acc2", "none-mb32-acc1", "zero3-mb32-acc1"]
    assert table[0]["samples_per_second"] == 102.0 and table[0]["measurements"] == 2
    assert (table[0]["samples_per_second_min"], table[0]["samples_per_second_max"]) == (100.0, 104.0)
    assert table[-1]["status"] == "out of memory"
    assert choose_winner(table, 0.05)["key"] == "none-mb16-acc2"  # 99 is within 5% of 102, and plain DDP is simpler
    assert choose_winner(table, 0.0)["key"] == "zero2-mb32-acc1"
    assert choose_winner([table[-1]], 0.05) is None


def test_results_of_other_settings_are_refused(tmp_path):
    path = tmp_path / "tune_results.jsonl"
    path.write_text(json.dumps({"key": "none-mb8-acc1", "repeat": 0, "fingerprint": "a"}) + "\n")
    assert len(read_results(path, "a")) == 1
    with pytest.raises(TextsqlError, match="measurements of other settings"):
        read_results(path, "b")
    assert read_results(tmp_path / "none.jsonl", "a") == []


def test_repeats_alternate_their_order_and_include_the_default():
    candidates = [Candidate("none", 32, 1, default=True), Candidate("zero1", 32, 1), Candidate("zero2", 32, 1)]
    rows = [
        row("none-mb32-acc1", "none", 1, 50.0),
        row("zero1-mb32-acc1", "zero1", 1, 90.0),
        row("zero2-mb32-acc1", "zero2", 1, 100.0),
    ]
    rounds = repeat_rounds(rows, candidates, TuneArguments(repeat_top=2, repeats=4))
    assert [[c.key for c in r] for r in rounds] == [
        ["zero2-mb32-acc1", "zero1-mb32-acc1", "none-mb32-acc1"],  # reversed
        ["none-mb32-acc1", "zero1-mb32-acc1", "zero2-mb32-acc1"],
        ["zero2-mb32-acc1", "zero1-mb32-acc1", "none-mb32-acc1"],
    ]
    assert [c.key for c in repeat_rounds(rows, candidates, TuneArguments(repeat_top=1, repeats=2))[0]] == [
        "zero2-mb32-acc1",
        "none-mb32-acc1",
    ]
    assert repeat_rounds(rows, candidates, TuneArguments(repeat_top=0)) == []


def test_the_table_states_each_figures_spread_and_a_busy_machine(tmp_path):
    rows = [
        row("zero2-mb32-acc1", "zero2", 1, 100.0) | {"load_average": 1.0, "cpu_cores": 2},
        row("zero2-mb32-acc1", "zero2", 1, 80.0, repeat=1) | {"load_average": 5.5, "cpu_cores": 2},
        row("zero2-mb32-acc1", "zero2", 1, 90.0, repeat=2) | {"load_average": 1.0, "cpu_cores": 2},
        row("none-mb32-acc1", "none", 1, 50.0) | {"load_average": 1.0, "cpu_cores": 2},
    ]
    table = summarize(rows)
    result = TuneResult(table, choose_winner(table, 0.05), table[1], [], tmp_path, None, None, 4, 32)
    text = format_table(result)
    line = next(line for line in text.splitlines() if line.startswith("| zero2-mb32-acc1"))
    assert "| 90.0 | 80.0-100.0 (±11%) | 1.80x | 3 |" in line  # the median, its min-max, against the default
    assert "load average up to 5.5" in text and "busier than its 2 cores while 1 candidate(s)" in text
    assert "busier" not in format_table(TuneResult(table[1:], None, None, [], tmp_path, None, None, 1, 32))


def test_levers_are_tried_alone_on_the_fastest_setting_then_together_and_the_recipe_keeps_them(tmp_path):
    fastest, slower = Candidate("zero2", 16, 2, adapter="lora"), Candidate("none", 32, 1, default=True)
    by_key = {c.key: c for c in (fastest, slower)}
    first = summarize([row(fastest.key, "zero2", 2, 100.0), row(slower.key, "none", 1, 80.0)])
    levers = ["fused_loss", "compile", "bf16_lora_base", "packing", "flex_packing"]
    alone = lever_candidates(first, by_key, levers, causal=True, stage="alone")
    assert [c.key for c in alone] == [f"zero2-mb16-acc2-lora-{name}" for name in levers]
    assert all(c.strategy == "zero2" and c.adapter == "lora" and not c.default for c in alone)
    # T5 leaves out the causal LMs' levers; full fine-tuning leaves out LoRA's base
    t5 = lever_candidates(
        first, {**by_key, fastest.key: Candidate("zero2", 16, 2)}, levers, causal=False, stage="alone"
    )
    assert [c.levers for c in t5] == [("compile",)]
    measured = first + summarize(
        [row(c.key, "zero2", 2, rate, levers=c.levers) for c, rate in zip(alone, (130.0, 90.0, 110.0, 105.0, 120.0))]
    )
    (together,) = lever_candidates(measured, by_key, levers, causal=True, stage="together")
    assert together.levers == ("fused_loss", "flex_packing", "bf16_lora_base")  # the faster ones, fastest first;
    # flex_packing rather than plain packing, which set the same flag
    args = TuneArguments(levers="fused_loss,compile")
    values = candidate_arguments(arguments_dict(*parse_arguments([])), together, args, tmp_path / "run")[2]
    assert (values.fused_loss, values.lora_base_dtype, values.packing, values.attention) == (
        "chunked",
        "bfloat16",
        True,
        "flex_attention",
    )
    winner = {"strategy": "zero2", "micro_batch": 16, "accumulation": 2, "adapter": "lora", "levers": ["compile"]}
    assert recipe_values(winner, *parse_arguments([]), args)["compile"] == "layers"
    # fewer levers is simpler: within the tolerance, the setting without them wins
    table = summarize([row("a", "zero2", 2, 100.0), row("b", "zero2", 2, 102.0, levers=("compile",))])
    assert choose_winner(table, 0.05)["key"] == "a"
    with pytest.raises(TextsqlError, match="Unknown levers"):
        TuneArguments(levers="warp_drive")
    assert TuneArguments(levers="all").lever_names[0] == "fused_loss"


def test_the_winner_is_restated_from_its_recipe_against_the_defaults_trained_the_same_way(tmp_path):
    """Issue 41: a tune said 1.71x where training its recipe gave 1.10x. The confirmation's rows (the recipe and the
    default settings trained as textsql train reads them) give the figure a user gets, in the timed steps and over the
    whole run, beside the candidates'."""
    table = summarize([row("zero2-mb32-acc1", "zero2", 1, 171.0), row("none-mb32-acc1", "none", 1, 100.0)])
    confirmation = [
        row("recipe:zero2-mb32-acc1", "zero2", 1, 110.0) | {"run_samples_per_second": 60.0},
        row("recipe:zero2-mb32-acc1", "zero2", 1, 112.0, repeat=1) | {"run_samples_per_second": 62.0},
        row("recipe:none-mb32-acc1", "none", 1, 100.0) | {"run_samples_per_second": 58.0, "default": True},
        row("recipe:none-mb32-acc1", "none", 1, 100.0, repeat=1) | {"run_samples_per_second": 58.0, "default": True},
    ]
    result = TuneResult(table, table[0], table[1], [], tmp_path, None, None, 4, 32, summarize(confirmation))
    assert result.speedup_over_default == pytest.approx(1.71)
    assert result.confirmed_speedup == pytest.approx({"timed_steps": 1.11, "whole_run": 61 / 58})
    text = format_table(result)
    assert (
        "(median of 2): 111.0 samples/s in the timed steps (171.0 as a candidate), 61.0 over the whole training loop"
        in text
    )
    assert "the recipe is 1.11x the default in the timed steps and 1.05x over the whole loop" in text
    # The recipe failed to train: said, with its reason; no speed-up is claimed from it.
    failed = summarize([row("recipe:zero2-mb32-acc1", "zero2", 1, None, status="failed") | {"error": "Out of disk."}])
    broken = TuneResult(table, table[0], table[1], [], tmp_path, None, None, 4, 32, failed)
    assert "its recipe, trained as textsql train reads it: failed: Out of disk." in format_table(broken)
    assert broken.confirmed_speedup is None


def test_a_confirmation_trains_the_recipe_file_as_textsql_train_reads_it(tmp_path):
    """The recipe's own settings (reporting, evaluation, the batch) with the steps, per-step logging and the folder
    tune gives it; the SQL scoring after the loop left out unless the recipe scores inside it."""
    recipe = tmp_path / "tune_recipe.yaml"
    recipe.write_text("model_id: m\ndataset_dir: d\nper_device_train_batch_size: 16\ngradient_accumulation_steps: 2\n")
    args = TuneArguments(warmup_steps=2, timed_steps=5)
    model, data, training = recipe_arguments(recipe, args, tmp_path / "run")
    assert (model.model_id, training.per_device_train_batch_size, training.gradient_accumulation_steps) == ("m", 16, 2)
    assert (training.max_steps, training.logging_steps, training.output_dir) == (7, 1, str(tmp_path / "run"))
    assert "tensorboard" in training.report_to and training.eval_strategy == "epoch"  # the recipe's (the defaults)
    assert data.execution_accuracy_samples == 0
    recipe.write_text(recipe.read_text() + "execution_accuracy_each_evaluation: true\nexecution_accuracy_samples: 50\n")
    assert recipe_arguments(recipe, args, tmp_path / "run")[1].execution_accuracy_samples == 50
    defaults = recipe_arguments({"model_id": "m", "dataset_dir": "d"}, args, tmp_path / "default", "0" * 32)
    assert "mlflow" in defaults[2].report_to and defaults[2].max_steps == 7  # nested under a tracked tune's run
