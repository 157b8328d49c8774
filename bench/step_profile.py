"""Where one training step goes: data loading and collation, host work in the Trainer (callbacks, logging, token
counting, clipping, the sampler), forward, backward, optimizer, and every call that would wait on a GPU (.item(),
.cpu(), .tolist(), bool() of a tensor, nonzero), for textsql's Trainer (built by the functions `textsql train` uses)
against the plain transformers Trainer and a plain PyTorch loop, on the same model, data and batches.

    python bench/step_profile.py                        # CPU: the tiny T5, one thread; the host overhead in ms per step
    python bench/step_profile.py --model tiny-qwen2     # the tiny causal LM
    python bench/step_profile.py --model ~/.cache/textsql/models/smollm2-135m-instruct --dataset_dir DATA --steps 4
    python bench/step_profile.py --device cuda          # on a GPU: also torch's profiler (GPU busy time, syncs)

On the CPU the model's compute is negligible (a tiny model), so a step's time is the host's own work: what every
step pays whatever the GPU. `textsql_before` is textsql's Trainer with the per-step costs this benchmark found and
removed put back (device-side token counting, the Trainer's parameter walk per micro-batch, the NaN check of every
micro-batch's loss), so before and after are measured side by side in one run. The variants alternate (A B C D, D C
B A, ...) over --repetitions rounds; the JSON has each round, the median and min per variant, and the load average.
A benchmark: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)

VARIANTS = ("loop", "hf_trainer", "textsql_before", "textsql")
PHASES = ("data", "forward", "backward", "optimizer", "clip", "callbacks", "logging")
# The tensor methods that make the host wait for the device (on a GPU); counted, with who called them.
SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "nonzero")


# ---------------------------------------------------------------------------------------------------------------------
# Instruments: phase timers and sync counters, installed for this benchmark only
# ---------------------------------------------------------------------------------------------------------------------


class Probe:
    """Accumulates host time per phase and sync calls (by phase and caller) while `active`. The clock: on the CPU this
    thread's CPU time (one torch thread: what the step itself costs, not the time other work on a shared machine
    takes from it); on a GPU the wall clock, the device synchronised at each phase's end."""

    def __init__(self, sync_device: bool):
        self.sync_device = sync_device  # on a GPU: synchronise at phase edges so each phase's time is its own
        self.clock = time.perf_counter if sync_device else time.thread_time
        self.active = False
        self.seconds = Counter()
        self.syncs = Counter()
        self.sync_callers = Counter()
        self.stack: list[str] = []
        self.step_ends: list[float] = []

    def phase(self, name: str):
        probe = self

        class Timed:
            def __enter__(self):
                probe.stack.append(name)
                self.started = probe.clock()

            def __exit__(self, *exc):
                probe.stack.pop()
                if probe.active and not probe.stack:  # a phase inside another (a callback inside logging) is its
                    probe.seconds[name] += probe.clock() - self.started  # outer phase's time

        return Timed()

    def wrap(self, owner, attribute: str, name: str):
        original = getattr(owner, attribute)

        def wrapped(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, wrapped)

    def step_end(self):
        if self.sync_device:
            import torch

            torch.cuda.synchronize()
        self.step_ends.append(self.clock())

    def count_sync(self, method: str):
        if not self.active:
            return
        phase = self.stack[-1] if self.stack else "trainer"
        self.syncs[f"{phase}:{method}"] += 1
        self.sync_callers[f"{method} from {caller()}"] += 1


