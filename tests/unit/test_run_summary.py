"""run_summary.json has one schema and one writer: a round trip keeps every field, a newer textsql's fields survive, a
half-written file never looks like a finished run, and a missing or broken one is a clear error."""

import json

import pytest

from textsql.errors import TextsqlError
from textsql.paths import SUMMARY_FILE
from textsql.run_summary import SCHEMA_VERSION, RunSummary, format_summary, read_summary, run_state, write_summary


def a_summary(tmp_path) -> RunSummary:
    return RunSummary(
        run="tiny-t5-zero2-ws2-bs16",
        output_dir=str(tmp_path),
        model_id="t5-small",
        parameters=60_500_000,
        world_size=2,
        strategy={"label": "zero2", "zero_stage": 2},
        precision="bf16",
        tf32=True,
        device="cuda",
        train_runtime=12.5,
        train_samples_per_second=100.0,
        real_tokens_per_second=3000.0,
        global_step=40,
        epochs=1.0,
        train_loss=1.5,
        eval_loss=1.25,
        first_logged_loss=9.0,
        last_logged_loss=1.2,
        peak_memory_per_rank=[
            {
                "rank": r,
                "host": f"pod{r}",
                "device": "NVIDIA A100",
                "cpu_peak_rss_bytes": 2**31,
                "cuda_max_allocated_bytes": 2**32,
                "cuda_max_reserved_bytes": 2**33,
            }
            for r in range(2)
        ],
    )


def test_a_summary_round_trips_and_keeps_fields_it_does_not_know(tmp_path):
    summary = a_summary(tmp_path)
    write_summary(summary, tmp_path)
    again = read_summary(tmp_path)
    assert again == summary and again.version == SCHEMA_VERSION and again.nodes == 2 and again.strategy_label == "zero2"
    values = json.loads((tmp_path / SUMMARY_FILE).read_text())
    values["from_the_future"] = {"x": 1}
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(values))
    newer = read_summary(tmp_path / SUMMARY_FILE)
    assert newer.extras == {"from_the_future": {"x": 1}} and newer.as_dict()["from_the_future"] == {"x": 1}
    values["version"] = SCHEMA_VERSION + 1
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(values))
    with pytest.warns(UserWarning, match="newer than this textsql"):
        read_summary(tmp_path)
    text = format_summary(summary)
    assert "bf16 + TF32 on cuda" in text and "rank 1" in text and "reserved 8.00 GiB" in text


def test_a_half_written_summary_never_looks_like_a_finished_run(tmp_path, monkeypatch):
    (tmp_path / "checkpoint-10").mkdir()
    assert run_state(tmp_path) == "interrupted"

    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("textsql.run_summary.os.fsync", fail)  # the write breaks before the file is complete
    with pytest.raises(OSError):
        write_summary(a_summary(tmp_path), tmp_path)
    assert not (tmp_path / SUMMARY_FILE).exists() and run_state(tmp_path) == "interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10"]  # no temporary file left behind
    monkeypatch.undo()
    write_summary(a_summary(tmp_path), tmp_path)
    assert run_state(tmp_path) == "finished" and run_state(tmp_path / "nothing") == "new"


def test_missing_or_broken_summaries_are_clear_errors(tmp_path):
    with pytest.raises(TextsqlError, match="does not exist: the run did not finish"):
        read_summary(tmp_path)
    (tmp_path / SUMMARY_FILE).write_text("{half")
    with pytest.raises(TextsqlError, match="cannot be read as a run summary"):
        read_summary(tmp_path)
    (tmp_path / SUMMARY_FILE).write_text("[]")
    with pytest.raises(TextsqlError, match="is not a run summary"):
        read_summary(tmp_path)


def test_a_version_1_summary_reads_as_full_fine_tuning_and_a_lora_run_says_what_trained(tmp_path):
    values = a_summary(tmp_path).as_dict()
    del values["trainable_parameters"]
    values["version"] = 1
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(values))
    old = read_summary(tmp_path)
    assert old.trainable_parameters == old.parameters == 60_500_000 and old.lora is None and old.extras == {}
    lora = a_summary(tmp_path)
    lora.strategy = {
        "label": "zero2",
        "zero_stage": 2,
        "lora": {"rank": 8, "alpha": 16.0, "dropout": 0.05, "targets": "qv"},
    }
    lora.trainable_parameters = 294_912
    write_summary(lora, tmp_path)
    again = read_summary(tmp_path)
    assert again == lora and again.lora["rank"] == 8 and again.version == SCHEMA_VERSION
    assert "zero2 + LoRA r=8 alpha=16 on qv, 0.295M trainable parameters" in format_summary(again)


