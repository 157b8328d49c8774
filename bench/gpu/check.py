"""The GPU check: every GPU figure textsql lacks, measured in one prepared call of a few minutes (bench/gpu/README.md).

    bash bench/gpu/run.sh                          # on the GPU machine: installs bench/gpu/wheels, then this script
    python bench/gpu/check.py --cpu --output X     # here: every step on tiny shapes, in a few minutes (a test runs it)

Each step runs textsql's own benchmarks (bench/*.py) or `textsql train` in child processes, under its own time
budget: a step that fails or runs out of time is recorded with the end of its output, and the next one runs. The
JSON is rewritten after every step, so what was measured before a cut-off is kept. Steps:

  environment     the GPU, the libraries, and the memory the CUDA context and NCCL take beside torch's reservation
  data            generated WikiSQL-format data and a tokenizer trained on it (shared by every later step)
  speed           where a step's time goes (bench/step_profile.py: textsql's Trainer against the plain Trainer and a
                  PyTorch loop, torch's profiler on the GPU), and each speed lever on and off and the best combination
                  with MFU (bench/speed_levers.py): t5-small's shape at the walkthrough's batch and a large one,
                  t5-large's, Qwen2.5-0.5B's with LoRA and full fine-tuning
  strategies      every strategy one GPU can run (none, ZeRO-1/2/3, CPU offload, FSDP at world size 1) and LoRA, on
                  t5-small's real shape in bf16: the run summary's CUDA peak against `textsql plan`'s prediction
                  (bench/plan_vs_measured.py, several runs at once on the one GPU)
  throughput      textsql's training recipe against the walkthrough's, t5-small and t5-large shapes, with MFU
                  (bench/train_throughput.py)
  flops_profiler  DeepSpeed's flops profiler through `textsql train --flops_profiler`: TFLOPS per GPU for t5-small,
                  ZeRO-1, fp32, batch 32 (the walkthrough's 2.35 TFLOPS per A100)
  inference       batched generation against one question at a time, and every quantization method's questions/s and
                  size (bench/infer_batching.py, bench/quantize_methods.py)
  two_ranks       whether two ranks can share the one GPU (NCCL; gloo with CUDA tensors)
  causal          a decoder-only causal LM (Qwen2.5-0.5B's shape with the real Qwen2 tokenizer under --real; the tiny
                  Qwen2 on the CPU): prep; LoRA padded and packed, QLoRA on NF4 and int8 bases (plain and ZeRO-2),
                  LoRA under ZeRO-2 and full fine-tuning in bf16, each with its peak memory against the planner's
                  prediction; then batched left-padded generation, scored (`textsql prep`, `train`, `infer`)
  causal_quantize every quantization method on the causal LM's full fine-tuning: size, questions/s, agreement
  op_builds       DeepSpeed's JIT op builds (started first, in the background): a one-time cost, kept out of every
                  timing above

With --cpu every step runs on the tiny shapes (fp32) on this machine; the figures are then about the code path, not
about speed or GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

REPORT_VERSION = 1
TAIL_CHARS = 2500
TRAIN_TABLES = 200  # generated training tables (10 questions each), the same for every step so the data is built once


@dataclass
class Sizes:
    """What the steps measure: GPU shapes and lengths, or the tiny ones of --cpu."""

    shape: str
    precision: str
    batch: int
    strategies: str
    lora_strategies: str
    memory_steps: int
    concurrent: int
    throughput_shapes: str
    throughput_steps: int
    throughput_warmup: int
    flops_runs: tuple  # (strategy, precision) of each profiled run
    questions: int
    batching_questions: int  # one question at a time is slow: fewer for that comparison
    causal_batch: int
    causal_runs: tuple  # (strategy, lora, quantize_base, packing) of each causal LM training
    causal_quantize_methods: str
    causal_activation_shapes: str  # built-in causal configs whose saved tensors bench/causal_activations.py counts
    causal_activation_batches: str
    causal_activation_layers: int
    quantize_methods: str
    speed_profile: tuple  # (T5 shape, batch) bench/step_profile.py profiles
    speed_t5: tuple  # (shape, batch, levers: speed_levers.py's --levers) of each T5 run
    speed_causal: tuple  # (label, lora, batch, levers) of each causal LM run (Qwen2.5-0.5B's shape; the tiny Qwen2)
    speed_steps: int
    speed_repetitions: int
    budgets: dict


GPU = Sizes(
    shape="t5-small",
    precision="bf16",
    batch=32,
    strategies="none,zero1,zero2,zero3,fsdp_shard_grad_op,fsdp_full_shard,zero2_offload,zero3_offload",
    lora_strategies="none,zero2,zero3",
    memory_steps=5,
    concurrent=4,
    throughput_shapes="t5-small,t5-large",
    throughput_steps=30,
    throughput_warmup=3,
    flops_runs=(("zero1", "fp32"), ("none", "bf16")),  # the walkthrough's setting, then textsql's default precision
    questions=256,
    batching_questions=48,
    causal_batch=16,
    causal_runs=(
        ("none", True, "none", False),
        ("none", True, "none", True),
        ("none", True, "nf4", False),
        ("none", True, "int8", False),
        ("zero2", True, "nf4", False),
        ("zero2", True, "none", False),
        ("none", False, "none", False),
    ),
    causal_quantize_methods="torchao-int8,bnb-int8,bnb-nf4",
    causal_activation_shapes="",  # bench/causal_activations.py's SHAPES: every causal family the planner has a row of
    causal_activation_batches="4,16",
    causal_activation_layers=4,
    quantize_methods="torchao-int8,bnb-int8,bnb-nf4",
    speed_profile=("t5-small", 32),
    speed_t5=(
        ("t5-small", 32, "compile=layers optim=adamw_torch dataloader_num_workers=2"),  # the walkthrough's batch
        ("t5-small", 256, "compile=layers"),  # a batch that can load the GPU
        ("t5-large", 32, "compile=layers optim=adamw_torch"),
    ),
    speed_causal=(
        (
            "lora",
            True,
            16,
            "fused_loss=chunked fused_loss=liger lora_base_dtype=bfloat16 packing=True "
            "packing=True,attention=flex_attention compile=layers",
        ),
        ("full", False, 16, "fused_loss=chunked fused_loss=liger packing=True,attention=flex_attention compile=layers"),
    ),
    speed_steps=8,
    speed_repetitions=2,
    budgets={
        "environment": 60,
        "data": 90,
        "speed": 330,
        "strategies": 170,
        "throughput": 150,
        "flops_profiler": 75,
        "inference": 150,
        "two_ranks": 45,
        "causal": 300,
        "causal_quantize": 180,  # 90 s ran out in bitsandbytes' int8 generation over 256 questions (H200, 2026-11-26)
        "causal_activations": 120,
        "op_builds": 30,
    },
)
# The code path of every step, as cheaply as it runs (the test suite runs this): one DeepSpeed run and one LoRA run.
CPU = Sizes(
    shape="tiny",
    precision="fp32",
    batch=8,
    strategies="zero2",
    lora_strategies="none",
    memory_steps=2,
    concurrent=1,
    throughput_shapes="cpu-small",
    throughput_steps=2,
    throughput_warmup=1,
    flops_runs=(("zero1", "fp32"),),
    questions=8,
    batching_questions=8,
    causal_batch=8,
    causal_runs=(("none", True, "none", True), ("none", True, "nf4", False)),
    causal_quantize_methods="dynamic-int8",
    causal_activation_shapes="openai-community/gpt2",  # the smallest vocabulary of the built-in shapes
    causal_activation_batches="2",
    causal_activation_layers=1,
    quantize_methods="dynamic-int8",
    # The code path of each: the profile on the tiny T5, and the causal levers that run here beside two refused (GPU
    # only); the T5 levers' runs take the same path (bench/speed_levers.py) and are left to the GPU
    speed_profile=("tiny", 8),
    speed_t5=(),
    speed_causal=(
        ("lora", True, 8, "fused_loss=chunked lora_base_dtype=bfloat16 attention=flex_attention fused_loss=liger"),
    ),
    speed_steps=2,
    speed_repetitions=1,
    budgets={
        "environment": 60,
        "data": 180,
        "speed": 400,
        "strategies": 300,
        "throughput": 240,
        "flops_profiler": 180,
        "inference": 180,
        "two_ranks": 90,
        "causal": 300,
        "causal_quantize": 180,
        "causal_activations": 120,
        "op_builds": 30,
    },
)


# ---------------------------------------------------------------------------------------------------------------------
# Running a step's commands under its budget
# ---------------------------------------------------------------------------------------------------------------------


class StepFailed(Exception):
    """A step's command failed or ran out of time; the message holds the end of its output."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def child_env(on_gpu: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if not on_gpu:
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def run(command: list[str], deadline: float, log, env: dict) -> str:
    """Run one command until `deadline` (time.monotonic()); its output goes to the log and comes back. On time-out its
    whole process group is killed, so nothing it started keeps running."""
    log.write(f"\n$ {' '.join(command)}\n")
    log.flush()
    with tempfile.TemporaryFile(mode="w+") as output:
        child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            output.seek(0)
            text = output.read()
            log.write(text)
            raise StepFailed("timed out", text[-TAIL_CHARS:]) from None
        output.seek(0)
        text = output.read()
    log.write(text)
    log.flush()
    if child.returncode != 0:
        raise StepFailed("failed", f"exit status {child.returncode}\n{text[-TAIL_CHARS:]}")
    return text


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------------------------------