def caller() -> str:
    """The first frame outside torch and this benchmark: the code that asked (textsql, transformers, accelerate)."""
    frame = sys._getframe(3)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith("step_profile.py"):
            short = path.split("site-packages/")[-1] if "site-packages/" in path else Path(path).name
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def install_sync_counters(probe: Probe):
    """Wrap the tensor methods that synchronise (SYNC_METHODS) and torch.nonzero so that each call is counted."""
    import torch

    def counting(method, original):
        def wrapped(self, *args, **kwargs):
            probe.count_sync(method)
            return original(self, *args, **kwargs)

        return wrapped

    for method in SYNC_METHODS:
        setattr(torch.Tensor, method, counting(method, getattr(torch.Tensor, method)))
    original_nonzero = torch.nonzero

    def nonzero(*args, **kwargs):
        probe.count_sync("nonzero")
        return original_nonzero(*args, **kwargs)

    torch.nonzero = nonzero


def instrument_model(model, probe: Probe) -> None:
    """Forward timed by hooks on the top module (peft's or the model itself)."""
    state = {}

    def pre(module, args, kwargs):
        probe.stack.append("forward")
        state["started"] = probe.clock()

    def post(module, args, kwargs, output):
        probe.stack.pop()
        if probe.active:
            if probe.sync_device:
                import torch

                torch.cuda.synchronize()
            probe.seconds["forward"] += probe.clock() - state["started"]

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True, always_call=True)


