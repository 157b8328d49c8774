"""run_summary.json, the record of a finished run: its one schema (a versioned dataclass), how it is written (atomically)
and read back, the few lines people read, and what the state of a run folder is. Every reader goes through here."""

from __future__ import annotations

import json
import os
import socket
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import SUMMARY_FILE

# 2: trainable_parameters, and strategy["lora"] (None, or the LoRA settings of a `--lora True` run). A version-1 file
# reads as a full fine-tuning run: every parameter trained.
# 3: flops_profile (--flops_profiler's figures of one step) and comms_summary (--comms_logger's totals); older files
# read with both None: nothing was profiled or logged.
# 4: execution_accuracy_questions (how many validation questions execution_accuracy was measured on); older files read
# None: their --execution_accuracy_samples is the most it can have been.
# 5: grpo (None, or a `--stage grpo` run's settings, parent run and last logged rewards, KL and completion length).
# 6: mfu (every run: its model FLOPs at the examples' real lengths, TFLOPS per GPU and MFU against the GPU's peak;
# None in older files).
# 7: grpo gains its whole curve ("steps": each logged step's reward, execution mean, zero-signal shares, KL, length),
# the execution-based zero-signal share (frac_execution_zero_std), first_execution, TRL's loss_type, scale_rewards,
# mask_truncated_completions and the schedule, and learnable (the --learnable_only filter's statistics); its rewards
# are execution/executes (1/0.1/0) instead of execution/parses/stops. Older grpo blocks read as they were (no curve).
SCHEMA_VERSION = 7
GIB = 1024**3