ENVIRONMENT_PROBE = r"""
import json, os, subprocess, sys
import torch
from bench.common import machine
facts = {"machine": machine()}
try:
    facts["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.TimeoutExpired) as error:
    facts["nvidia_smi"] = f"not available: {error}"
if torch.cuda.is_available():
    facts["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    facts["bf16_native"] = torch.cuda.is_bf16_supported(including_emulation=False)
    x = torch.ones(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    facts["cuda_context_bytes"] = total - free - torch.cuda.memory_reserved()
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    dist.all_reduce(x)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    facts["cuda_context_and_nccl_bytes"] = total - free - torch.cuda.memory_reserved()
    dist.destroy_process_group()
for name in ("deepspeed", "transformers", "peft", "bitsandbytes", "torchao", "datasets", "accelerate"):
    try:
        facts.setdefault("versions", {})[name] = __import__(name).__version__
    except Exception as error:  # a missing or broken package is a finding, not a crash
        facts.setdefault("versions", {})[name] = f"unavailable: {type(error).__name__}: {error}"[:300]
print("ENVIRONMENT " + json.dumps(facts))
"""

OP_BUILDS = r"""
import json, time
from deepspeed.ops.op_builder import CPUAdamBuilder
started = time.time()
CPUAdamBuilder().load()
print("OPS " + json.dumps({"cpu_adam_seconds": round(time.time() - started, 1)}))
"""