def test_a_version_2_summary_reads_without_tools_and_a_profiled_run_prints_its_flops_line(tmp_path):
    from textsql.train.dstools import flops_figures

    values = a_summary(tmp_path).as_dict()
    for name in ("flops_profile", "comms_summary"):
        del values[name]
    values["version"] = 2
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(values))
    old = read_summary(tmp_path)
    assert old.flops_profile is None and old.comms_summary is None and old.extras == {}
    assert "flops profile" not in format_summary(old) and "comms logger" not in format_summary(old)

    # An A100 in bf16: 3 x 0.5 TFLOP forward x 2 micro-batches in 1 s is 3 TFLOPS per GPU, ~1% of its 312 dense peak.
    measured = {
        "forward_flops": 5 * 10**11,
        "forward_macs": 25 * 10**10,
        "forward_latency_s": 0.2,
        "parameters": 60_500_000,
    }
    run = {"accumulation": 2, "micro_batch": 16, "precision": "bf16", "tf32": True, "last_step": 40}
    profiled = a_summary(tmp_path)
    profiled.flops_profile = flops_figures(measured, 3, 1.0, deepspeed=True, gpu="NVIDIA A100-SXM4-40GB", **run)
    profiled.comms_summary = {
        "file": "comms_summary.txt",
        "operations": {"all_reduce": {"count": 8, "total_latency_ms": 12.5, "bytes": 4096}},
    }
    write_summary(profiled, tmp_path)
    again = read_summary(tmp_path)
    assert again == profiled and again.flops_profile["flops_per_step"] == 3 * 10**12
    assert again.flops_profile["tflops_per_gpu"] == pytest.approx(3.0)
    assert again.flops_profile["mfu"] == pytest.approx(3.0 / 312) and again.flops_profile["peak_tflops"] == 312.0
    lines = format_summary(again)
    assert "flops profile  step 3: 3,000.00 GFLOPs and 1,500.00 GMACs per GPU in 1,000.0 ms" in lines
    assert "3 TFLOPS per GPU, 60,500,000 parameters per GPU; MFU 1.0% of NVIDIA A100-SXM4-40GB bf16 dense" in lines
    assert "per module: flops_profile.txt" in lines
    assert "comms logger   all_reduce 8x 12.5 ms; table: comms_summary.txt" in lines

    # The CPU has no peak; an fp32 run on an A100 with TF32 is measured against the TF32 peak; a step never run says so.
    cpu = flops_figures(measured, 3, 1.0, deepspeed=False, gpu=None, **run)
    assert cpu["mfu"] is None and cpu["peak"] == "no peak known (CPU)" and cpu["tflops_per_gpu"] == pytest.approx(3.0)
    tf32 = flops_figures(measured, 3, 1.0, deepspeed=False, gpu="NVIDIA A100", **dict(run, precision="fp32"))
    assert tf32["peak_tflops"] == 156.0 and "TF32 dense" in tf32["peak"]
    unknown = flops_figures(measured, 3, 1.0, deepspeed=False, gpu="Some GPU", **run)
    assert unknown["mfu"] is None and unknown["peak"] == "no peak known (Some GPU)"
    missed = flops_figures(None, 50, None, deepspeed=False, gpu=None, **run)
    assert missed["profiled"] is False and "step 50 was not run (the run ended at step 40" in missed["reason"]
    profiled.flops_profile = missed
    assert "flops profile  step 50 not profiled: step 50 was not run" in format_summary(profiled)


def test_every_run_s_mfu_is_recorded_printed_and_reported(tmp_path):
    """run_summary's mfu (schema 5): the run's model FLOPs over its time against the GPU's peak; the report's TFLOPS
    and MFU columns take it where no step was profiled; an older summary reads with None."""
    from textsql.report import flops_columns
    from textsql.train.speed import mfu_figures

    summary = a_summary(tmp_path)
    summary.mfu = mfu_figures(989e12 * 10 * 0.25, 10.0, "NVIDIA H100 80GB HBM3", "bf16", False)
    assert summary.mfu["mfu"] == pytest.approx(0.25) and summary.mfu["peak_tflops"] == 989.0
    write_summary(summary, tmp_path)
    again = read_summary(tmp_path)
    assert again.mfu == summary.mfu and again.version == SCHEMA_VERSION >= 6
    assert "model flops    247.2 TFLOPS per GPU at the real lengths; MFU 25.0% of NVIDIA H100" in format_summary(again)
    assert flops_columns(again) == {"tflops_per_gpu": pytest.approx(247.25), "mfu": pytest.approx(0.25)}
    on_cpu = mfu_figures(1e9, 2.0, None, "fp32", False)
    assert on_cpu["mfu"] is None and on_cpu["peak"] == "no peak known (CPU)"
    # A CPU run: the rate without GPU words or a peak, and its memory check as the prediction in one line (the same
    # "not comparable" reason each run said nothing new).
    summary.device, summary.mfu = "cpu", on_cpu
    summary.memory_check = {
        "comparable": False,
        "measured_cpu_peak_rss_bytes": 2**30,
        "predicted_gpu_total_bytes": 3 * 2**30,
    }
    lines = format_summary(summary)
    assert "model flops    0.0005 TFLOPS per rank at the real lengths (CPU)" in lines and "per GPU" not in lines
    assert "memory check   on a GPU this setup would peak at 3.00 GB (the planner's prediction;" in lines
    assert "not comparable" not in lines
    values = again.as_dict()
    del values["mfu"]
    values["version"] = 4
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(values))
    assert read_summary(tmp_path).mfu is None