@dataclass
class RunSummary:
    """What a finished run was and did; written by rank 0 of `textsql train` beside the model.

    Memory per rank: {"rank", "local_rank", "host", "device", "cpu_peak_rss_bytes"} and, on a GPU,
    "cuda_max_allocated_bytes" and "cuda_max_reserved_bytes". `memory_check` is textsql.planner.check.compare_with_run's result.
    """

    run: str = ""
    output_dir: str = ""
    model_id: str = ""
    parameters: int = 0
    trainable_parameters: int | None = None  # parameters the optimizer updated: all of them, or the LoRA adapter's
    world_size: int = 1
    # textsql.strategy.dsconfig.describe_strategy, and "lora": None or {"rank", "alpha", "dropout", "targets"}
    strategy: dict = field(default_factory=lambda: {"label": "none", "zero_stage": None, "lora": None})
    precision: str = "fp32"
    tf32: bool = False
    precision_reason: str = ""
    device: str = "cpu"
    node_devices: str = ""
    resumed_from: str | None = None
    train_runtime: float = 0.0
    train_samples_per_second: float | None = None
    real_tokens: int = 0
    real_tokens_per_second: float | None = None
    global_step: int = 0
    epochs: float = 0.0
    train_loss: float | None = None
    eval_loss: float | None = None
    execution_accuracy: float | None = None  # on the final weights (the last entry of its history)
    execution_accuracy_questions: int | None = None
    execution_accuracy_history: list = field(default_factory=list)  # [{"step", "execution_accuracy"}]
    first_logged_loss: float | None = None
    last_logged_loss: float | None = None
    peak_memory_per_rank: list = field(default_factory=list)  # one dict per rank, rank order (see above)
    tensorboard_dir: str | None = None
    dataset: dict = field(default_factory=dict)  # {"dir", "source", "train_examples"}
    arguments: dict = field(default_factory=dict)  # {"model", "data", "training"}: what the run was given, resolved
    deepspeed_config: dict | None = None  # the config as DeepSpeed ran it ("auto" filled)
    versions: dict = field(default_factory=dict)
    saved_dtype: str = "float32"
    memory_check: dict | None = None
    # DeepSpeed's tools (textsql.train.dstools): the profiled step's figures per GPU ({"step", "profiled", "file", "by",
    # "forward_flops", "forward_macs", "forward_latency_s", "parameters", "flops_per_step", "macs_per_step",
    # "step_latency_s", "tflops_per_gpu", "peak_tflops", "peak", "mfu", ...}), and the comms logger's totals per
    # operation ({"file", "operations": {name: {"count", "total_latency_ms", "bytes"}}}).
    flops_profile: dict | None = None
    comms_summary: dict | None = None
    # Every run (textsql.train.speed.mfu_figures): {"model_flops" (rank 0's, at the real lengths), "seconds",
    # "tflops_per_gpu", "peak_tflops", "peak", "mfu" (None on the CPU or an unknown GPU), "token_counts"}
    mfu: dict | None = None
    # --stage grpo (textsql.train.grpo): {"stage", "num_generations", "max_completion_length", "temperature", "beta",
    # "loss_type", "scale_rewards", "mask_truncated_completions", "learning_rate", "lr_scheduler_type", "warmup_steps",
    # "rewards" (weights), "parent_run", "learnable" (None or the filter's statistics), the last logged "reward",
    # "rewards/<name>/mean", "frac_execution_zero_std", "frac_reward_zero_std", "kl", "completions/mean_length",
    # "first_reward", "first_execution", "logged_steps", and "steps" (the same figures at each logged step)}
    grpo: dict | None = None
    finished: str = ""
    version: int = SCHEMA_VERSION
    extras: dict = field(default_factory=dict)  # fields a newer textsql wrote, kept as they were

    @property
    def strategy_label(self) -> str:
        return self.strategy.get("label", "none")

    @property
    def lora(self) -> dict | None:
        """The LoRA settings of a `--lora True` run; None for full fine-tuning."""
        return self.strategy.get("lora")

    @property
    def nodes(self) -> int:
        """Nodes the run spanned: distinct hosts among the ranks (the world size when hosts are unknown)."""
        hosts = {m.get("host") for m in self.peak_memory_per_rank if m.get("host")}
        return len(hosts) if hosts else int(self.world_size or 1)

    def as_dict(self) -> dict:
        values = asdict(self)
        values.update(values.pop("extras"))
        return values

    @classmethod
    def from_dict(cls, values: dict, source: str = "run summary") -> RunSummary:
        known = {f.name for f in fields(cls)} - {"extras"}
        version = values.get("version", 0)  # 0: written before the schema had a version; the same fields
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            warnings.warn(
                f"{source} has schema version {version!r}, newer than this textsql's {SCHEMA_VERSION}; read as far as known.",
                stacklevel=2,
            )
        summary = cls(**{k: v for k, v in values.items() if k in known})
        summary.extras = {k: v for k, v in values.items() if k not in known}
        if summary.trainable_parameters is None and isinstance(version, int) and version < 2:
            summary.trainable_parameters = summary.parameters  # before LoRA every run trained every parameter
        return summary


def write_summary(summary: RunSummary, run_dir: str | Path) -> Path:
    """Write run_summary.json atomically (a temporary file, then rename): a half-written file never looks like a finished run."""
    run_dir = Path(run_dir)
    path = run_dir / SUMMARY_FILE
    tmp = run_dir / f".{SUMMARY_FILE}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(json.dumps(summary.as_dict(), indent=2, default=str) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_summary(path: str | Path) -> RunSummary:
    """The summary in a run folder (or the file itself); a clear error when there is none or it cannot be read."""
    path = Path(path)
    if path.is_dir():
        path = path / SUMMARY_FILE
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TextsqlError(f"{path} does not exist: the run did not finish (or this is not a run folder).") from None
    except (OSError, ValueError) as error:
        raise TextsqlError(f"{path} cannot be read as a run summary ({error}).") from None
    if not isinstance(values, dict):
        raise TextsqlError(f"{path} is not a run summary (a JSON object).")
    return RunSummary.from_dict(values, str(path))