TWO_RANKS = r"""
import json, os, sys
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
result = {}
for backend in (["nccl", "gloo"] if torch.cuda.is_available() else ["gloo"]):
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        x = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(x)
        result[backend] = {"ok": True, "sum": x[0].item()}
    except Exception as error:
        result[backend] = {"ok": False, "error": f"{type(error).__name__}: {error}"[:400]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
if rank == 0:
    print("TWO_RANKS " + json.dumps(result))
"""


def marked_json(text: str, marker: str) -> dict:
    line = next(line for line in text.splitlines() if line.startswith(marker + " "))
    return json.loads(line[len(marker) + 1 :])


def step_environment(ctx) -> dict:
    from textsql.train.distributed import free_port

    return marked_json(
        run([sys.executable, "-c", ENVIRONMENT_PROBE, str(free_port())], ctx.deadline, ctx.log, ctx.env),
        "ENVIRONMENT",
    )


def real_flags(ctx) -> list[str]:
    """The benchmarks' flags for the real WikiSQL lines, T5's tokenizer and configs (--real), else none."""
    if ctx.real is None:
        return []
    return ["--source", str(ctx.real / "wikisql"), "--tokenizer", str(ctx.real / "t5" / "spiece.model")] + [
        "--t5_configs",
        str(ctx.real / "t5"),
    ]


def step_data(ctx) -> dict:
    if ctx.real is not None:  # prepared once, where plan_vs_measured.py and train_throughput.py look for it
        code = (
            "from bench.common import prepared_release; import sys, json; "
            "d = prepared_release(sys.argv[1], sys.argv[2], sys.argv[3]); "
            "print('DATA ' + json.dumps({'data_dir': str(d), 'source': 'WikiSQL release lines, T5 tokenizer'}))"
        )
        command = [sys.executable, "-c", code, str(ctx.real / "wikisql"), str(ctx.real / "t5" / "spiece.model")]
        paths = marked_json(run([*command, str(ctx.work)], ctx.deadline, ctx.log, ctx.env), "DATA")
        ctx.data_dir = Path(paths["data_dir"])
        return paths
    code = (
        "from textsql.demo.tiny import build_assets; import sys, json; "
        f"d, m = build_assets(sys.argv[1], train_tables={TRAIN_TABLES}, questions_per_table=10, seed=0); "
        "print('DATA ' + json.dumps({'data_dir': str(d), 'tokenizer_dir': str(m)}))"
    )
    paths = marked_json(
        run([sys.executable, "-c", code, str(ctx.work / "generated")], ctx.deadline, ctx.log, ctx.env), "DATA"
    )
    ctx.data_dir, ctx.tiny_t5 = Path(paths["data_dir"]), Path(paths["tokenizer_dir"])
    return paths


