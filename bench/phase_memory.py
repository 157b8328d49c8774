"""Memory of every phase of a run (training steps, evaluation with generation, checkpoint save, final save) on the CPU.

    python bench/phase_memory.py                                   # t5-small shape: zero3_offload, zero3, none
    python bench/phase_memory.py --strategies zero3_offload --steps 2 --output phases.json

Each strategy runs in a fresh process (world size 1, DeepSpeed's CPU accelerator, fp32, random weights of the real
t5-small shape from bench/shapes.py): a few training steps, then generation as textsql's evaluation runs it
(synced_gpus under ZeRO-3, greedy and beam search), a checkpoint save as the Trainer makes one under DeepSpeed (the
16-bit weights gathered to rank 0 with stage3_gather_16bit_weights_on_model_save, then the per-rank optimizer
states), and textsql's final save (save_final_model: every parameter's full fp32 copy through
safe_get_full_fp32_param, then save_pretrained). On a CPU "GPU" and host memory are the same memory, so what a phase
adds is what it allocates: a thread samples the process's resident memory (psutil, every millisecond; DeepSpeed's CPU
accelerator reports the same figure through memory_allocated / max_memory_allocated, but reads it only when called)
and each phase reports its peak above the memory held when it began. glibc is told to return large blocks to the
system (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident figure. The planner's phase predictions
(textsql.planner.phases.predict_phases) for the same run are printed beside them. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402

STRATEGIES = ("zero3_offload", "zero3", "none")
SETTINGS = ("shape", "steps", "batch", "length", "eval_batch", "beams", "precision")
MB = 2**20


class RssSampler:
    """The process's resident memory sampled every `interval` seconds, with the peak since the last mark."""

    def __init__(self, interval: float = 0.001):
        import psutil

        self.process, self.interval = psutil.Process(), interval
        self.peak, self.running = 0, True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def now(self) -> int:
        return self.process.memory_info().rss

    @contextmanager
    def phase(self, results: dict, name: str):
        import gc

        from deepspeed.accelerator import get_accelerator

        gc.collect()
        start = self.now()
        self.peak = start
        get_accelerator().reset_max_memory_allocated()
        began = time.perf_counter()
        yield
        gc.collect()
        end = self.now()
        results[name] = {
            "start_rss_mb": round(start / MB, 1),
            "peak_above_start_mb": round((max(self.peak, end) - start) / MB, 1),
            "held_after_mb": round((end - start) / MB, 1),
            "deepspeed_max_memory_allocated_mb": round(get_accelerator().max_memory_allocated() / MB, 1),
            "seconds": round(time.perf_counter() - began, 2),
        }

    def stop(self):
        self.running = False
        self.thread.join()


def ds_config(strategy: str, d_model: int, batch: int, precision: str) -> dict | None:
    """The shipped dsconfig file of the strategy (zero3 = zero3_offload without offload), "auto" filled as the Trainer
    fills it."""
    if strategy == "none":
        return None
    config = json.loads((REPO / "dsconfig" / "zero3_offload.json").read_text())
    zero = config["zero_optimization"]
    zero.update(
        reduce_bucket_size=d_model * d_model,
        stage3_prefetch_bucket_size=int(0.9 * d_model * d_model),
        stage3_param_persistence_threshold=10 * d_model,
    )
    if strategy == "zero3":
        zero.pop("offload_optimizer")
        zero.pop("offload_param")
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    config.update(
        train_micro_batch_size_per_gpu=batch,
        train_batch_size=batch,
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
        bf16={"enabled": precision == "bf16"},
        fp16={"enabled": False},
        zero_allow_untested_optimizer=True,
    )
    for key in ("flops_profiler", "tensorboard"):
        config.pop(key, None)
    return config