def run_state(run_dir: str | Path) -> str:
    """'new', 'finished' (a run summary is there) or 'interrupted' (checkpoints but no summary)."""
    run_dir = Path(run_dir)
    if (run_dir / SUMMARY_FILE).exists():
        return "finished"
    if run_dir.is_dir() and any(p.name.startswith("checkpoint-") for p in run_dir.iterdir()):
        return "interrupted"
    return "new"


def accuracy_questions(summary: RunSummary) -> int | None:
    """How many validation questions the run's execution accuracy was measured on (in a summary older than the count,
    its --execution_accuracy_samples: the most it can have been)."""
    if summary.execution_accuracy_questions is not None:
        return summary.execution_accuracy_questions
    return (summary.arguments.get("data") or {}).get("execution_accuracy_samples")


def format_summary(summary: RunSummary) -> str:
    """A few lines for people: what ran, how fast, how well, how much memory per rank."""
    s = summary
    eval_loss = "none" if s.eval_loss is None else f"{s.eval_loss:.3f}"
    lines = [
        f"run            {s.run}  ({s.output_dir})",
        f"model          {s.model_id}  {s.parameters / 1e6:.2f}M parameters, {s.precision}{' + TF32' if s.tf32 else ''} on {s.device}, "
        f"saved in {s.saved_dtype}",
        f"strategy       {s.strategy_label}{_lora_text(s)}  world size {s.world_size}",
        f"steps          {s.global_step}  epochs {s.epochs:.2f}  runtime {s.train_runtime:.1f} s",
        f"throughput     {s.train_samples_per_second or 0:.1f} samples/s, {s.real_tokens_per_second or 0:.0f} real tokens/s",
        f"loss           first {s.first_logged_loss or 0:.3f} -> last {s.last_logged_loss or 0:.3f}; "
        f"train {s.train_loss or 0:.3f}, eval {eval_loss}",
    ]
    if s.execution_accuracy is not None:
        questions = accuracy_questions(s)
        lines.append(
            f"exec accuracy  {s.execution_accuracy:.1%} on the first {questions} validation questions, end of training"
        )
    if s.grpo:
        lines.append(format_grpo(s.grpo))
    for m in s.peak_memory_per_rank:
        gpu = (
            f", CUDA max allocated {m['cuda_max_allocated_bytes'] / GIB:.2f} GiB reserved {m['cuda_max_reserved_bytes'] / GIB:.2f} GiB"
            if "cuda_max_allocated_bytes" in m
            else ""
        )
        lines.append(
            f"rank {m['rank']:<9} {m['host']} {m['device']}: peak RSS {m['cpu_peak_rss_bytes'] / GIB:.2f} GiB{gpu}"
        )
    if s.memory_check:
        lines.append(format_comparison(s.memory_check))
    if s.mfu and s.mfu.get("tflops_per_gpu") is not None:
        if s.device == "cpu":  # no GPU and no peak to hold it against: the rate alone
            lines.append(f"model flops    {s.mfu['tflops_per_gpu']:.4g} TFLOPS per rank at the real lengths (CPU)")
        else:
            mfu = f"MFU {s.mfu['mfu']:.1%} of {s.mfu['peak']}" if s.mfu.get("mfu") is not None else s.mfu.get("peak")
            lines.append(f"model flops    {s.mfu['tflops_per_gpu']:.4g} TFLOPS per GPU at the real lengths; {mfu}")
    if s.flops_profile:
        lines.append(format_flops_profile(s.flops_profile))
    if s.comms_summary:
        lines.append(format_comms_summary(s.comms_summary))
    lines.append(f"tensorboard    textsql tensorboard --runs_root {Path(s.output_dir).parent}")
    return "\n".join(lines)