def step_strategies(ctx) -> dict:
    sizes, bench = ctx.sizes, str(REPO / "bench" / "plan_vs_measured.py")
    common = [
        "--shapes",
        sizes.shape,
        "--precisions",
        sizes.precision,
        "--batch_sizes",
        str(sizes.batch),
        "--steps",
        str(sizes.memory_steps),
        "--concurrent",
        str(sizes.concurrent),
        "--train_tables",
        str(TRAIN_TABLES),
        "--workdir",
        str(ctx.work),
        *real_flags(ctx),
    ]
    result = {}
    for name, extra in (
        ("full", ["--strategies", sizes.strategies]),
        ("lora", ["--strategies", sizes.lora_strategies, "--lora"]),
    ):
        output = ctx.work / f"plan_vs_measured-{name}.json"
        run([sys.executable, bench, *common, *extra, "--output", str(output)], ctx.deadline, ctx.log, ctx.env)
        report = read_json(output)
        result[name] = {"runs": report["runs"], "calibration": report["calibration"]}
    return result


def step_throughput(ctx) -> dict:
    sizes = ctx.sizes
    output = ctx.work / "train_throughput.json"
    command = [
        sys.executable,
        str(REPO / "bench" / "train_throughput.py"),
        "--shapes",
        sizes.throughput_shapes,
        "--steps",
        str(sizes.throughput_steps),
        "--warmup_steps",
        str(sizes.throughput_warmup),
        "--repetitions",
        "1",
        "--train_tables",
        str(TRAIN_TABLES),
        "--workdir",
        str(ctx.work),
        "--output",
        str(output),
        *real_flags(ctx),
    ]
    run(command, ctx.deadline, ctx.log, ctx.env)
    report = read_json(output)
    return {"data": report["data"], "results": report["results"]}


def step_flops_profiler(ctx) -> dict:
    """`textsql train --flops_profiler 3` on the model plan_vs_measured built (the same shape and data): the
    walkthrough's setting (ZeRO-1, fp32) and, on a GPU, textsql's default precision without DeepSpeed."""
    from textsql.run_summary import read_summary

    sizes = ctx.sizes
    models = sorted((ctx.work / "models").glob(f"{sizes.shape}-vocab*"))
    if not models:
        raise StepFailed("failed", f"no {sizes.shape} model under {ctx.work / 'models'}: the strategies step builds it")
    runs = []
    for strategy, precision in sizes.flops_runs:
        runs_root = ctx.work / "flops-runs" / f"{strategy}-{precision}"
        command = [sys.executable, "-m", "textsql.cli", "train", "--model_id", str(models[0])]
        command += ["--dataset_dir", str(ctx.data_dir), "--runs_root", str(runs_root), "--precision", precision]
        command += ["--deepspeed", strategy] if strategy != "none" else []
        command += ["--per_device_train_batch_size", str(sizes.batch), "--max_steps", "4", "--flops_profiler", "3"]
        command += ["--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--overwrite", "True"]
        command += ["--execution_accuracy_samples", "0"]
        command += ["--num_gpus", "1"]
        run(command, ctx.deadline, ctx.log, ctx.env)
        summaries = sorted(runs_root.glob("*/run_summary.json"))
        if not summaries:
            raise StepFailed("failed", f"no run_summary.json under {runs_root}")
        summary = read_summary(summaries[-1]).as_dict()
        runs.append(
            {
                "run": summaries[-1].parent.name,
                "strategy": strategy,
                "precision": precision,
                "flops_profile": summary.get("flops_profile"),
                "train_samples_per_second": summary.get("train_samples_per_second"),
                "memory_check": summary.get("memory_check"),
            }
        )
    return {"runs": runs, "walkthrough_reference_tflops_per_gpu": 2.35}


def step_inference(ctx) -> dict:
    sizes = ctx.sizes
    shape = [] if sizes.shape == "tiny" else ["--shape", sizes.shape]
    batching_output, quantize_output = ctx.work / "infer_batching.json", ctx.work / "quantize_methods.json"
    batching = [sys.executable, str(REPO / "bench" / "infer_batching.py"), "--questions", str(sizes.batching_questions)]
    batching += ["--repeats", "2", "--output", str(batching_output)]
    batching += [*shape, "--dataset_dir", str(ctx.data_dir)] if shape else []
    run(batching, ctx.deadline, ctx.log, ctx.env)
    result = {"batching": read_json(batching_output)}
    quantize = [sys.executable, str(REPO / "bench" / "quantize_methods.py"), "--dataset_dir", str(ctx.data_dir)]
    quantize += ["--shape", "t5-small"] if shape else ["--model_dir", str(next((ctx.work / "models").glob("tiny-*")))]
    quantize += ["--questions", str(sizes.questions), "--repeats", "2", "--methods", sizes.quantize_methods]
    quantize += ["--max_new_tokens", "32", "--output", str(quantize_output)]
    run(quantize, ctx.deadline, ctx.log, ctx.env)
    result["quantization"] = read_json(quantize_output)["results"]
    return result