def optimizer_hooks(probe: Probe):
    """The optimizer's step timed by torch's global optimizer hooks (any optimizer, inside any wrapper)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    state = {}

    def pre(optimizer, args, kwargs):
        probe.stack.append("optimizer")
        state["started"] = probe.clock()

    def post(optimizer, args, kwargs):
        probe.stack.pop()
        if probe.active:
            if probe.sync_device:
                torch.cuda.synchronize()
            probe.seconds["optimizer"] += probe.clock() - state["started"]

    return register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)


# ---------------------------------------------------------------------------------------------------------------------
# The model, the data and the three ways of training them
# ---------------------------------------------------------------------------------------------------------------------


def build_assets(args):
    """(dataset folder, model folder): given, or generated with the tiny T5 / tiny Qwen2 (textsql.tiny)."""
    if args.dataset_dir and args.model not in ("tiny-t5", "tiny-qwen2"):
        return Path(args.dataset_dir), Path(args.model).expanduser()
    workdir = Path(args.workdir)
    if args.model == "tiny-t5":
        from textsql.demo.tiny import build_assets as demo_assets

        data_dir, model_dir = demo_assets(  # one block of width 32: a step's compute is a fraction of its host work
            workdir / "step-profile-t5", train_tables=40, questions_per_table=10, d_model=32, num_layers=1, seed=0
        )
        return Path(args.dataset_dir or data_dir), Path(model_dir)
    from textsql.arguments.prep import PrepArguments
    from textsql.demo.tiny import release_records
    from textsql.prep import prepare_dataset
    from textsql.tiny import corpus_for_tokenizer, make_tiny_causal_model
    from textsql.wikisql.synthetic import generate_wikisql

    folder = workdir / "step-profile-qwen2"
    model_dir, data_dir = folder / "tiny-qwen2", folder / "data"
    if not (data_dir / "textsql_data.json").is_file():
        raw = generate_wikisql(folder / "raw", train_tables=40, dev_tables=4, test_tables=4, questions_per_table=10)
        questions, tables = release_records(raw)
        make_tiny_causal_model(
            model_dir, corpus_for_tokenizer(questions, tables, prefix=""), hidden_size=32, num_layers=1
        )
        prepare_dataset(PrepArguments(source=str(raw), model_id=str(model_dir), output_dir=str(data_dir)))
    return Path(args.dataset_dir or data_dir), model_dir


def textsql_setup(args, model_dir: Path, data_dir: Path, output_dir: Path):
    """What `textsql train` builds before its Trainer: the run's arguments finalized by set_up_run's decisions, the
    training split and tokenizer, the model as it loads it, the collator."""
    from textsql.arguments.training import DataArguments, ModelArguments, TextsqlTrainingArguments
    from textsql.families import family_of
    from textsql.hub import load_tokenizer
    from textsql.train.collate import make_collator
    from textsql.train.objective import load_base_model, load_training_data
    from textsql.train.run import set_up_run
    from textsql.vocabulary import fit_embeddings

    model_args = ModelArguments(model_id=str(model_dir))
    training = TextsqlTrainingArguments(
        output_dir=str(output_dir),
        overwrite=True,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.batch,
        logging_steps=args.logging_steps,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        precision=args.precision,
        accelerator=args.device,
        seed=0,
        **args.levers,
    )
    plan = set_up_run(model_args, training)
    finalized = copy.copy(training).finalize(**plan.trainer_settings)
    train_set, _, _, tokenizer = load_training_data(
        DataArguments(dataset_dir=str(data_dir)), load_tokenizer(str(model_dir))
    )
    model = load_base_model(str(model_dir), finalized, plan)
    fit_embeddings(model, tokenizer)  # the characters prep added to the tokenizer, as textsql train grows them
    family = family_of(model.config)
    collator = make_collator(
        family, tokenizer, model, packing=finalized.packing, pad_to_multiple_of=8 if args.device == "cuda" else None
    )
    return finalized, train_set, tokenizer, model, family, collator


def before_class(trainer_class):
    """textsql's Trainer as it was before this benchmark: the batch's tokens counted on the device at every
    micro-batch (two sums and a transfer), and transformers' parameter walk for every micro-batch's FLOPs."""
    import torch
    import transformers

    from textsql.train.collate import TOKEN_COUNTS_KEY

    class Before(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.data_collator = self.data_collator.collator  # no counting on the host: it counted on the device

        def log(self, logs, start_time=None):
            self._pending_tokens = int(getattr(self, "_device_tokens", torch.zeros(())).item())
            self._device_tokens = torch.zeros((), dtype=torch.long)
            return super().log(logs, start_time)

        def _prepare_inputs(self, inputs):
            inputs.pop(TOKEN_COUNTS_KEY, None)
            return transformers.Trainer._prepare_inputs(self, inputs)

        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")
            tokens = mask.sum() if mask is not None else inputs["input_ids"].new_tensor(inputs["input_ids"].numel())
            if not self.is_causal:
                tokens = tokens + (inputs["labels"] != -100).sum()
            self._device_tokens = getattr(self, "_device_tokens", torch.zeros((), dtype=torch.long))
            self._device_tokens = self._device_tokens.to(tokens.device) + tokens
            return super().training_step(model, inputs, num_items_in_batch)

        def floating_point_ops(self, inputs):
            return transformers.Trainer.floating_point_ops(self, inputs)

    return Before


def make_runner(variant: str, args, setup, probe: Probe):
    """A function that trains warm-up + measured steps of `variant` on a fresh copy of the model."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerCallback, TrainingArguments

    from textsql.train.sft import trainer_class as supervised_trainer_class

    finalized, train_set, tokenizer, model, family, collator = setup

    class StepEnds(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            probe.step_end()
            if state.global_step == args.warmup:
                probe.active = True

    def instrument(trainer):
        probe.wrap(trainer, "get_batch_samples", "data")
        probe.wrap(trainer.accelerator, "backward", "backward")
        probe.wrap(trainer.accelerator, "clip_grad_norm_", "clip")
        probe.wrap(trainer.callback_handler, "call_event", "callbacks")
        probe.wrap(trainer, "log", "logging")
        instrument_model(trainer.model, probe)
        trainer.add_callback(StepEnds())

    def fresh_model():
        return copy.deepcopy(model)

    if variant == "loop":
        return lambda: plain_loop(args, finalized, train_set, fresh_model(), collator, probe)
    if variant == "hf_trainer":

        def run():
            kind = (Trainer, TrainingArguments) if family.causal else (Seq2SeqTrainer, Seq2SeqTrainingArguments)
            plain_args = kind[1](
                output_dir=finalized.output_dir,
                max_steps=finalized.max_steps,
                per_device_train_batch_size=finalized.per_device_train_batch_size,
                learning_rate=finalized.learning_rate,
                logging_steps=finalized.logging_steps,
                report_to="none",
                save_strategy="no",
                eval_strategy="no",
                disable_tqdm=True,
                bf16=finalized.bf16,
                use_cpu=finalized.use_cpu,
                seed=0,
                train_sampling_strategy=finalized.train_sampling_strategy,  # the same batches as textsql's
            )
            trainer = kind[0](model=fresh_model(), args=plain_args, train_dataset=train_set, data_collator=collator)
            instrument(trainer)
            trainer.train()

        return run
    trainer_class = supervised_trainer_class(family)
    if variant == "textsql_before":
        trainer_class = before_class(trainer_class)

    def run():
        step_args = copy.copy(finalized)
        if variant == "textsql_before":
            step_args.logging_nan_inf_filter = True  # transformers' default: a NaN check (a sync) per micro-batch
        trainer = trainer_class(
            model=fresh_model(),
            args=step_args,
            train_dataset=train_set,
            data_collator=collator,
            processing_class=tokenizer,
        )
        trainer.is_causal = family.causal
        instrument(trainer)
        trainer.train()

    return run


def plain_loop(args, finalized, train_set, model, collator, probe: Probe) -> None:
    """A plain PyTorch loop on the same batches: the textsql Trainer's own sampler order, AdamW (fused where the
    Trainer would use it), linear decay, clipping at the Trainer's max_grad_norm, autocast in bf16 runs."""
    import torch
    from torch.utils.data import DataLoader

    from textsql.families import family_of
    from textsql.train.collate import TOKEN_COUNTS_KEY
    from textsql.train.sft import trainer_class

    device = torch.device(args.device)
    model.to(device).train()
    instrument_model(model, probe)
    trainer = trainer_class(family_of(model.config))(
        model=model, args=finalized, train_dataset=train_set, data_collator=collator
    )
    loader = DataLoader(train_set, batch_size=args.batch, sampler=trainer._get_train_sampler(), collate_fn=collator)
    fused = "fused" in str(getattr(finalized.optim, "value", finalized.optim))
    optimizer = torch.optim.AdamW(model.parameters(), lr=finalized.learning_rate, fused=fused or None)
    total = args.warmup + args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(finalized.bf16))
    iterator = iter(loader)
    for step in range(total):
        with probe.phase("data"):
            batch = next(iterator, None)
            if batch is None:  # a new epoch, as the Trainer starts one
                iterator = iter(loader)
                batch = next(iterator)
            batch.pop(TOKEN_COUNTS_KEY, None)
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with autocast:
            loss = model(**batch).loss
        with probe.phase("backward"):
            loss.backward()
        with probe.phase("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), finalized.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        probe.step_end()
        if step + 1 == args.warmup:
            probe.active = True


def measure(variant: str, run, probe: Probe, steps: int) -> dict:
    probe.active, probe.seconds, probe.syncs, probe.sync_callers, probe.step_ends = (
        False,
        Counter(),
        Counter(),
        Counter(),
        [],
    )
    cpu_started = time.process_time()
    run()
    probe.active = False
    ends = probe.step_ends[-(steps + 1) :]
    step_ms = 1000 * (ends[-1] - ends[0]) / (len(ends) - 1)
    phases = {name: 1000 * probe.seconds[name] / steps for name in PHASES}
    # clip runs inside the optimizer-step block, not inside another phase; callbacks and logging are the Trainer's
    accounted = sum(
        phases[name] for name in ("data", "forward", "backward", "optimizer", "clip", "callbacks", "logging")
    )
    return {
        "step_ms": step_ms,
        "phases_ms": phases,
        "other_host_ms": step_ms - accounted,
        "trainer_host_ms": step_ms - sum(phases[n] for n in ("data", "forward", "backward", "optimizer")),
        "syncs_per_step": {k: v / steps for k, v in sorted(probe.syncs.items())},
        "sync_calls_outside_data_per_step": sum(v for k, v in probe.syncs.items() if not k.startswith("data:")) / steps,
        "sync_callers": dict(probe.sync_callers.most_common(12)),
        "cpu_seconds": time.process_time() - cpu_started,
    }


def gpu_profile(run) -> dict:
    """torch's profiler over a whole run of one variant: the GPU's busy time and the host's waits on it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        run()
    events = profiler.key_averages()
    by_name = {e.key: e for e in events}
    waits = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "aten::nonzero")
    return {
        "device_busy_ms": sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000,
        "host_waits": {
            name: {"count": by_name[name].count, "ms": by_name[name].cpu_time_total / 1000}
            for name in waits
            if name in by_name
        },
    }


def summarize(rounds: list[dict]) -> dict:
    steps = [r["step_ms"] for r in rounds]
    first = rounds[int(min(range(len(steps)), key=lambda i: steps[i]))]
    return {
        "step_ms_median": statistics.median(steps),
        "step_ms_min": min(steps),
        "phases_ms_median": {n: statistics.median(r["phases_ms"][n] for r in rounds) for n in PHASES},
        "trainer_host_ms_median": statistics.median(r["trainer_host_ms"] for r in rounds),
        "trainer_host_ms_min": min(r["trainer_host_ms"] for r in rounds),
        "sync_calls_outside_data_per_step": first["sync_calls_outside_data_per_step"],
        "syncs_per_step": first["syncs_per_step"],
        "sync_callers": first["sync_callers"],
        "rounds": rounds,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny-t5", help="tiny-t5, tiny-qwen2, or a model folder (with --dataset_dir)"
    )
    parser.add_argument("--dataset_dir", default=None, help="A folder `textsql prep` wrote for that model.")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="Measured steps per variant and round.")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--logging_steps",
        type=float,
        default=100,
        help="As in a real run: textsql logs every 2%% of it (every ~100 steps of a WikiSQL epoch at batch 32).",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (0: torch's default).")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "textsql-bench"))
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    args.levers = {}
    from textsql.strategy.devices import use_accelerator

    use_accelerator(args.device)
    import torch

    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    data_dir, model_dir = build_assets(args)
    probe = Probe(sync_device=args.device == "cuda")
    hooks = optimizer_hooks(probe)
    install_sync_counters(probe)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output:
        setup = textsql_setup(args, model_dir, data_dir, Path(output) / "run")
        variants = [v for v in args.variants.split(",") if v]
        runners = {v: make_runner(v, args, setup, probe) for v in variants}
        rounds: dict[str, list] = {v: [] for v in variants}
        failures = {}
        for repetition in range(args.repetitions):
            for variant in variants if repetition % 2 == 0 else variants[::-1]:
                if variant in failures:
                    continue
                try:
                    rounds[variant].append(measure(variant, runners[variant], probe, args.steps))
                except Exception:  # noqa: BLE001  (a variant that breaks is a finding; the others run)
                    failures[variant] = traceback.format_exc()[-2000:]
        profiles = {}
        if args.device == "cuda":
            probe.active = False
            for variant in variants:
                if variant not in failures:
                    profiles[variant] = gpu_profile(runners[variant])
    for hook in hooks:
        hook.remove()
    results = {v: summarize(r) for v, r in rounds.items() if r}
    loop = results.get("loop", {}).get("step_ms_median")
    report = {
        "benchmark": "step_profile",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "model": str(args.model),
        "model_dir": str(model_dir),
        "family": setup[4].name,
        "parameters": sum(p.numel() for p in setup[3].parameters()),
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": args.precision,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "logging_steps": args.logging_steps,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "results": results,
        "over_the_loop_ms": {v: r["step_ms_median"] - loop for v, r in results.items()} if loop else None,
        "failures": failures,
        "gpu_profiles": profiles,
    }
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
