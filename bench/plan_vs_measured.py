"""The memory planner against measured peaks: train a few steps of a T5 shape under each strategy, compare with `textsql plan`.

    python bench/plan_vs_measured.py                        # CPU: tiny shape, fp32, batch 8, every strategy (~2 minutes)
    python bench/plan_vs_measured.py --output result.json   # on a GPU: t5-small and t5-large shapes, bf16 and fp32, batch 8 and 32
    python bench/plan_vs_measured.py --shapes t5-large --precisions bf16 --batch_sizes 32 --strategies zero3,zero3_offload
    python bench/plan_vs_measured.py --coordinator_sweep    # ZeRO-3 residency: DeepSpeed's coordinator against the replay
    python bench/plan_vs_measured.py --table a.json b.json  # results as the Markdown table of bench/README.md

Each run is `textsql train` (the same code users run) in a fresh process pinned to one GPU (CUDA_VISIBLE_DEVICES,
world size 1): a randomly initialised model of the shape (T5Config, seeded, saved in fp32), generated WikiSQL-format
data, --max_steps steps of the given batch, every strategy's DeepSpeed config (the shipped dsconfig/ files, one per strategy; zero3_nvme
swaps to nvme/ in its runs root; FSDP's by name, on GPUs; --lora trains a LoRA adapter
under each strategy instead; --concurrent N runs N at once on the GPU, for a short GPU window). The run summary's memory check holds the
measurement (torch.cuda.max_memory_reserved / max_memory_allocated on the GPU; the process's peak RSS on a CPU) and the
planner's prediction for that exact run (model, strategy, precision, batch, the longest sequences it trained on, the
filled DeepSpeed config); this script adds two figures for calibrating the planner's constants on a GPU: the memory
the device uses beyond torch's reservation (the CUDA context and NCCL's buffers, from torch.cuda.mem_get_info) and
the ratio reserved / allocated (the caching allocator's overhead). Under ZeRO-3 it also reads DeepSpeed's
PartitionedParameterCoordinator during the training steps: the most parameter elements it held gathered, against
the planner's replay of that coordinator. That figure counts elements, not bytes, so it is comparable on a CPU too.

It prints one JSON object. On a CPU the memory comparison is "not comparable" (the prediction is of GPU memory), but
every code path runs. This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine, prepared_release, prepared_tokenizer  # noqa: E402  (the root is on sys.path)
from bench.shapes import T5_NAMES, bench_config, build_t5  # noqa: E402
from textsql.strategy.table import DEEPSPEED_STRATEGIES, FSDP_STRATEGIES, NVME_STRATEGIES  # noqa: E402

# FSDP runs on GPUs only (on a CPU textsql refuses it before training, and the run is recorded as refused).
STRATEGIES = DEEPSPEED_STRATEGIES + FSDP_STRATEGIES
REFUSED_MARKER = "textsql refused the run before training:"

# Shapes (random init: memory does not depend on the weights): a tiny one whose vocabulary is the tokenizer's, and the
# T5 checkpoints' (bench.shapes).
TINY = dict(d_model=128, d_ff=512, num_layers=2, num_heads=4, d_kv=32)
SHAPES = ("tiny",) + T5_NAMES
GPU_DEFAULTS = {"shapes": "t5-small,t5-large", "precisions": "bf16,fp32", "batch_sizes": "8,32", "steps": 5}
CPU_DEFAULTS = {"shapes": "tiny", "precisions": "fp32", "batch_sizes": "8", "steps": 3}
# Settings for --coordinator_sweep: (max_live_parameters, max_reuse_distance, prefetch_bucket_size,
# param_persistence_threshold, gradient checkpointing), chosen so that the tiny model's residency differs between them.
SWEEP = [
    (10**9, 10**9, 0, 100, False),
    (10**9, 0, 0, 100, False),
    (10**9, 150_000, 0, 100, True),
    (40_000, 0, 3000, 100, False),
    (10**9, 0, 3000, 100, False),
    (10**9, 10**9, 50_000, 5000, False),
]


# ---------------------------------------------------------------------------------------------------------------------
# Measuring DeepSpeed's ZeRO-3 parameter coordinator
# ---------------------------------------------------------------------------------------------------------------------


def install_coordinator_probe(only_in_training_steps: bool) -> dict:
    """Record, after every fetch of a complete-trace step, how many parameter elements DeepSpeed's ZeRO-3
    PartitionedParameterCoordinator holds gathered (its __n_available_params). Returns the dict it fills: `timelines`
    holds a list per forward pass (reset_step starts one). With only_in_training_steps, fetches outside the Trainer's
    training_step (evaluation, saving) are ignored."""
    import transformers
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    probe = {"timelines": [[]], "in_step": not only_in_training_steps}
    fetch, reset = Coordinator.fetch_sub_module, Coordinator.reset_step

    def probed_reset(self):
        reset(self)
        probe["timelines"].append([])

    def probed_fetch(self, module, forward):
        fetch(self, module, forward)
        if probe["in_step"] and self.is_complete_trace():
            probe["timelines"][-1].append(self._PartitionedParameterCoordinator__n_available_params)

    Coordinator.reset_step, Coordinator.fetch_sub_module = probed_reset, probed_fetch
    if only_in_training_steps:
        training_step = transformers.Trainer.training_step

        def probed_training_step(self, *args, **kwargs):
            probe["in_step"] = True
            try:
                return training_step(self, *args, **kwargs)
            finally:
                probe["in_step"] = False

        transformers.Trainer.training_step = probed_training_step
    return probe


def coordinator_peak(probe: dict) -> int | None:
    """The most elements gathered in any complete-trace step, or None when there was none (not ZeRO-3)."""
    values = [v for timeline in probe["timelines"] for v in timeline]
    return max(values) if values else None


def coordinator_sweep(seed: int = 0) -> list[dict]:
    """Run real DeepSpeed ZeRO-3 (3 steps of a tiny T5, batch 2) under each SWEEP setting in this process and compare
    the coordinator's gathered elements after every fetch of the last step with the planner's replay."""
    import deepspeed
    import torch
    from deepspeed.utils import logger
    from transformers import T5Config, T5ForConditionalGeneration

    from textsql.planner import zero3_trace
    from textsql.planner.shape import resolve_model
    from textsql.train.distributed import ensure_distributed_env

    logger.setLevel(logging.WARNING)  # DeepSpeed logs to stdout, where the JSON goes
    probe = install_coordinator_probe(only_in_training_steps=False)
    ensure_distributed_env()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    config = T5Config(
        d_model=64,
        d_ff=256,
        num_layers=2,
        num_heads=4,
        d_kv=16,
        vocab_size=1000,
        decoder_start_token_id=0,
        pad_token_id=0,
        dropout_rate=0.1,
    )
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        shape = resolve_model(folder)
    results = []
    for live, reuse, prefetch, persistence, checkpointing in SWEEP:
        torch.manual_seed(seed)
        model = T5ForConditionalGeneration(config)
        if checkpointing:
            model.config.use_cache = False
            model.activation_checkpointing_enable()
        ds_config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {
                "stage": 3,
                "stage3_max_live_parameters": live,
                "stage3_max_reuse_distance": reuse,
                "stage3_prefetch_bucket_size": prefetch,
                "stage3_param_persistence_threshold": persistence,
            },
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=ds_config
        )
        ids = torch.randint(1, 1000, (2, 7), device=engine.device)
        probe["timelines"].clear()
        for _ in range(3):  # the first step records the trace; the next ones use it
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        measured = [t for t in probe["timelines"] if t][-1]
        persistent = frozenset(i for i, n in enumerate(shape.parameter_sizes) if n <= persistence)
        events, module_parameters = zero3_trace.zero3_step_events(shape.module_trace, persistent, checkpointing)
        replay = zero3_trace.simulate_parameter_coordinator(
            shape.parameter_sizes, events, module_parameters, persistent, prefetch, live, reuse
        )
        results.append(
            {
                "stage3_max_live_parameters": live,
                "stage3_max_reuse_distance": reuse,
                "stage3_prefetch_bucket_size": prefetch,
                "stage3_param_persistence_threshold": persistence,
                "gradient_checkpointing": checkpointing,
                "deepspeed_peak_gathered": max(measured),
                "replayed_peak_gathered": replay["peak_gathered"],
                "fetches": len(measured),
                "every_fetch_equal": measured == replay["timeline"],
            }
        )
        engine.destroy()
    return results


# ---------------------------------------------------------------------------------------------------------------------
# One training run (child process)
# ---------------------------------------------------------------------------------------------------------------------


def run_child(result_path: str, train_argv: list[str]) -> None:
    """Train with `textsql train` under the coordinator probe and write what the parent needs."""
    import torch

    from textsql.arguments.training import parse_arguments
    from textsql.errors import TextsqlError
    from textsql.train.run import train

    probe = install_coordinator_probe(only_in_training_steps=True)
    try:
        summary = train(*parse_arguments(train_argv))
    except TextsqlError as error:  # refused before training (FSDP on a CPU, ...): the reason, not a traceback
        print(f"{REFUSED_MARKER} {error}", file=sys.stderr)
        raise SystemExit(3) from None
    device = {}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        device = {
            "device_used_bytes": total - free,
            "reserved_now_bytes": torch.cuda.memory_reserved(),
            "device_total_bytes": total,
        }
    Path(result_path).write_text(
        json.dumps(
            {
                "summary": summary.as_dict(),
                "coordinator_peak_gathered": coordinator_peak(probe),
                "device_memory_at_end": device,
            },
            default=str,
        )
    )


# ---------------------------------------------------------------------------------------------------------------------
# Parent: assets, one child per (shape, precision, batch, strategy), JSON
# ---------------------------------------------------------------------------------------------------------------------


def build_shape(shape: str, workdir: Path, tokenizer_dir: Path, t5_configs: str | None = None) -> Path:
    """A folder with a randomly initialised T5 of the shape (saved in fp32) and the data's tokenizer (with any
    characters prep added, so the embeddings have a row for each)."""
    from textsql.hub import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    folder = workdir / "models" / f"{shape}-vocab{len(tokenizer)}"
    if (folder / "config.json").exists():
        return folder
    config = bench_config(shape, tokenizer, {"tiny": TINY}, t5_configs)
    model = build_t5(config, seed=0)  # on the CPU: a CUDA context here would count in the runs' device memory
    model.save_pretrained(folder)  # fp32: a bf16 save would load as bf16
    del model
    tokenizer.save_pretrained(folder)
    return folder


def strategy_configs(workdir: Path) -> dict[str, str | None]:
    """Strategy name -> DeepSpeed config path (None: no DeepSpeed; an FSDP strategy: its name, for --fsdp_config): the
    shipped files, one per strategy of the planner's table. (`workdir` is kept for callers; nothing is written there.)"""
    from textsql.strategy.dsconfig import shipped_configs

    return {"none": None, **{name: name for name in FSDP_STRATEGIES}} | {  # FSDP: the shipped name, --fsdp_config
        name: str(path) for name, path in shipped_configs().items()
    }