def step_two_ranks(ctx) -> dict:
    from textsql.train.distributed import free_port

    script = ctx.work / "two_ranks.py"
    script.write_text(TWO_RANKS)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(free_port()), str(script)]
    return marked_json(run(command, ctx.deadline, ctx.log, ctx.env), "TWO_RANKS")


# Qwen2.5-0.5B's shape (its config.json): the 0.5B-class causal LM the recipes name, random weights, the real Qwen2
# tokenizer (151,936 ids; tied embeddings) from --real.
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

CAUSAL_MODEL = r"""
import json, sys
from pathlib import Path
out, raw, qwen = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if qwen:  # Qwen2.5-0.5B's shape with the real tokenizer
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(qwen)
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **json.loads(sys.argv[4]))
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    shape = "Qwen2.5-0.5B shape, real Qwen2 tokenizer"
else:  # the tiny causal LM of the tests, its tokenizer trained on the data
    from textsql.demo.tiny import release_records
    from textsql.tiny import corpus_for_tokenizer, make_tiny_causal_model
    questions, tables = release_records(raw)
    make_tiny_causal_model(out, corpus_for_tokenizer(questions, tables, prefix=""))
    shape = "tiny Qwen2 (textsql.tiny), byte-level BPE trained on the data"
print("MODEL " + json.dumps({"model_dir": str(out), "shape": shape}))
"""


def causal_model_and_data(ctx) -> tuple[dict, Path, Path]:
    """(the model's record, its folder, its prepared data): Qwen2.5-0.5B's shape with the real Qwen2 tokenizer on a
    GPU with --real, else the tiny Qwen2; built and prepared once, for the speed and causal steps."""
    if getattr(ctx, "causal_model", None):
        return ctx.causal_model
    qwen = ctx.real / "qwen2" if ctx.real is not None and (ctx.real / "qwen2" / "tokenizer.json").is_file() else None
    raw = ctx.real / "wikisql" if ctx.real is not None else ctx.work / "generated" / "wikisql-generated"
    model_dir, data_dir = ctx.work / "causal-model", ctx.work / "causal-data"
    command = [sys.executable, "-c", CAUSAL_MODEL, str(model_dir), str(raw)]
    command += [str(qwen) if qwen and ctx.on_gpu else "", json.dumps(QWEN25_05B)]
    model = marked_json(run(command, ctx.deadline, ctx.log, ctx.env), "MODEL")
    prep = [sys.executable, "-m", "textsql.cli", "prep", "--source", str(raw), "--model_id", str(model_dir)]
    prep += ["--output_dir", str(data_dir), "--source_format", "question+header", "--overwrite", "True"]
    run(prep, ctx.deadline, ctx.log, ctx.env)
    ctx.causal_model = (model, model_dir, data_dir)
    return ctx.causal_model