def child(
    strategy: str, shape: str, steps: int, batch: int, length: int, eval_batch: int, beams: int, precision: str
) -> dict:
    """One strategy's phases in this process."""
    import deepspeed
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from textsql.planner.shape import T5_SHAPES, T5_VOCAB_SIZE

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = T5Config(
        **T5_SHAPES[shape], vocab_size=T5_VOCAB_SIZE, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0
    )
    dsconfig = ds_config(strategy, config.d_model, batch, precision)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler = RssSampler()
    phases: dict = {}
    work = Path(tempfile.mkdtemp(prefix="phase_memory_"))
    atexit.register(shutil.rmtree, work, True)  # the checkpoints (1.2 GB for t5-small) go, the run fails or not
    with sampler.phase(phases, "model_and_engine_setup"):
        if dsconfig is None:
            model = T5ForConditionalGeneration(config).to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            engine = None
        else:
            deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
            context = deepspeed.zero.Init(config_dict_or_path=dsconfig)
            with context:
                model = T5ForConditionalGeneration(config)
            optimizer = None if "optimizer" in dsconfig else torch.optim.AdamW(model.parameters(), lr=1e-4)
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=dsconfig)

    def batch_of(size: int) -> dict:
        ids = torch.randint(2, T5_VOCAB_SIZE, (size, length), device=device)
        labels = torch.randint(2, 1000, (size, length), device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    with sampler.phase(phases, "training_steps"):
        for _ in range(steps):
            inputs = batch_of(batch)
            if engine is None:
                with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = model(**inputs).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                loss = engine(**inputs).loss
                engine.backward(loss)
                engine.step()
    module = model if engine is None else engine.module
    zero3 = engine is not None
    with sampler.phase(phases, "evaluation_loss"), torch.no_grad():  # the Trainer's evaluation loop, eval batch
        module.eval()
        module(**batch_of(eval_batch)).loss.item()
        module.train()
    for name, num_beams in (("evaluation_generation_greedy", 1), (f"evaluation_generation_beams{beams}", beams)):
        with sampler.phase(phases, name), torch.no_grad():
            module.eval()
            inputs = batch_of(eval_batch)
            module.generate(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                max_new_tokens=length,
                min_new_tokens=length,  # every sequence as long as the longest target: the cache at its largest
                num_beams=num_beams,
                synced_gpus=zero3,
            )
            module.train()
    with sampler.phase(phases, "checkpoint_save"):
        folder = work / "checkpoint"
        if engine is None:
            model.save_pretrained(str(folder), safe_serialization=True)
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")
        else:
            # The Trainer's save under DeepSpeed: the 16-bit weights (gathered to rank 0 under ZeRO-3 with
            # stage3_gather_16bit_weights_on_model_save) through save_pretrained, then the per-rank optimizer states.
            state = engine._zero3_consolidated_16bit_state_dict()
            module.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
            del state
            engine.save_checkpoint(str(folder))
    with sampler.phase(phases, "final_save_fp32"):
        # textsql/train/trainer.py save_final_model, as it runs under each strategy
        if engine is None:
            state = {n: p.detach().to("cpu", torch.float32) for n, p in model.named_parameters()}
        else:
            from deepspeed.utils import safe_get_full_fp32_param

            state = {}
            for n, p in module.named_parameters():
                full = safe_get_full_fp32_param(p)
                state[n] = (p if full is None else full).detach().to("cpu", torch.float32)
        module.save_pretrained(str(work / "final"), state_dict=state, safe_serialization=True)
        del state
    sampler.stop()
    parameters = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
    return {"strategy": strategy, "parameters": parameters, "phases": phases}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def predicted(strategy: str, args) -> dict:
    """The planner's phases for the same run (fp32, world size 1, the bench's batch and lengths), in MB."""
    from textsql.arguments.plan import PlanArguments
    from textsql.planner.recommend import plan_memory

    plan = plan_memory(
        PlanArguments(
            model_id=args.shape,
            per_device_train_batch_size=args.batch,
            max_source_length=args.length,
            max_target_length=args.length,
            precision=args.precision,
            per_device_eval_batch_size=args.eval_batch,
            execution_accuracy_num_beams=args.beams,
        )
    )
    row = plan["strategies"][strategy]
    return {
        name: {"gpu_mb": round(p["gpu_total_bytes"] / MB, 1), "cpu_per_node_mb": round(p["cpu_per_node_bytes"] / MB, 1)}
        for name, p in row["phases"].items()
    } | {"peak_phase": row["peak_phase"], "cpu_peak_phase": row["cpu_peak_phase"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--shape", default="t5-small")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=32, help="source and target tokens (every sequence padded)")
    parser.add_argument("--eval_batch", type=int, default=8)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16 on a GPU")
    parser.add_argument("--output")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.child, *(getattr(args, k) for k in SETTINGS))
        print("PHASES " + json.dumps(result))
        return 0
    import torch

    runs = []
    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    for strategy in args.strategies.split(","):
        env = dict(
            os.environ,
            MALLOC_MMAP_THRESHOLD_="65536",
            OMP_NUM_THREADS="1",
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        command = [sys.executable, __file__, "--child", strategy] + [f"--{k}={getattr(args, k)}" for k in SETTINGS]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("PHASES ")]
        if done.returncode or not lines:
            runs.append({"strategy": strategy, "error": done.stderr[-2000:]})
            continue
        run = json.loads(lines[-1].removeprefix("PHASES "))
        run["planner"] = predicted(strategy, args)
        runs.append(run)
    load = os.getloadavg()
    emit(
        {
            "benchmark": "phase_memory",
            "machine": machine() | {"load_average_1_5_15": [round(x, 2) for x in load]},
            "settings": {k: getattr(args, k) for k in SETTINGS} | {"world_size": 1},
            "runs": runs,
        },
        args.output,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
