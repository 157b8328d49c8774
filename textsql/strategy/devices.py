"""Where a training process runs and in which precision: every CPU/GPU decision of textsql, made from facts passed in.

The facts (which GPUs a node has, how many cores) are read once by `NodeDevices.local()`; every decision below takes
them as arguments, so a test can feed an A100, a V100, an H100 or "no GPU" and check the outcome.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from textsql.errors import TextsqlError
from textsql.families import Family
from textsql.hub import model_family

PRECISIONS = ("auto", "bf16", "fp32", "fp16")
DEVICE_CHOICES = ("auto", "cuda", "cpu")
# A pod's host memory in GB when nobody says: what textsql.cluster.Cluster asks CML for per worker pod unless told
# (`memory=`), and what `textsql plan` checks the host side against without --cpu_memory_gb (saying so).
DEFAULT_POD_MEMORY_GB = 16.0
AMPERE = (8, 0)  # native bf16 and TF32 matmuls from compute capability 8.0 (A100, A10, L4, H100, ...)
# The CPU instructions that compute bf16 natively (oneDNN uses them); without them torch emulates bf16, many times
# slower than fp32 (9.46x a layer on an AVX2-only EPYC: bench/results/2026-12-02-cpu-precision.json).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Overrides what the CPU's flags say (1: native bf16, 0: none), for runs that must compute the same on every machine
# (the test suite pins 0) or a CPU whose flags a virtual machine hides.
CPU_BF16_VARIABLE = "TEXTSQL_CPU_NATIVE_BF16"


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: its name and CUDA compute capability."""

    name: str
    capability: tuple[int, int]
    memory_bytes: int = 0

    @property
    def native_bf16(self) -> bool:
        # torch.cuda.is_bf16_supported() is True on a V100 or T4 too (emulated, slow): ask the architecture.
        return tuple(self.capability) >= AMPERE

    @property
    def tf32(self) -> bool:
        return tuple(self.capability) >= AMPERE


# Cards that tests and docs name; capability and memory as NVIDIA documents them.
A100_40GB = Gpu("NVIDIA A100-PCIE-40GB", (8, 0), 40 * 2**30)
H100_SXM = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30)
V100 = Gpu("Tesla V100-SXM2-16GB", (7, 0), 16 * 2**30)
T4 = Gpu("Tesla T4", (7, 5), 15 * 2**30)


@dataclass(frozen=True)
class NodeDevices:
    """What one node (pod) offers a training run: its visible GPUs (none on a CPU-only node), its CPU cores and whether
    the CPU computes bf16 natively (AVX512-BF16 or AMX)."""

    gpus: tuple[Gpu, ...] = ()
    cpu_cores: int = 1
    cpu_native_bf16: bool = False

    @property
    def accelerator(self) -> str:
        return "cuda" if self.gpus else "cpu"

    def describe(self) -> str:
        if not self.gpus:
            return f"no GPU, {self.cpu_cores} CPU cores" + (" with native bf16" if self.cpu_native_bf16 else "")
        names = sorted({gpu.name for gpu in self.gpus})
        return f"{len(self.gpus)} x {' + '.join(names)}, {self.cpu_cores} CPU cores"

    def as_dict(self) -> dict:
        return {
            "gpus": [
                {"name": g.name, "capability": list(g.capability), "memory_bytes": g.memory_bytes} for g in self.gpus
            ],
            "cpu_cores": self.cpu_cores,
            "cpu_native_bf16": self.cpu_native_bf16,
        }

    @classmethod
    def from_dict(cls, data: dict) -> NodeDevices:
        gpus = tuple(
            Gpu(g["name"], tuple(g["capability"]), int(g.get("memory_bytes", 0))) for g in data.get("gpus", ())
        )
        return cls(
            gpus=gpus, cpu_cores=int(data.get("cpu_cores", 1)), cpu_native_bf16=bool(data.get("cpu_native_bf16", False))
        )

    @classmethod
    def local(cls) -> NodeDevices:
        """This machine's GPUs as torch sees them (CUDA_VISIBLE_DEVICES respected) and the cores this process may use."""
        import torch

        gpus = []
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                gpus.append(Gpu(props.name, (props.major, props.minor), int(props.total_memory)))
        return cls(gpus=tuple(gpus), cpu_cores=usable_cores(), cpu_native_bf16=cpu_native_bf16())

    @classmethod
    def local_cpu(cls) -> NodeDevices:
        """This machine's CPU alone (a run told --accelerator cpu), asking nothing of CUDA."""
        return cls((), usable_cores(), cpu_native_bf16=cpu_native_bf16())