def step_speed(ctx) -> dict:
    """Where a step's time goes, and each speed lever on and off with the best combination, MFU from the model's FLOPs
    (bench/step_profile.py, bench/speed_levers.py): t5-small's shape at the walkthrough's batch of 32 and at one that
    loads the GPU, t5-large's, and Qwen2.5-0.5B's (LoRA and full fine-tuning) in bf16; on the CPU the tiny models,
    the GPU-only levers recorded with textsql's reason."""
    sizes, bench = ctx.sizes, REPO / "bench"
    device = ["--device", "cuda"] if ctx.on_gpu else ["--device", "cpu", "--threads", "1"]
    common = [*device, "--steps", str(sizes.speed_steps), "--repetitions", str(sizes.speed_repetitions)]
    result = {"t5": [], "causal": []}
    t5_models = {}

    def t5_model(shape: str) -> Path:  # the tiny T5 the data step built, or a random T5 of the real shape
        if shape not in t5_models:
            if shape == "tiny":
                t5_models[shape] = ctx.tiny_t5
            else:
                folder = ctx.work / "speed-models" / shape
                code = "import sys; from bench.shapes import save_random_t5; save_random_t5(*sys.argv[1:])"
                run([sys.executable, "-c", code, str(folder), str(ctx.data_dir), shape], ctx.deadline, ctx.log, ctx.env)
                t5_models[shape] = folder
        return t5_models[shape]

    shape, batch = sizes.speed_profile  # where one step goes, at the walkthrough's batch
    output = ctx.work / "step_profile.json"
    profile = [sys.executable, str(bench / "step_profile.py"), "--model", str(t5_model(shape)), *device]
    profile += ["--dataset_dir", str(ctx.data_dir), "--batch", str(batch), "--precision", sizes.precision]
    profile += ["--steps", str(4 * sizes.speed_steps), "--warmup", "2", "--repetitions", str(sizes.speed_repetitions)]
    run([*profile, "--output", str(output)], ctx.deadline, ctx.log, ctx.env)
    result["profile"] = read_json(output)
    for shape, batch, levers in sizes.speed_t5:
        output = ctx.work / f"speed-{shape}-{batch}.json"
        command = [sys.executable, str(bench / "speed_levers.py"), "--model", str(t5_model(shape)), *common]
        command += ["--dataset_dir", str(ctx.data_dir), "--batch", str(batch), "--precision", sizes.precision]
        run([*command, "--levers", levers, "--output", str(output)], ctx.deadline, ctx.log, ctx.env)
        result["t5"].append({"shape": shape, "batch": batch, **read_json(output)})
    model, model_dir, data_dir = causal_model_and_data(ctx)
    result["causal_model"] = model
    for label, lora, batch, levers in sizes.speed_causal:
        output = ctx.work / f"speed-causal-{label}.json"
        command = [sys.executable, str(bench / "speed_levers.py"), "--model", str(model_dir), *common]
        command += ["--dataset_dir", str(data_dir), "--batch", str(batch), "--precision", "bf16"]
        command += ["--lora"] if lora else []
        run([*command, "--levers", levers, "--output", str(output)], ctx.deadline, ctx.log, ctx.env)
        result["causal"].append({"label": label, "batch": batch, **read_json(output)})
    return result


def step_causal(ctx) -> dict:
    """A decoder-only causal LM through textsql's own commands: prep (prompt + SQL + EOS), training (LoRA and full
    fine-tuning) with the run summary's peak memory and throughput, then batched left-padded generation, scored."""
    from textsql.run_summary import read_summary

    sizes = ctx.sizes
    model, model_dir, data_dir = causal_model_and_data(ctx)
    textsql = [sys.executable, "-m", "textsql.cli"]
    result, summary_paths = {"model": model, "runs": []}, []
    for strategy, lora, quantize_base, packing in sizes.causal_runs:
        label = f"{strategy}{'-lora' if lora else ''}{'' if quantize_base == 'none' else '-' + quantize_base}"
        runs_root = ctx.work / "causal-runs" / f"{label}{'-packed' if packing else ''}"
        train = [*textsql, "train", "--model_id", str(model_dir), "--dataset_dir", str(data_dir)]
        train += ["--runs_root", str(runs_root), "--lora", str(lora), "--max_steps", str(sizes.memory_steps + 3)]
        train += ["--quantize_base", quantize_base] if quantize_base != "none" else []
        train += ["--packing", "True"] if packing else []
        train += ["--per_device_train_batch_size", str(sizes.causal_batch), "--precision", sizes.precision]
        train += ["--deepspeed", strategy] if strategy != "none" else []
        train += ["--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--num_gpus", "1"]
        train += ["--execution_accuracy_samples", "0"]
        entry = {"strategy": strategy, "lora": lora, "quantize_base": quantize_base, "packing": packing}
        try:  # one setting that fails (a strategy refused with a quantized base, say) is a finding; the rest run
            run([*train, "--overwrite", "True"], ctx.deadline, ctx.log, ctx.env)
        except StepFailed as failure:
            if failure.status == "timed out":
                raise
            result["runs"].append({**entry, "failed": str(failure)[-600:]})
            continue
        (summary_path,) = runs_root.glob("*/run_summary.json")
        summary_paths.append(summary_path)
        summary = read_summary(summary_path)
        result["runs"].append(
            {
                **entry,
                "run": summary_path.parent.name,
                "parameters": summary.parameters,
                "trainable_parameters": summary.trainable_parameters,
                "train_samples_per_second": summary.train_samples_per_second,
                "real_tokens_per_second": summary.real_tokens_per_second,
                "first_logged_loss": summary.first_logged_loss,
                "last_logged_loss": summary.last_logged_loss,
                "peak_memory_per_rank": summary.peak_memory_per_rank,
                "memory_check": summary.memory_check,
            }
        )
    if not summary_paths:
        raise StepFailed("failed", "no causal training finished: " + json.dumps(result["runs"])[-TAIL_CHARS:])
    first_run = summary_paths[0].parent  # the first setting's model is the one scored
    scored = ctx.work / "causal-infer"
    infer = [*textsql, "infer", "--model_dir", str(first_run), "--dataset_dir", str(data_dir), "--split", "test"]
    run([*infer, "--max_examples", str(sizes.questions), "--output_dir", str(scored)], ctx.deadline, ctx.log, ctx.env)
    result["inference"] = read_json(scored / "eval_metrics.json")
    ctx.causal = {"model_dir": model_dir, "data_dir": data_dir, "full_run": _full_run(summary_paths)}
    return result