def format_grpo(grpo: dict) -> str:
    """The GRPO stage in one line: its parent, the reward's first and last logged mean, each reward's, KL, length."""
    parts = [f"grpo           from {grpo.get('parent_run') or 'a model that is no textsql run'}"]
    if "reward" in grpo:
        parts.append(f"reward {grpo['first_reward']:.3f} -> {grpo['reward']:.3f}")
        each = [f"{k.split('/')[1]} {v:.2f}" for k, v in grpo.items() if k.startswith("rewards/")]
        parts.append("(" + ", ".join(each) + ")")
        kl = f"KL {grpo['kl']:.4f}" if "kl" in grpo else "KL not computed (--beta 0)"
        parts.append(f"{kl}, completions {grpo.get('completions/mean_length', 0):.1f} tokens")
        # the execution-based share where recorded (schema 7); older summaries have the weighted reward's only
        zero = grpo.get("frac_execution_zero_std", grpo.get("frac_reward_zero_std", 0))
        parts.append(f"groups without signal {zero:.0%}")
    return "; ".join(parts[:1] + [" ".join(parts[1:])]) if len(parts) > 1 else parts[0]


def _lora_text(s: RunSummary) -> str:
    if not s.lora:
        return ""
    trainable = f", {s.trainable_parameters / 1e6:.3f}M trainable parameters" if s.trainable_parameters else ""
    base = f" on an {s.lora['quantize_base']} base (QLoRA)" if s.lora.get("quantize_base") else ""
    return f" + LoRA r={s.lora['rank']} alpha={s.lora['alpha']:g} on {s.lora['targets']}{base}{trainable}"


def format_flops_profile(profile: dict) -> str:
    """One line: the profiled step's FLOPs, latency, TFLOPS per GPU and MFU (or why there are none), and its table."""
    if not profile.get("profiled"):
        return f"flops profile  step {profile.get('step')} not profiled: {profile.get('reason')}"
    mfu = f"MFU {profile['mfu']:.1%} of {profile['peak']}" if profile.get("mfu") is not None else profile.get("peak")
    # Under ZeRO-3 the profiler counts what the rank holds whole (parameters below the persistence threshold) only.
    parameters = f", {profile['parameters']:,} parameters per GPU" if profile.get("parameters") else ""
    note = f" (note: {profile['note']})" if profile.get("note") else ""
    return (
        f"flops profile  step {profile['step']}: {profile['flops_per_step'] / 1e9:,.2f} GFLOPs and "
        f"{profile['macs_per_step'] / 1e9:,.2f} GMACs per GPU in {profile['step_latency_s'] * 1000:,.1f} ms "
        f"(forward {profile['forward_latency_s'] * 1000:,.1f} ms), {profile['tflops_per_gpu']:.4g} TFLOPS per GPU"
        f"{parameters}; {mfu}; per module: {profile.get('file')}{note}"
    )


def format_comms_summary(comms: dict) -> str:
    """One line: the collectives DeepSpeed ran, by count and total latency, and the file with the full table."""
    operations = comms.get("operations") or {}
    parts = [f"{name} {o['count']}x {o['total_latency_ms']:,.1f} ms" for name, o in sorted(operations.items())]
    return f"comms logger   {', '.join(parts) or 'no collectives logged'}; table: {comms.get('file')}"


def format_comparison(result: dict) -> str:
    """One line for the run summary: measured vs predicted GPU memory and the ratio, or why there is none."""
    if not result.get("comparable"):
        # A CPU run: the reason is the same every time, the prediction is not.
        if "measured_cpu_peak_rss_bytes" in result:
            return (
                f"memory check   on a GPU this setup would peak at {result['predicted_gpu_total_bytes'] / GIB:.2f} GB "
                "(the planner's prediction; a CPU run measures no GPU memory to hold it against)"
            )
        return f"memory check   not comparable: {result.get('reason')}"
    return (
        f"memory check   rank {result['measured_rank']} reserved {result['measured_reserved_bytes'] / GIB:.2f} GB, "
        f"planner predicted {result['predicted_reserved_bytes'] / GIB:.2f} GB (+ context: "
        f"{result['predicted_gpu_total_bytes'] / GIB:.2f} GB"
        + (f", peak in {result['predicted_peak_phase']}" if result.get("predicted_peak_phase") else "")
        + f"): measured/predicted {result['ratio']:.2f}"
    )
