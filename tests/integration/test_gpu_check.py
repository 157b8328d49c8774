"""The GPU check (bench/gpu) with --cpu: every step runs on the tiny shapes here, so the one call a GPU window gets
cannot rot between windows."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, child_cpu_env


@pytest.mark.slow
def test_gpu_check_runs_every_step_on_the_cpu(tmp_path):
    output = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "check.py"), "--cpu", "--output", str(output)]
        + ["--workdir", str(tmp_path / "work"), "--budget_scale", "3"],
        capture_output=True,
        text=True,
        env=child_cpu_env(),
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["mode"] == "cpu"
    steps = report["steps"]
    expected = {
        "environment",
        "data",
        "speed",
        "strategies",
        "throughput",
        "flops_profiler",
        "inference",
        "two_ranks",
        "causal",
        "causal_quantize",
        "causal_activations",
        "op_builds",
    }
    assert set(steps) == expected
    failed = {name: step.get("error_tail") for name, step in steps.items() if step["status"] != "ok"}
    assert not failed, failed
    # Each section holds what the GPU window is for, on the CPU's terms.
    assert steps["environment"]["result"]["versions"]["deepspeed"][0].isdigit()
    # The speed step: where a step goes (textsql's Trainer against the plain Trainer and a loop), and each lever on and
    # off; the GPU-only ones refused with textsql's reason
    speed = steps["speed"]["result"]
    profile = speed["profile"]["results"]
    assert set(profile) == {"loop", "hf_trainer", "textsql_before", "textsql"}
    assert (
        profile["textsql"]["sync_calls_outside_data_per_step"]
        < profile["textsql_before"]["sync_calls_outside_data_per_step"]
    )
    (lora,) = speed["causal"]
    levers = lora["results"]
    assert levers["fused_loss=chunked"]["first_loss"] == pytest.approx(levers["baseline"]["first_loss"], rel=1e-3)
    assert levers["lora_base_dtype=bfloat16"]["status"] == "ok"
    assert "no FlexAttention backward on the CPU" in levers["attention=flex_attention"]["reason"]
    assert "GPUs only" in levers["fused_loss=liger"]["reason"]
    runs = steps["strategies"]["result"]["full"]["runs"] + steps["strategies"]["result"]["lora"]["runs"]
    assert {(r["strategy"], r["lora"]) for r in runs} == {("zero2", False), ("none", True)}
    assert all(not r.get("failed") and r["steps"] == 2 and r["measured"]["cpu_peak_rss_bytes"] > 0 for r in runs)
    throughput = steps["throughput"]["result"]["results"][0]
    assert throughput["textsql"]["samples_per_second"] > 0 and throughput["walkthrough"]["samples_per_second"] > 0
    (profiled,) = steps["flops_profiler"]["result"]["runs"]
    assert profiled["strategy"] == "zero1" and profiled["flops_profile"]["flops_per_step"] > 0
    inference = steps["inference"]["result"]
    assert inference["batching"]["questions"] == 8
    assert inference["quantization"]["dynamic-int8"]["questions_per_second"] > 0
    assert steps["two_ranks"]["result"]["gloo"] == {"ok": True, "sum": 3.0}
    causal = steps["causal"]["result"]
    packed, qlora = causal["runs"]
    assert (packed["packing"], qlora["quantize_base"]) == (True, "nf4")
    for lora_run in (packed, qlora):
        assert lora_run["lora"] and lora_run["trainable_parameters"] < lora_run["parameters"], lora_run
        assert lora_run["train_samples_per_second"] > 0 and lora_run["peak_memory_per_rank"]
    assert causal["inference"]["examples"] == 8 and "execution_accuracy" in causal["inference"]
    # No full fine-tuning on the CPU: the methods quantize the base model the causal step trained from.
    assert steps["causal_quantize"]["result"]["results"]["dynamic-int8"]["questions_per_second"] > 0
    # The saved-tensor census of a causal step beside the planner's terms, full fine-tuning and LoRA.
    activations = steps["causal_activations"]["result"]["rows"]
    assert [(r["shape"], r["lora_rank"]) for r in activations] == [
        ("openai-community/gpt2", 0),
        ("openai-community/gpt2", 8),
    ]
    assert all(r["measured"]["saved_bytes"]["activations"] > 0 and r["saved_ratio"] > 0 for r in activations)
    # The last lines printed say what happened to each step (the device tool returns the end of the output).
    assert "gpu_check (cpu)" in done.stdout and "two_ranks" in done.stdout.splitlines()[-2]