def _full_run(summary_paths: list) -> Path | None:
    """The run folder of the causal LM's full fine-tuning (a plain model every quantization method takes)."""
    from textsql.run_summary import read_summary

    summaries = {path: read_summary(path) for path in summary_paths}
    return next((p.parent for p, s in summaries.items() if s.trainable_parameters == s.parameters), None)


def step_causal_quantize(ctx) -> dict:
    """Every quantization method on the causal LM the causal step trained: size, questions/s and agreement with the
    unquantized model (bench/quantize_methods.py), on the causal step's own data."""
    causal = getattr(ctx, "causal", None)
    if not causal:
        raise StepFailed("skipped", "the causal step did not run or trained nothing")
    model_dir = causal["full_run"] or causal["model_dir"]
    output = ctx.work / "causal_quantize_methods.json"
    quantize = [sys.executable, str(REPO / "bench" / "quantize_methods.py"), "--dataset_dir", str(causal["data_dir"])]
    quantize += ["--model_dir", str(model_dir), "--questions", str(ctx.sizes.questions), "--repeats", "2"]
    quantize += ["--methods", ctx.sizes.causal_quantize_methods, "--max_new_tokens", "32", "--output", str(output)]
    run(quantize, ctx.deadline, ctx.log, ctx.env)
    return {"model_dir": str(model_dir), "results": read_json(output)["results"]}


def step_causal_activations(ctx) -> dict:
    """What one causal LM training step saves for its backward pass and its peak above the model, for every family's
    built-in shape cut to a few layers, full fine-tuning and LoRA, beside the planner's terms
    (bench/causal_activations.py): what the planner's causal activations are calibrated from."""
    sizes = ctx.sizes
    output = ctx.work / "causal_activations.json"
    probe = [sys.executable, str(REPO / "bench" / "causal_activations.py"), "--device", "cuda" if ctx.on_gpu else "cpu"]
    probe += ["--shapes", sizes.causal_activation_shapes] if sizes.causal_activation_shapes else []
    probe += ["--batches", sizes.causal_activation_batches, "--layers", str(sizes.causal_activation_layers)]
    probe += ["--precision", sizes.precision, "--output", str(output)]
    run(probe, ctx.deadline, ctx.log, ctx.env)
    return {"rows": read_json(output)["rows"]}


# In the order they run: the most wanted figures first, so a call cut short still has them.
STEPS = {
    "environment": step_environment,
    "data": step_data,
    "speed": step_speed,  # the first measurement: what the next GPU window is for (issue 39)
    "strategies": step_strategies,
    "throughput": step_throughput,
    "flops_profiler": step_flops_profiler,
    "causal": step_causal,
    "causal_quantize": step_causal_quantize,
    "causal_activations": step_causal_activations,
    "inference": step_inference,
    "two_ranks": step_two_ranks,
}


# ---------------------------------------------------------------------------------------------------------------------
# The whole check
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Context:
    sizes: Sizes
    work: Path
    env: dict
    log: object
    real: Path | None = None
    on_gpu: bool = False
    deadline: float = 0.0
    data_dir: Path | None = None
    tiny_t5: Path | None = None  # the data step's tiny T5 (generated data)
    causal_model: tuple | None = None  # causal_model_and_data's (record, model folder, data folder), built once
    causal: dict | None = None  # the causal step's model, data and full fine-tuning run, for causal_quantize