DEVICES_ANSWER = "textsql-devices: "


def local_devices(isolated: bool | None = None) -> NodeDevices:
    """This machine's NodeDevices. On a machine with an NVIDIA driver they are asked in a short-lived child process: a
    long-lived process (an agent, the notebook kernel, the parent of the ranks) that asked torch itself would keep CUDA
    initialised there, holding GPU memory the ranks need. Elsewhere asking torch here costs nothing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if not (Path("/dev/nvidiactl").exists() if isolated is None else isolated):
        return NodeDevices.local()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from textsql.strategy.devices import NodeDevices; "
            f"print({DEVICES_ANSWER!r} + json.dumps(NodeDevices.local().as_dict()))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = [line for line in done.stdout.splitlines() if line.startswith(DEVICES_ANSWER)]
    if not found:
        raise RuntimeError((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
    return NodeDevices.from_dict(json.loads(found[-1].removeprefix(DEVICES_ANSWER)))


def cpu_native_bf16(environ=os.environ, cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively: its flags (/proc/cpuinfo) name AVX512-BF16 or AMX-BF16, unless
    TEXTSQL_CPU_NATIVE_BF16 (0 or 1) says otherwise."""
    pinned = environ.get(CPU_BF16_VARIABLE, "").strip()
    if pinned:
        if pinned not in ("0", "1"):
            raise TextsqlError(f"{CPU_BF16_VARIABLE} is 0 or 1 (or unset, to read the CPU's flags), not '{pinned}'.")
        return pinned == "1"
    if cpuinfo is None:
        try:
            cpuinfo = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
        except OSError:  # not Linux: no flags to read, so no bf16 that auto would choose
            return False
    return has_native_bf16_flags(cpuinfo)