def longest_lengths(data_dir: Path, examples: int, on_gpu: bool) -> tuple[int, int]:
    """The longest source and target among the first `examples` training examples (what the run trains on), rounded
    up to a multiple of 8 on a GPU as the collator pads them."""
    from textsql.prepared import load_prepared

    dataset, _ = load_prepared(data_dir)
    train = dataset["train"].select(range(min(examples, len(dataset["train"]))))
    source, target = max(map(len, train["input_ids"])), max(map(len, train["labels"]))
    multiple = 8 if on_gpu else 1
    return -(-source // multiple) * multiple, -(-target // multiple) * multiple


def train_argv(
    model_dir: Path,
    data_dir: Path,
    runs_root: Path,
    strategy_config: str | None,
    precision: str,
    batch: int,
    steps: int,
    checkpointing: bool,
    lora: bool = False,
) -> list[str]:
    argv = [
        "--model_id",
        str(model_dir),
        "--dataset_dir",
        str(data_dir),
        "--runs_root",
        str(runs_root),
        "--max_steps",
        str(steps),
        "--max_train_samples",
        str(steps * batch),
        "--per_device_train_batch_size",
        str(batch),
        "--per_device_eval_batch_size",
        str(batch),
        "--max_eval_samples",
        str(batch),
        "--precision",
        precision,
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--logging_steps",
        str(steps),
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "0",
        "--seed",
        "0",
        "--overwrite",
        "True",
        "--activation_checkpointing",
        str(checkpointing),
    ]
    if strategy_config and Path(strategy_config).stem in NVME_STRATEGIES:  # ZeRO-Infinity swaps into the run's root
        argv += ["--nvme_path", str(runs_root / "nvme")]
    if lora:
        argv += ["--lora", "True"]
    if strategy_config in FSDP_STRATEGIES:
        return argv + ["--fsdp_config", strategy_config]
    return argv + (["--deepspeed", strategy_config] if strategy_config else [])


def child_env(gpu: int) -> dict:
    import torch

    env = dict(
        os.environ,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"),
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)  # one GPU: world size 1, no DataParallel
    else:
        from textsql.strategy.devices import use_accelerator

        use_accelerator("cpu", env)
        env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # textsql train sets up a world of one
    return env


def one_run(
    args,
    shape: str,
    model_dir: Path,
    data_dir: Path,
    config: str | None,
    strategy: str,
    precision: str,
    batch: int,
    lora: bool = False,
) -> dict:
    import torch

    from textsql.planner import check
    from textsql.run_summary import RunSummary

    on_gpu = torch.cuda.is_available()
    label = f"{shape}-{strategy}{'-lora' if lora else ''}-{precision}-bs{batch}"
    with tempfile.NamedTemporaryFile(suffix=".json") as result_file:
        argv = train_argv(
            model_dir,
            data_dir,
            Path(args.workdir) / "runs" / label,
            config,
            precision,
            batch,
            args.steps,
            args.gradient_checkpointing,
            lora,
        )
        started = time.time()
        done = subprocess.run(
            [sys.executable, __file__, "--child", result_file.name, "--", *argv],
            capture_output=True,
            text=True,
            env=child_env(args.gpu),
        )
        seconds = round(time.time() - started, 1)
        if done.returncode != 0:
            tail = (done.stdout[-2000:] + done.stderr[-4000:]).strip()
            print(f"[{label}] failed in {seconds} s", file=sys.stderr, flush=True)
            return {
                "run": label,
                "shape": shape,
                "strategy": strategy,
                "lora": lora,
                "precision": precision,
                "batch": batch,
                "failed": True,
                "out_of_memory": "out of memory" in tail.lower(),
                "refused": REFUSED_MARKER in tail,
                "error_tail": tail[-1500:],
            }
        child = json.loads(Path(result_file.name).read_text())
    summary = RunSummary.from_dict(child["summary"])
    lengths = longest_lengths(data_dir, args.steps * batch, on_gpu)
    check = check.compare_with_run(summary, *lengths)
    rank = summary.peak_memory_per_rank[0]
    result = {
        "run": label,
        "shape": shape,
        "parameters": summary.parameters,
        "strategy": strategy,
        "lora": lora,
        "precision": precision,
        "batch": batch,
        "lengths": list(lengths),
        "steps": summary.global_step,
        "seconds": seconds,
        "gradient_checkpointing": args.gradient_checkpointing,
        "device": rank.get("device"),
        "comparable": check["comparable"],
        "reason": check.get("reason"),
        "measured": {
            "cuda_max_reserved_bytes": rank.get("cuda_max_reserved_bytes"),
            "cuda_max_allocated_bytes": rank.get("cuda_max_allocated_bytes"),
            "cpu_peak_rss_bytes": rank.get("cpu_peak_rss_bytes"),
        },
        "predicted": {
            "reserved_bytes": check.get("predicted_reserved_bytes"),
            "allocated_bytes": check.get("predicted_allocated_bytes"),
            "gpu_total_bytes": check.get("predicted_gpu_total_bytes"),
            "gpu_gb": check.get("predicted_gpu_gb"),
        },
        "ratio_reserved": check.get("ratio"),
        "ratio_allocated": check.get("ratio_allocated"),
    }
    if rank.get("cuda_max_allocated_bytes"):
        result["reserved_over_allocated"] = round(rank["cuda_max_reserved_bytes"] / rank["cuda_max_allocated_bytes"], 3)
    end = child["device_memory_at_end"]
    if end and args.concurrent == 1:  # with runs beside it, the device's memory is theirs too
        result["device_used_beyond_reserved_bytes"] = end["device_used_bytes"] - end["reserved_now_bytes"]
    if child["coordinator_peak_gathered"] is not None:
        predicted = check.get("predicted_zero3_gathered_elements")
        result["zero3_gathered_elements"] = {
            "coordinator": child["coordinator_peak_gathered"],
            "planner": predicted,
            "equal": child["coordinator_peak_gathered"] == predicted,
        }
    print(
        f"[{label}] {seconds} s: "
        + (f"measured/predicted reserved {result['ratio_reserved']}" if check["comparable"] else "not comparable (CPU)")
        + (f", ZeRO-3 gathered {result['zero3_gathered_elements']}" if "zero3_gathered_elements" in result else ""),
        file=sys.stderr,
        flush=True,
    )
    return result


def calibration(runs: list[dict]) -> dict:
    """What the GPU runs say about the planner's constants (medians), beside the values it uses."""
    from textsql.planner.phases import ALLOCATOR_OVERHEAD_FRACTION, CUDA_CONTEXT_BYTES

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    measured = [r for r in runs if r.get("comparable")]
    return {
        "runs": len(measured),
        "device_used_beyond_reserved_bytes": median(r.get("device_used_beyond_reserved_bytes") for r in measured),
        "planner_cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "reserved_over_allocated": median(r.get("reserved_over_allocated") for r in measured),
        "planner_allocator_overhead_fraction": ALLOCATOR_OVERHEAD_FRACTION,
        "ratio_reserved": {
            "median": median(r.get("ratio_reserved") for r in measured),
            "min": min((r["ratio_reserved"] for r in measured), default=None),
            "max": max((r["ratio_reserved"] for r in measured), default=None),
        },
    }


def markdown_table(reports: list[dict]) -> str:
    """The runs of one or more result files as the Markdown table bench/README.md shows."""
    gib = 2**30

    def gb(value):
        return f"{value / gib:.2f}" if value else "–"

    lines = [
        "| shape | precision | batch | strategy | measured reserved GB | predicted reserved GB | measured / predicted "
        "| reserved / allocated | ZeRO-3 gathered: coordinator / planner |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for report in reports:
        for r in report["runs"]:
            if r.get("failed"):
                lines.append(
                    f"| {r['shape']} | {r['precision']} | {r['batch']} | {r['strategy']} | "
                    f"{'out of memory' if r.get('out_of_memory') else 'failed'} | | | | |"
                )
                continue
            gathered = r.get("zero3_gathered_elements")
            residency = f"{gathered['coordinator'] / 1e6:.2f}M / {gathered['planner'] / 1e6:.2f}M" if gathered else ""
            ratio = r["ratio_reserved"] if r["ratio_reserved"] is not None else "not comparable"
            measured = r["measured"]
            reserved = (
                gb(measured["cuda_max_reserved_bytes"])
                if measured["cuda_max_reserved_bytes"]
                else f"(CPU: peak RSS {gb(measured['cpu_peak_rss_bytes'])})"
            )
            lines.append(
                f"| {r['shape']} | {r['precision']} | {r['batch']} | {r['strategy']} "
                f"| {reserved} | {gb(r['predicted']['reserved_bytes'])} | {ratio} "
                f"| {r.get('reserved_over_allocated', '–')} | {residency} |"
            )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"Comma-separated, from {', '.join(SHAPES)} (default: {CPU_DEFAULTS['shapes']} "
        f"on a CPU, {GPU_DEFAULTS['shapes']} on a GPU).",
    )
    parser.add_argument(
        "--precisions", default=None, help="Comma-separated bf16, fp32 (default: fp32 on a CPU, bf16,fp32 on a GPU)."
    )
    parser.add_argument(
        "--batch_sizes", default=None, help="Comma-separated per-device batches (default: 8 on a CPU, 8,32 on a GPU)."
    )
    parser.add_argument(
        "--strategies",
        default=",".join(DEEPSPEED_STRATEGIES),
        help="Comma-separated, from the planner's strategies (default: every DeepSpeed one; FSDP's run on GPUs).",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="Training steps per run, at least 2: ZeRO-3 records its trace in "
        "the first (default: 3 on a CPU, 5 on a GPU).",
    )
    parser.add_argument("--gradient_checkpointing", action="store_true", help="Train with activation checkpointing.")
    parser.add_argument(
        "--lora", action="store_true", help="Train a LoRA adapter under each strategy instead of the whole model."
    )
    parser.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="Runs at once on the one GPU (each process's own CUDA peak stays exact; the device-wide figure "
        "device_used_beyond_reserved_bytes is then left out, and the seconds are not comparable).",
    )
    parser.add_argument("--gpu", type=int, default=0, help="The GPU every run is pinned to (CUDA_VISIBLE_DEVICES).")
    parser.add_argument("--train_tables", type=int, default=200, help="Generated training tables (10 questions each).")
    parser.add_argument(
        "--source",
        default=None,
        help="WikiSQL release files (a folder or .tar.bz2) instead of generated data: prepared once in "
        "--workdir with --tokenizer, so the runs and the planner's lengths are the real ones.",
    )
    parser.add_argument(
        "--tokenizer",
        default="t5-small",
        help="With --source: a hub name, a model folder, or T5's spiece.model or tokenizer.json file.",
    )
    parser.add_argument(
        "--t5_configs",
        default=None,
        help="A folder of t5-base/config.json, t5-large/config.json (the real checkpoints' configs) "
        "for the T5 shapes; default: the same numbers built in.",
    )
    parser.add_argument(
        "--workdir",
        default=str(Path(tempfile.gettempdir()) / "textsql-bench-memory"),
        help="Where the generated data, the models and the runs go (reused).",
    )
    parser.add_argument(
        "--coordinator_sweep",
        action="store_true",
        help="Only compare DeepSpeed's ZeRO-3 coordinator with the planner's replay on a tiny T5 (seconds).",
    )
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    parser.add_argument(
        "--table",
        nargs="+",
        default=None,
        metavar="RESULT_JSON",
        help="Only print the runs of these result files as a Markdown table.",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("train_argv", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        run_child(args.child, args.train_argv)
        return 0
    if args.table:
        print(markdown_table([json.loads(Path(path).read_text()) for path in args.table]))
        return 0
    import torch

    from textsql.strategy.devices import prepare_deepspeed_import

    on_gpu = torch.cuda.is_available()
    prepare_deepspeed_import()
    started = time.time()
    if args.coordinator_sweep:
        report = {
            "benchmark": "plan_vs_measured/coordinator_sweep",
            "machine": machine(),
            "results": coordinator_sweep(),
        }
    else:
        report = bench(args, on_gpu)
    report["wall_seconds"] = round(time.time() - started, 1)
    emit(report, args.output)
    return 0


def bench(args, on_gpu: bool) -> dict:
    from textsql.demo.tiny import build_assets

    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    shapes = (args.shapes or defaults["shapes"]).split(",")
    precisions = (args.precisions or defaults["precisions"]).split(",")
    batches = [int(b) for b in (args.batch_sizes or defaults["batch_sizes"]).split(",")]
    strategies = args.strategies.split(",")
    args.steps = args.steps or defaults["steps"]
    unknown = [s for s in shapes if s not in SHAPES] + [s for s in strategies if s not in STRATEGIES]
    if unknown or args.steps < 2 or not set(precisions) <= {"bf16", "fp32"}:
        raise SystemExit(
            f"unknown shape(s)/strategy(ies) {unknown}, precisions {precisions} or --steps {args.steps}: shapes "
            f"{list(SHAPES)}, strategies {list(STRATEGIES)}, precisions bf16/fp32, at least 2 steps."
        )
    if "bf16" in precisions and not on_gpu:
        raise SystemExit(
            "bf16 is measured on a GPU (on a CPU it is emulated autocast, not what a pod runs); use --precisions fp32 here."
        )
    workdir = Path(args.workdir)
    if args.source:
        data_dir = prepared_release(args.source, args.tokenizer, workdir)
        tokenizer_dir = prepared_tokenizer(data_dir)
    else:
        data_dir, tokenizer_dir = build_assets(
            workdir / "generated", train_tables=args.train_tables, questions_per_table=10, seed=0
        )
    configs = strategy_configs(workdir)
    jobs = []
    for shape in shapes:
        model_dir = build_shape(shape, workdir, tokenizer_dir, args.t5_configs)
        for precision in precisions:
            for batch in batches:
                for strategy in strategies:
                    jobs.append((shape, model_dir, configs[strategy], strategy, precision, batch, args.lora))
    with ThreadPoolExecutor(max_workers=max(1, args.concurrent)) as pool:  # each run is a child process
        runs = list(
            pool.map(
                lambda job: one_run(
                    args,
                    job[0],
                    model_dir=job[1],
                    data_dir=data_dir,
                    config=job[2],
                    strategy=job[3],
                    precision=job[4],
                    batch=job[5],
                    lora=job[6],
                ),
                jobs,
            )
        )
    facts = machine()
    return {
        "benchmark": "plan_vs_measured",
        "date": time.strftime("%Y-%m-%d"),
        "device": facts.get("gpu", "cpu"),
        "machine": facts,
        "comparable": on_gpu,
        "note": None
        if on_gpu
        else "No GPU: the predictions are of GPU memory and the measurements are the processes' "
        "peak RSS, so no ratio is given; the ZeRO-3 gathered-parameter figures are comparable.",
        "steps": args.steps,
        "concurrent": args.concurrent,
        "runs": runs,
        "calibration": calibration(runs),
    }


if __name__ == "__main__":
    sys.exit(main())