def write_report(report: dict, output: Path) -> None:
    temporary = output.with_suffix(".partial")
    temporary.write_text(json.dumps(report, indent=2, default=str) + "\n")
    temporary.replace(output)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="Run every step on the tiny shapes on this machine's CPU.")
    parser.add_argument("--output", required=True, help="The JSON report, rewritten after every step.")
    parser.add_argument("--log", default=None, help="Every command's whole output (default: beside --output).")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"Comma-separated, from {', '.join(STEPS)}.")
    parser.add_argument(
        "--workdir", default=None, help="Where data, models and runs go (default: a fresh temporary one)."
    )
    parser.add_argument(
        "--real",
        type=Path,
        default=None,
        help="A copy of ../shared/real (wikisql/, t5/): real questions, lengths and T5's 32k vocabulary instead of "
        "generated data (bench/gpu/prepare.sh copies it to bench/gpu/real where it exists).",
    )
    parser.add_argument(
        "--total_budget_s",
        type=float,
        default=None,
        help="Stop starting steps when this much time has passed, and cut the step then running (the device tool "
        "allows 600 s a command); default: no limit beyond each step's own.",
    )
    parser.add_argument(
        "--budget_scale", type=float, default=1.0, help="Multiply every step's time budget (a slower machine)."
    )
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")
    import torch  # only to know where we are: no CUDA context in this process (it would count in the runs' memory)

    on_gpu = torch.cuda.is_available() and not args.cpu
    sizes = GPU if on_gpu else CPU
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="textsql-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(on_gpu)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(work / "torch-extensions"))  # one op cache for every step
    report = {
        "benchmark": "gpu_check",
        "version": REPORT_VERSION,
        "mode": "gpu" if on_gpu else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sizes": {k: v for k, v in sizes.__dict__.items() if k != "budgets"},
        "data": "WikiSQL release lines with T5's tokenizer (--real)" if args.real else "generated WikiSQL-format data",
        "steps": {},
    }
    started = time.monotonic()
    with open(args.log or output.with_suffix(".log"), "w") as log:
        ctx = Context(
            sizes=sizes, work=work, env=env, log=log, real=args.real.resolve() if args.real else None, on_gpu=on_gpu
        )
        # DeepSpeed's CPU Adam (ZeRO offload) compiles once: in the background from the start, so neither the
        # strategies' runs nor any timing pays for it (they wait on the same lock if they get there first).
        op_build = subprocess.Popen(
            [sys.executable, "-c", OP_BUILDS],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        total_deadline = started + args.total_budget_s if args.total_budget_s else float("inf")
        for name in steps:
            budget = sizes.budgets[name] * args.budget_scale
            if total_deadline - time.monotonic() < 15:
                report["steps"][name] = {
                    "status": "skipped",
                    "error_tail": "the total budget (--total_budget_s) ran out",
                }
                write_report(report, output)
                continue
            ctx.deadline = min(time.monotonic() + budget, total_deadline)
            load_before = os.getloadavg()[0]
            step_started = time.monotonic()
            entry = {"budget_s": budget}
            print(f"== {name} (budget {budget:.0f} s)", flush=True)
            try:
                entry.update(status="ok", result=STEPS[name](ctx))
            except StepFailed as failure:
                entry.update(status=failure.status, error_tail=str(failure))
            except Exception as error:  # noqa: BLE001  (a broken step is recorded; the next one runs)
                entry.update(status="failed", error_tail=f"{type(error).__name__}: {error}"[-TAIL_CHARS:])
            entry.update(
                seconds=round(time.monotonic() - step_started, 1),
                load_average_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)],
            )
            report["steps"][name] = entry
            report["wall_seconds"] = round(time.monotonic() - started, 1)
            write_report(report, output)
            print(f"   {entry['status']} in {entry['seconds']} s", flush=True)
        try:
            # On the CPU the build may go to the caller's shared op cache (the test suite's): never killed mid-way
            # there, since a killed build leaves a lock every later DeepSpeed run would wait on.
            text, _ = op_build.communicate(timeout=sizes.budgets["op_builds"] if on_gpu else None)
            builds = {"status": "ok", "result": marked_json(text, "OPS")} if op_build.returncode == 0 else None
            builds = builds or {"status": "failed", "error_tail": text[-TAIL_CHARS:]}
        except subprocess.TimeoutExpired:
            os.killpg(op_build.pid, signal.SIGKILL)
            builds = {"status": "timed out"}
        except StopIteration:
            builds = {"status": "failed", "error_tail": "no OPS line"}
        report["steps"]["op_builds"] = builds
        report["wall_seconds"] = round(time.monotonic() - started, 1)
        write_report(report, output)
    print(summary_table(report), flush=True)
    return 0


def summary_table(report: dict) -> str:
    """The last lines printed: one per step, so the end of the output says what happened."""
    lines = [f"gpu_check ({report['mode']}), {report.get('wall_seconds')} s:"]
    for name, entry in report["steps"].items():
        lines.append(f"  {name:<15} {entry['status']:<10} {entry.get('seconds', '')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