def has_native_bf16_flags(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text (or any text of its `flags` lines) names an instruction set that computes bf16."""
    flags = {
        flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[-1].split()
    }
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------------------------------
# Which device
# ---------------------------------------------------------------------------------------------------------------------


def choose_accelerator(requested: str, devices: NodeDevices) -> str:
    """'cuda' or 'cpu' for `--accelerator auto|cuda|cpu` on a node with these devices; cuda without a GPU is an error."""
    if requested not in DEVICE_CHOICES:
        raise TextsqlError(f"--accelerator must be one of {', '.join(DEVICE_CHOICES)}, not '{requested}'.")
    if requested == "cuda" and not devices.gpus:
        raise TextsqlError(
            "GPUs were asked for (--accelerator cuda), but this process sees none: torch.cuda.is_available() is False"
            + (
                f" with CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
                if "CUDA_VISIBLE_DEVICES" in os.environ
                else ""
            )
            + ". Check the pod's GPU request (nvidia_gpu) and the driver (nvidia-smi), or pass --accelerator cpu to train on the CPU."
        )
    if requested == "auto":
        return devices.accelerator
    return requested


def use_accelerator(accelerator: str, environ=os.environ) -> None:
    """Tell DeepSpeed which accelerator this process uses, before it is imported (it caches its choice)."""
    if accelerator == "cpu":
        environ["DS_ACCELERATOR"] = "cpu"
    elif environ.get("DS_ACCELERATOR") == "cpu":
        raise TextsqlError(
            "DS_ACCELERATOR=cpu is set, but this process trains on the GPU. Unset DS_ACCELERATOR, or pass --accelerator cpu."
        )


def prepare_deepspeed_import(environ=os.environ) -> None:
    """DeepSpeed picks its accelerator when first imported: in a process that only reads configs (check-config, plan),
    the CPU where there is no CUDA, unless a training decision (use_accelerator) or the user set one already."""
    if "DS_ACCELERATOR" not in environ:
        import torch

        if not torch.cuda.is_available():
            environ["DS_ACCELERATOR"] = "cpu"


def ranks_per_node(requested: int | None, devices: NodeDevices) -> int:
    """Training processes on one node: one per visible GPU unless asked otherwise (never nn.DataParallel); 1 on a CPU."""
    available = len(devices.gpus)
    if requested is None:
        return max(1, available)
    if requested < 1:
        raise TextsqlError(f"The number of processes per node must be at least 1, not {requested}.")
    if available and requested > available:
        raise TextsqlError(
            f"{requested} processes per node were asked for, but this node has {available} GPU(s) visible "
            f"({devices.describe()}). Ask for at most {available}, or make more GPUs visible."
        )
    return requested


def threads_per_rank(devices: NodeDevices, ranks: int) -> int:
    """OpenMP threads for each of `ranks` processes on a node: its share of the cores (ZeRO offload's CPU Adam uses them)."""
    return max(1, devices.cpu_cores // max(1, ranks))


def launcher_device_args(ranks: int, devices: NodeDevices, visible_devices: str | None) -> list[str]:
    """The `deepspeed` launcher's device selection for `ranks` processes on this node.

    A user's CUDA_VISIBLE_DEVICES is kept: the launcher reads it only when no --num_gpus/--include is given (and
    --num_gpus would delete it), so with it set we name the first `ranks` of those devices with --include.
    """
    if visible_devices and devices.gpus:
        return ["--include", "localhost:" + ",".join(map(str, node_gpu_ids(ranks, devices, visible_devices)))]
    return ["--num_gpus", str(ranks)]


# ---------------------------------------------------------------------------------------------------------------------
# Which precision
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionChoice:
    """What a run computes in: the mixed-precision dtype (or fp32) and whether fp32 matmuls may use TF32."""

    name: str
    tf32: bool
    reason: str = field(default="", compare=False)

    def trainer_flags(self) -> dict[str, bool]:
        """Seq2SeqTrainingArguments values; tf32=False makes the Trainer switch TF32 off where it could be on."""
        return {"bf16": self.name == "bf16", "fp16": self.name == "fp16", "tf32": self.tf32}


def resolve_precision(
    requested: str,
    model_id: str,
    gpus: tuple[Gpu, ...] | list[Gpu],
    *,
    force_fp16: bool = False,
    cpu_native_bf16: bool = False,
) -> PrecisionChoice:
    """choose_precision for the model `model_id` (hub id or folder): its family is read from its config.json only
    where the choice depends on it (fp16 asked for without --force_fp16), so other runs read nothing."""
    family = None
    if requested == "fp16" and not force_fp16:
        family = model_family(model_id)
    return choose_precision(requested, gpus, family=family, force_fp16=force_fp16, cpu_native_bf16=cpu_native_bf16)


def choose_precision(
    requested: str,
    gpus: tuple[Gpu, ...] | list[Gpu],
    *,
    family: Family | None = None,
    force_fp16: bool = False,
    cpu_native_bf16: bool = False,
) -> PrecisionChoice:
    """The precision for a run on these GPUs (every GPU of every node; none on a CPU) of a model of `family`
    (textsql.families; needed only for fp16, which the family may refuse: `Family.fp16_safe`); `cpu_native_bf16`:
    whether the CPU a GPU-less run computes on has AVX512-BF16 or AMX (NodeDevices.cpu_native_bf16).

    auto: bf16 where every GPU has native bf16 (Ampere and newer), or, without a GPU, where the CPU computes bf16
    natively; fp32 otherwise (V100, T4, a CPU without those instructions, where bf16 is emulated and many times
    slower). TF32 is used for the remaining fp32 matmuls only with bf16 on Ampere and newer; fp32 means true fp32.
    """
    if requested not in PRECISIONS:
        raise TextsqlError(f"--precision must be one of {', '.join(PRECISIONS)}, not '{requested}'.")
    gpus = tuple(gpus)
    native = bool(gpus) and all(gpu.native_bf16 for gpu in gpus)
    if requested == "auto":
        if native:
            return PrecisionChoice("bf16", True, "auto: every GPU has native bf16 (compute capability 8.0 or newer)")
        if not gpus and cpu_native_bf16:
            return PrecisionChoice("bf16", False, "auto: no GPU; the CPU computes bf16 natively (AVX512-BF16 or AMX)")
        if not gpus:
            return PrecisionChoice(
                "fp32", False, "auto: no GPU, and the CPU has no native bf16 (no AVX512-BF16 or AMX: emulated, slow)"
            )
        return PrecisionChoice("fp32", False, f"auto: {_older(gpus)} has no native bf16 (needs compute capability 8.0)")
    if requested == "fp16":
        if not force_fp16:
            if family is None:
                raise ValueError("choose_precision needs the model's family to decide fp16")
            if not family.fp16_safe:
                raise TextsqlError(
                    f"fp16 is refused for {family.name.upper()} models: {family.fp16_reason}. Use --precision bf16 "
                    "(Ampere or newer GPUs) or fp32, or pass --force_fp16 True to try anyway."
                )
        if not gpus:
            raise TextsqlError("fp16 mixed precision needs a GPU; use --precision fp32 (or auto) on the CPU.")
        return PrecisionChoice("fp16", False, "asked for fp16")
    if requested == "bf16":
        if gpus and not native:
            raise TextsqlError(
                f"--precision bf16 needs native bf16, and {_older(gpus)} has none (compute capability "
                f"{'.'.join(map(str, _oldest(gpus).capability))}; bf16 needs 8.0, Ampere or newer): it would be emulated, "
                "many times slower. Use --precision fp32 (or auto) on this GPU."
            )
        # On the CPU, bf16 autocast runs (natively on CPUs with AVX512-BF16/AMX, emulated elsewhere).
        if gpus:
            return PrecisionChoice("bf16", native, "asked for bf16")
        where = "natively" if cpu_native_bf16 else "emulated: no AVX512-BF16 or AMX, many times slower than fp32"
        return PrecisionChoice("bf16", False, f"asked for bf16 on the CPU ({where})")
    return PrecisionChoice("fp32", False, "asked for fp32 (true fp32 matmuls, no TF32)")


def precision_from_trainer_flags(precision: str, bf16: bool | None, fp16: bool | None) -> str:
    """Fold the Trainer's own --bf16/--fp16 flags into --precision, so that both go through `resolve_precision`."""
    flagged = [name for name, on in (("bf16", bf16), ("fp16", fp16)) if on]
    if len(flagged) > 1:
        raise TextsqlError(
            "--bf16 True and --fp16 True were both given; pass one --precision (bf16, fp32 or fp16) instead."
        )
    if not flagged:
        return precision
    if precision not in ("auto", flagged[0]):
        raise TextsqlError(f"--{flagged[0]} True contradicts --precision {precision}; pass only --precision.")
    return flagged[0]


@dataclass(frozen=True)
class RunDevices:
    """What a run with given flags gets on a pod: the device, its ranks there and the precision it trains in."""

    accelerator: str  # cuda or cpu
    ranks: int
    precision: PrecisionChoice


def resolve_run_devices(
    training, model_id: str, devices: NodeDevices, *, ranks_asked: int | None = None, accelerator: str | None = None
) -> RunDevices:
    """The one decision of device, ranks per pod and precision, for `textsql train` (train.run.set_up_run), a cluster's
    launch (cluster.launch) and tune's candidates alike: `training` is textsql train's arguments (their --accelerator,
    --precision, --force_fp16 and the Trainer's --bf16/--fp16), `devices` what the pod has, `ranks_asked` the ranks
    the caller starts there (None: one per GPU it uses, one on the CPU), `accelerator` where the caller's own flag
    asks instead of training's."""
    accelerator = choose_accelerator(training.accelerator if accelerator is None else accelerator, devices)
    gpus = devices.gpus if accelerator == "cuda" else ()
    ranks = ranks_per_node(ranks_asked, NodeDevices(gpus, devices.cpu_cores))
    requested = precision_from_trainer_flags(training.precision, training.bf16, training.fp16)
    precision = resolve_precision(
        requested,
        model_id,
        gpus,
        force_fp16=training.force_fp16,
        cpu_native_bf16=accelerator == "cpu" and devices.cpu_native_bf16,
    )
    return RunDevices(accelerator, ranks, precision)


def inference_dtype(requested: str, device_type: str, devices: NodeDevices | None = None) -> str:
    """The weights' dtype (torch's name) a scoring uses for `--dtype auto|float32|bfloat16` on a "cuda" or "cpu"
    device: auto is bfloat16 where training's auto would pick bf16 there (native bf16), else float32."""
    if requested != "auto":
        return requested
    devices = (
        devices if devices is not None else (NodeDevices.local() if device_type == "cuda" else NodeDevices.local_cpu())
    )
    gpus = devices.gpus if device_type == "cuda" else ()
    chosen = choose_precision("auto", gpus, cpu_native_bf16=device_type == "cpu" and devices.cpu_native_bf16)
    return "bfloat16" if chosen.name == "bf16" else "float32"


def quantized_compute_dtype(gpus: tuple[Gpu, ...]) -> str:
    """The dtype a quantized (bitsandbytes) base computes in, by torch's name: bfloat16 where every GPU has native bf16
    (Ampere and newer), float32 on older GPUs and on the CPU. Never float16: its range overflows (T5, large
    activations), and the LoRA update added to an fp16 product loses its small values."""
    return "bfloat16" if gpus and all(gpu.native_bf16 for gpu in gpus) else "float32"


def _oldest(gpus: tuple[Gpu, ...]) -> Gpu:
    return min(gpus, key=lambda gpu: tuple(gpu.capability))


def _older(gpus: tuple[Gpu, ...]) -> str:
    return _oldest(gpus).name


# ---------------------------------------------------------------------------------------------------------------------
# Several nodes
# ---------------------------------------------------------------------------------------------------------------------


def check_nodes_agree(nodes: dict[str, NodeDevices], slots: dict[str, int] | None = None) -> str:
    """The accelerator every node trains on; refuses a cluster whose nodes disagree, naming the node.

    Disagreeing means GPUs on some nodes and none on others, or native bf16 on some and not on others (one precision
    must serve every rank). With `slots`, a GPU node must have at least as many GPUs as the ranks it runs.
    """
    if not nodes:
        raise TextsqlError("No nodes to train on.")
    names = list(nodes)
    first = names[0]
    problems = []
    for name in names[1:]:
        a, b = nodes[first], nodes[name]
        if bool(a.gpus) != bool(b.gpus):
            problems.append(
                f"{name} has {b.describe()}, but node 0 ({first}) has {a.describe()}: every node must have GPUs, or none"
            )
        elif a.gpus and _bf16_kinds(a) != _bf16_kinds(b):
            problems.append(
                f"{name} has {b.describe()}, but node 0 ({first}) has {a.describe()}: native bf16 on some GPUs and not on "
                "others, so no one precision suits every rank"
            )
    for name, node in nodes.items():
        wanted = (slots or {}).get(name, 0)
        if node.gpus and wanted > len(node.gpus):
            problems.append(f"{name} runs {wanted} rank(s) but has {len(node.gpus)} GPU(s)")
    if problems:
        raise TextsqlError("The nodes do not agree on how to train:\n" + "\n".join(f"  {p}" for p in problems))
    return nodes[first].accelerator


def _bf16_kinds(node: NodeDevices) -> set[bool]:
    return {gpu.native_bf16 for gpu in node.gpus}


def all_gpus(nodes: dict[str, NodeDevices]) -> tuple[Gpu, ...]:
    return tuple(gpu for node in nodes.values() for gpu in node.gpus)


# ---------------------------------------------------------------------------------------------------------------------
# Peak throughput, for model FLOPs utilisation
# ---------------------------------------------------------------------------------------------------------------------

# Dense (no sparsity) tensor-core peaks in TFLOPS from NVIDIA's data sheets: (bf16, TF32, plain FP32). The form factor
# matters: an H100 PCIe or NVL card runs at lower clocks and power than the SXM part. Matched on torch's device name,
# most specific first ("H100 NVL" before "H100", "A100" before "A10"). None where the card has no such unit.
GPU_PEAK_TFLOPS = (
    ("H100 NVL", (835.0, 417.5, 60.0)),
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H200 NVL", (835.0, 417.5, 60.0)),
    ("H100", (989.0, 494.5, 67.0)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", (989.0, 494.5, 67.0)),  # SXM
    ("A100", (312.0, 156.0, 19.5)),  # SXM and PCIe alike
    ("L40S", (362.0, 183.0, 91.6)),
    ("A10", (125.0, 62.5, 31.2)),
    ("L4", (121.0, 60.0, 30.3)),
    ("V100", (None, None, 15.7)),
    ("T4", (None, None, 8.1)),
)


@dataclass(frozen=True)
class PeakTflops:
    """A GPU's dense peaks and where they come from."""

    gpu: str
    bf16: float | None
    tf32: float | None
    fp32: float
    source: str

    def for_precision(self, precision: str, tf32: bool) -> tuple[float | None, str]:
        """(the peak a run in this precision could reach, its name): bf16 tensor cores, TF32 ones, or plain FP32."""
        if precision in ("bf16", "fp16"):
            return self.bf16, "bf16 dense"
        if tf32 and self.tf32:
            return self.tf32, "TF32 dense"
        return self.fp32, "FP32"


def peak_tflops(gpu_name: str | None, bf16_override: float | None = None) -> PeakTflops | None:
    """The peaks of a GPU by its torch name; with `bf16_override` (a card not in the table), that bf16 peak alone."""
    if bf16_override:
        return PeakTflops(gpu_name or "?", bf16_override, None, bf16_override, "given (--peak_tflops)")
    for key, (bf16, tf32, fp32) in GPU_PEAK_TFLOPS:
        if gpu_name and key in gpu_name:
            return PeakTflops(gpu_name, bf16, tf32, fp32, f"NVIDIA data sheet ({key}, dense)")
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Which GPUs each node's ranks use
# ---------------------------------------------------------------------------------------------------------------------


def visible_gpu_ids(visible_devices: str | None, count: int) -> list[int]:
    """The physical indices of the GPUs a process sees: CUDA_VISIBLE_DEVICES's list, else 0..count-1.

    DeepSpeed's node launcher sets CUDA_VISIBLE_DEVICES itself from integer slot ids, so GPUs named by UUID cannot be
    handed to it."""
    if not visible_devices:
        return list(range(count))
    ids = [part.strip() for part in visible_devices.split(",") if part.strip()]
    if not all(part.isascii() and part.isdigit() for part in ids):
        raise TextsqlError(
            f"CUDA_VISIBLE_DEVICES={visible_devices!r} names GPUs by UUID; DeepSpeed's launcher needs their indices "
            "(e.g. CUDA_VISIBLE_DEVICES=0,1). Use `nvidia-smi -L` to find them."
        )
    return [int(part) for part in ids]


def node_gpu_ids(ranks: int, devices: NodeDevices, visible_devices: str | None) -> list[int] | None:
    """The GPU ids a node's `ranks` processes get (the first `ranks` it sees), or None on a CPU node."""
    if not devices.gpus:
        return None
    return visible_gpu_ids(visible_devices, len(devices.gpus))[:ranks]


def split_local_gpus(ranks_per_node: list[int], devices: NodeDevices, visible_devices: str | None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of several nodes run on one machine (the local backend): each node its own GPUs,
    in order, from those this process sees. None for every node of a machine without GPUs."""
    if not devices.gpus:
        return [None] * len(ranks_per_node)
    ids = visible_gpu_ids(visible_devices, len(devices.gpus))
    if sum(ranks_per_node) > len(ids):
        raise TextsqlError(
            f"{len(ranks_per_node)} local nodes with {'+'.join(map(str, ranks_per_node))} ranks need {sum(ranks_per_node)} GPUs, "
            f"but this machine has {len(ids)} visible ({devices.describe()}). Use fewer workers or fewer GPUs per worker."
        )
    shares, start = [], 0
    for ranks in ranks_per_node:
        shares.append(",".join(map(str, ids[start : start + ranks])))
        start += ranks
    return shares


def split_local_cores(cores: list[int], nodes: int) -> list[list[int]]:
    """The CPU cores each of `nodes` nodes on one machine may use: disjoint equal shares, or shared round-robin when
    there are fewer cores than nodes. Each node then gives its ranks threads_per_rank() of its share."""
    cores = sorted(cores)
    if nodes <= 0:
        return []
    if len(cores) < nodes:
        return [[cores[i % len(cores)]] for i in range(nodes)]
    size = len(cores) // nodes
    return [cores[i * size : (i + 1) * size] for i in range(nodes)]
