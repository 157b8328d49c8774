"""The plan: every strategy's peak per pod for `textsql plan`'s arguments, the fastest that fits with its largest batch,
LoRA and QLoRA where full fine-tuning does not fit, and the assumptions behind the numbers."""

from __future__ import annotations

from dataclasses import asdict, replace

from textsql.arguments.plan import PlanArguments
from textsql.arguments.speed import SpeedArguments
from textsql.planner.phases import (
    ALLOCATOR_OVERHEAD_FRACTION,
    CUDA_CONTEXT_BYTES,
    NCCL_BUFFER_BYTES,
    predict_strategy,
)
from textsql.planner.shape import (
    GIB,
    ModelShape,
    resolve_model,
)
from textsql.planner.states import (
    OFFLOAD_CALIBRATION,
    Setup,
    lora_layers,
    quantized_base,
    read_dsconfig,
    setup_from_arguments,
    zero_settings,
)
from textsql.strategy.devices import DEFAULT_POD_MEMORY_GB
from textsql.strategy.dsconfig import describe_strategy
from textsql.strategy.table import DEEPSPEED_STRATEGIES, FSDP_STRATEGIES, NVME_STRATEGIES, STRATEGIES, STRATEGY_LAYOUT

MAX_BATCH_SEARCHED = 4096


ASSUMPTIONS = [
    "GB = 2**30 bytes. The GPU figure is what nvidia-smi shows at the peak: torch's reserved memory plus the CUDA "
    "context and NCCL buffers.",
    "Model states (parameters + gradients + optimizer states) equal DeepSpeed's estimate_zero2/zero3_model_states_mem_"
    "needs for ZeRO-2/3 in bf16/fp16 (2-byte parameters and gradients, fp32 master weights and Adam moments). In fp32 "
    "every 2-byte copy is 4 bytes (ZeRO-2: 4P + 20P/N instead of 2P + 18P/N). ZeRO-1 keeps full gradients "
    "(its own formula: 2P + 2P + 16P/N). No DeepSpeed: fp32 weights, fp32 gradients and two fp32 Adam moments (16P) "
    "whatever the precision (autocast), plus DDP's gradient buckets (4P) on more than one GPU.",
    "Weight copies beyond the model states. ZeRO-3: the parameters gathered on the GPU at the peak, in the training "
    "dtype (4 bytes in fp32), less the largest layer the estimator already counts, plus the persistent parameters "
    "(each at most stage3_param_persistence_threshold elements, kept on every GPU). The gathered figure replays "
    "DeepSpeed 0.19.8's PartitionedParameterCoordinator on the model's module trace (recorded on a narrow copy of the model) with "
    "the dsconfig's stage3_prefetch_bucket_size, stage3_max_live_parameters and stage3_max_reuse_distance: with "
    "prefetching on, it keeps up to about stage3_max_live_parameters gathered (1e9 in common configs: all of t5-large). "
    "No DeepSpeed in bf16/fp16: autocast's 16-bit copy of every matmul weight (2 bytes per parameter), kept for the "
    "backward pass.",
    "Gradients are counted as coexisting with the activations and the gathered parameters (conservative); the "
    "optimizer step's temporaries are not counted: the Trainer's default fused AdamW has none (the older foreach AdamW "
    "allocated 4 bytes per parameter once the activations were freed).",
    "Activations: every tensor the model saves for the backward pass (attention scores, softmax in fp32, dropout masks, "
    "feed-forward hidden states, layer norms), for the longest batch (batch x max lengths), plus the loss over the "
    "vocabulary (log-softmax output, its gradient and the logits' gradient). With gradient checkpointing only each "
    "block's input is kept, plus one block recomputed at a time.",
    "Buckets: ZeRO-1/2 reduce buffers (reduce_bucket_size elements of the gradient type; two with overlap_comm) and, "
    "with optimizer offload, a staging buffer the size of the largest parameter. ZeRO-3: the reduce buffer and "
    "reduce-scatter's copy of it; without optimizer offload the fp32 gradient buffer of the largest optimizer "
    "sub-group (sub_group_size) beyond the 2P/N the estimator counts; with it, a staging copy of a gradient partition.",
    "CPU offload (zero2_offload, zero3_offload): what DeepSpeed keeps on the GPU besides the model states (the "
    "staging buffer, two fp32 copies of the largest gradient on their way to the host, the gradients awaiting that "
    "copy) was calibrated on the GPU check's H200 rows (t5-small's shape, bf16, batch 32): measured / predicted "
    + ", ".join(f"{before:.2f} -> {after:.2f} ({name})" for name, (before, after) in OFFLOAD_CALIBRATION.items())
    + ". The residual: these rows still under-predict that run by up to "
    f"{max(after for _, after in OFFLOAD_CALIBRATION.values()) - 1:.0%} (one model size measured, one GPU); the "
    "gradients awaiting their copy are a bound that larger models, whose copies keep pace with the backward pass, do "
    "not reach.",
    f"Overhead: {CUDA_CONTEXT_BYTES / GIB:.2f} GB CUDA context and {NCCL_BUFFER_BYTES / GIB:.2f} GB NCCL buffers with "
    f"more than one GPU (both measured on an H200; NCCL's grow with the peers), and {ALLOCATOR_OVERHEAD_FRACTION:.0%} of "
    "the allocated memory for the caching allocator (sources in textsql/planner/phases.py).",
    "CPU per node: DeepSpeed's host estimate for the model states (zero.Init with ZeRO-3, as textsql trains) plus "
    "3 GB per training process for Python, libraries and data.",
    "ZeRO-Infinity (zero3_nvme): the GPU holds what it holds under zero3_offload. The host holds the pinned swap "
    "buffers (offload_optimizer.buffer_count x the largest optimizer sub-group partition in fp32; offload_param."
    "buffer_count x buffer_size in the training dtype) and the fp32 gradient partitions (4 bytes per trainable "
    "parameter / N), plus 3 GB per process. The disk (--nvme_path) holds each rank's 16-bit parameter partition and "
    "fp32 master weights and Adam moments (2 or 4 + 12 bytes per parameter / N). Per step the parameters are read in "
    "the forward and the backward pass and written after the update, and the optimizer states are read and written: "
    "(3 x 2 or 4 + 24) bytes per parameter / N; the time that takes at --nvme_gb_per_s (default 2 GB/s per pod, one "
    "PCIe NVMe drive: an assumption, measure yours with DeepSpeed's ds_nvme_tune) is a lower bound on a step.",
    "FSDP2 (fully_shard): parameters, gradients and Adam moments sharded in fp32 (4 + 4 + 8 bytes per parameter / N, "
    "N the GPUs a parameter is sharded over: all of them, or one pod's with hybrid sharding), on the host with "
    "offload. Weight copies: the gathered units in the compute dtype: T5's tied embeddings (one unit, kept gathered "
    "through the step), two T5 blocks at a time (the one computing and the one prefetched) with full sharding, every "
    "block after the forward pass with shard-grad-op. Buckets: the largest unit's unsharded gradient and its fp32 "
    "copy for the reduce-scatter. Activations as DeepSpeed's (the module itself computes in bf16). Not yet calibrated "
    "on a GPU.",
]


ASSUMPTIONS.append(
    "Phases: a pod's peak is the largest of the training step, evaluation, checkpoint save and final save. Between "
    "steps the activations are freed, and PyTorch's and FSDP's gradients (DeepSpeed keeps its gradient partitions; "
    "ZeRO-3's gathered parameters are counted whole). Evaluation adds the eval loss's forward pass over the "
    "vocabulary or, when it generates SQL, generate()'s caches: eval batch x beams rows of encoder output, "
    "cross-attention and self-attention keys and values of every decoder layer, and fp32 scores. Checkpoint save "
    "adds host memory: rank 0's whole model (ZeRO-3 gathers it in the training dtype; else safetensors copies the "
    "GPU tensors) and torch.save's copy of a GPU optimizer partition. The final fp32 save adds the full fp32 copy "
    "of the largest parameter on the GPU (DeepSpeed, FSDP) and every rank's fp32 state dict on the host (rank 0's "
    "alone under FSDP; the adapter alone with LoRA).",
)


LORA_ASSUMPTIONS = [
    "LoRA rows (--lora True): the base model is frozen and held in the training dtype under DeepSpeed (DeepSpeed casts "
    "the whole module; fp32 without DeepSpeed, as textsql loads it), partitioned under ZeRO-3 like any parameter. "
    "Gradients, fp32 master weights and Adam moments exist for the trainable parameters only: r x (in + out) for each "
    "adapted nn.Linear (plus 2 x d_model per character prep added, not counted here: a few thousand parameters). "
    "Activations: the full fine-tuning ones (the frozen layers still pass gradients back), plus, per adapted layer and "
    "token, the adapter's input after dropout with its mask and its r-wide hidden state. With CPU offload the optimizer "
    "states live in host memory, so there LoRA saves host memory, not GPU memory.",
]


CAUSAL_ASSUMPTIONS = [
    "Causal LM: prompt and SQL are one sequence of max_source_length + max_target_length tokens through one stack of "
    "decoder layers; the widths are the config's as its family reads them (textsql.families), the parameter count "
    "the model's own built on the meta device. Activations per layer and token: two norms (fp32 input, output), the "
    "attention's query, keys, values, output and its copy for the output projection (sdpa; transformers repeats "
    "grouped-query keys and values to every query head when the batch is padded, so GQA/MQA shrink the KV cache of "
    "generation, not the training step's saved keys and values), with eager attention (bloom, codegen) the fp32 "
    "softmax and probabilities over the sequence, and the feed-forward hidden states (4 x the feed-forward width "
    "where gated). The logits term: every position's logits upcast to fp32 by transformers' loss, 12 bytes (+2 in "
    "bf16) per position and vocabulary entry at the backward pass's start. Dropout masks are not counted (0 in most "
    "causal configs; gpt2 and opt use 0.1).",
]


QLORA_ASSUMPTIONS = [
    "QLoRA rows (--quantize_base): bitsandbytes quantizes every nn.Linear (and Conv1D) but the output layer. NF4 "
    "with double quantization: 4 bits per weight, a uint8 absmax per block of 64 and an fp32 absmax per 256 blocks "
    "(4.13 bits per weight), plus an fp32 offset and the 16- and 256-entry codes per tensor; int8: 1 byte per weight "
    "plus an fp32 scale per output row. Everything else (embeddings, norms, biases, the output layer) in fp32, as "
    "peft's prepare_model_for_kbit_training casts it. Weight copies: one weight dequantized in the compute dtype "
    "while its layer runs. The adapter, its gradients and Adam states as for LoRA. Host memory: no copy of the model "
    "(bitsandbytes quantizes each weight as it loads it onto the GPU), the 3 GB per process. Falcon's FalconLinear layers are "
    "not swapped by transformers' bitsandbytes integration; the plan assumes they are (textsql train checks it).",
]


def plan_memory(args: PlanArguments) -> dict:
    """Predict every strategy's peak memory per pod and recommend the fastest that fits, with its largest batch (JSON-able).
    Without a host memory (--cpu_memory_gb) a worker pod's default is assumed, and the plan's inputs say so."""
    limits = _limits(args)
    args, host_assumed = with_host_memory(args)
    shape = resolve_model(args.model_id)
    dsconfig = read_dsconfig(args.deepspeed) if args.deepspeed else None
    settings = zero_settings(dsconfig)
    # the run the flags describe; full fine-tuning's rows first, LoRA's and QLoRA's beside them (_add_lora)
    setup = replace(plan_setup(args, settings), lora_rank=0, lora_targets="qv", quantize_base="none")
    strategies = {}
    for name in STRATEGIES:
        row = predict_strategy(shape, setup, name, args.per_device_train_batch_size)
        strategies[name] = _with_verdict(row, limits, args.gpu_memory_gb, args.cpu_memory_gb)
    plan = {
        "model": shape.as_dict(),
        "inputs": {k: v for k, v in asdict(args).items() if k != "json"}
        | {"world_size": setup.gpus, "cpu_memory_assumed": host_assumed},
        "dsconfig_strategy": _dsconfig_label(dsconfig),
        "zero_settings": {k: v for k, v in settings.items() if k != "shipped"},
        "zero_settings_source": args.deepspeed or "shipped dsconfig/ files",
        "strategies": strategies,
        "assumptions": ASSUMPTIONS,
    }
    plan["recommendation"], plan["problem"] = _recommend(shape, setup, args, strategies, limits)
    if args.lora:
        _add_lora(plan, shape, setup, args, limits)
    if args.lora and args.quantize_base != "none":
        _add_lora(plan, shape, setup, args, limits, quantize=args.quantize_base)
    if shape.causal:
        plan["assumptions"] = plan["assumptions"] + CAUSAL_ASSUMPTIONS
    if plan["recommendation"] is not None:
        plan["recommendation"]["command"] = train_command(args, plan["recommendation"])
    return plan


def plan_setup(args: PlanArguments, settings: dict) -> Setup:
    """The Setup `textsql plan` predicts with: its flags as textsql train's (planner.states.setup_from_arguments)."""
    return setup_from_arguments(
        args,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        source_length=args.max_source_length,
        target_length=args.max_target_length,
        precision=args.precision,
        settings=settings,
        nvme_gb_per_s=args.nvme_gb_per_s,
    )


def train_command(args: PlanArguments, recommendation: dict) -> str:
    """The `textsql train` command line of a recommendation, whole: the model, the dataset, the batch, the strategy,
    the adapter and the precision (on several pods, what every pod runs through `textsql cluster`)."""
    strategy = recommendation["strategy"]
    words = ["textsql", "train", "--model_id", args.model_id, "--dataset_dir", args.dataset_dir]
    words += ["--per_device_train_batch_size", str(recommendation["per_device_train_batch_size"])]
    if strategy in FSDP_STRATEGIES:
        words += ["--fsdp_config", strategy]
    elif strategy != "none":
        words += ["--deepspeed", strategy] + (["--nvme_path", "DIR"] if strategy in NVME_STRATEGIES else [])
    if recommendation.get("lora"):
        words += ["--lora", "True", "--lora_rank", str(args.lora_rank), "--lora_targets", args.lora_targets]
        if recommendation.get("quantize_base", "none") != "none":
            words += ["--quantize_base", recommendation["quantize_base"]]
    words += ["--precision", args.precision]
    for name in ("fused_loss", "lora_base_dtype"):  # the speed levers the plan was made with
        if getattr(args, name) != getattr(SpeedArguments, name) and (
            name != "lora_base_dtype" or recommendation.get("lora")
        ):
            words += [f"--{name}", getattr(args, name)]
    if args.activation_checkpointing:
        words += ["--activation_checkpointing", "True"]
    return " ".join(words)


def under(strategy: str) -> str:
    """ "under <strategy>" as a sentence reads it: "under none" alone would read as "nowhere"."""
    return "with no DeepSpeed (none)" if strategy == "none" else f"under {strategy}"


def _add_lora(
    plan: dict, shape: ModelShape, setup: Setup, args: PlanArguments, limits: dict, quantize: str = "none"
) -> None:
    """LoRA rows for every strategy, and the recommendation: LoRA's fastest fitting strategy where full fine-tuning
    fits under none on these pods or needs more of them; with the offload strategies, the host memory LoRA saves.
    With `quantize` (nf4, int8) the same for QLoRA (plan["qlora"]), recommended where neither full fine-tuning nor
    LoRA on the unquantized base fits."""
    key = "lora" if quantize == "none" else "qlora"
    lora_setup = replace(setup, lora_rank=args.lora_rank, lora_targets=args.lora_targets, quantize_base=quantize)
    layers = lora_layers(shape, args.lora_rank, args.lora_targets)
    rows = {}
    for name in DEEPSPEED_STRATEGIES:  # LoRA is modelled on the ZeRO strategies (and plain DDP); not yet under FSDP
        row = predict_strategy(shape, lora_setup, name, args.per_device_train_batch_size)
        rows[name] = _with_verdict(row, limits, args.gpu_memory_gb, args.cpu_memory_gb)
    plan[key] = {
        "rank": args.lora_rank,
        "targets": args.lora_targets,
        "quantize_base": quantize,
        "trainable_parameters": layers["trainable"],
        "adapted_layers": sum(count for _, count, *_ in layers["layers"]),
        "strategies": rows,
    }
    if quantize != "none":
        plan[key]["quantized_base"] = quantized_base(shape, quantize)
        plan["assumptions"] = plan["assumptions"] + QLORA_ASSUMPTIONS
        _recommend_lora(plan, key, shape, lora_setup, args, limits, rows)
        return
    plan["assumptions"] = plan["assumptions"] + LORA_ASSUMPTIONS
    offload = [n for n in DEEPSPEED_STRATEGIES if STRATEGY_LAYOUT[n][1] and n not in NVME_STRATEGIES]
    plan["lora"]["offload_note"] = (
        "; ".join(
            f"{n}: GPU {plan['strategies'][n]['gpu_total_gb']:.1f} -> {rows[n]['gpu_total_gb']:.1f} GB, host "
            f"{plan['strategies'][n]['cpu_per_node_gb']:.1f} -> {rows[n]['cpu_per_node_gb']:.1f} GB per pod"
            for n in offload
        )
        + ": with CPU offload the optimizer states live in host memory, so LoRA's saving is there."
    )
    _recommend_lora(plan, key, shape, lora_setup, args, limits, rows)


def _recommend_lora(plan, key, shape, lora_setup, args, limits, rows) -> None:
    """plan[key]["recommendation"] (LoRA or QLoRA's fastest fitting strategy), and the plan's recommendation where
    nothing before it fits (full fine-tuning, then LoRA on the unquantized base)."""
    full = plan["recommendation"]
    fitting = [n for n in DEEPSPEED_STRATEGIES if rows[n]["fits_with_margin"]]
    if not fitting:
        plan[key]["recommendation"] = None
        return
    name = fitting[0]
    quantize = lora_setup.quantize_base
    lora_recommendation = {
        "strategy": name,
        "lora": True,
        "lora_rank": args.lora_rank,
        "lora_targets": args.lora_targets,
        "quantize_base": quantize,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "largest_per_device_train_batch_size": largest_batch(shape, lora_setup, name, limits),
        "predicted_gpu_gb": rows[name]["gpu_total_gb"],
        "peak_phase": rows[name]["peak_phase"],
    }
    plan[key]["recommendation"] = lora_recommendation
    if quantize != "none":
        faster = full is not None and STRATEGIES.index(name) < STRATEGIES.index(full["strategy"])
        # LoRA on the unquantized base wins unless it fits only by offloading to host memory or NVMe, which moves
        # the model states over PCIe at every step: slower than dequantizing each weight on the GPU
        offloaded = (
            full is not None and full["strategy"] in STRATEGY_LAYOUT and any(STRATEGY_LAYOUT[full["strategy"]][1:])
        )
        if full is None or (full.get("lora") and faster and offloaded):
            why = (
                f"neither full fine-tuning nor LoRA on a {args.precision} base fits under any strategy"
                if full is None
                else f"full fine-tuning fits under no strategy, and LoRA on a {args.precision} base only under "
                f"{full['strategy']}, which offloads to the host or NVMe"
            )
            plan["recommendation"] = dict(
                lora_recommendation,
                reason=(
                    f"{why} on {args.nodes} pod(s) of {args.gpus_per_node} GPU(s). QLoRA (LoRA r={args.lora_rank} on "
                    f"{args.lora_targets}, the base in {quantize}) {under(name)} fits in {1 - args.safety_margin:.0%} "
                    f"of {args.gpu_memory_gb:g} GB"
                ),
            )
            plan["problem"] = None
        elif faster:
            full["alternative"] = (
                f"QLoRA ({quantize} base) fits {under(name)}, a faster strategy ({rows[name]['gpu_total_gb']:.1f} GB)"
            )
        return
    if full is None:
        full_setup = replace(lora_setup, lora_rank=0, lora_targets="qv", quantize_base="none")
        pods = pods_for_full_fine_tuning(shape, full_setup, args, limits)
        needs = f"; full fine-tuning would need {pods} pods of {args.gpus_per_node} GPU(s)" if pods else ""
        plan["recommendation"] = dict(
            lora_recommendation,
            reason=(
                f"full fine-tuning fits under no strategy on {args.nodes} pod(s){needs}. LoRA (r={args.lora_rank}, "
                f"{args.lora_targets}) {under(name)} fits in {1 - args.safety_margin:.0%} of {args.gpu_memory_gb:g} GB"
            ),
        )
        plan["problem"] = None
    elif STRATEGIES.index(name) < STRATEGIES.index(full["strategy"]):
        # full fine-tuning fits only under a slower strategy (the model spread over the GPUs, or offloaded to the host)
        full["alternative"] = (
            f"LoRA (r={args.lora_rank}, {args.lora_targets}) fits {under(name)}, a faster strategy, "
            f"on each GPU alone ({rows[name]['gpu_total_gb']:.1f} GB)"
        )


def pods_for_full_fine_tuning(
    shape: ModelShape, setup: Setup, args: PlanArguments, limits: dict, most: int = 64
) -> int | None:
    """The fewest pods (up to `most`) on which some strategy fits full fine-tuning at this batch; None if none."""
    for nodes in range(args.nodes + 1, most + 1):
        more = replace(setup, nodes=nodes)
        if any(_fits(predict_strategy(shape, more, n, args.per_device_train_batch_size), limits) for n in STRATEGIES):
            return nodes
    return None


def with_host_memory(args: PlanArguments) -> tuple[PlanArguments, bool]:
    """(the arguments with a pod's host memory, whether it was assumed): --cpu_memory_gb, else a worker pod's default."""
    if args.cpu_memory_gb is not None:
        return args, False
    return replace(args, cpu_memory_gb=DEFAULT_POD_MEMORY_GB), True


def _limits(args: PlanArguments) -> dict:
    args, host_assumed = with_host_memory(args)
    keep = 1 - args.safety_margin
    return {
        "gpu": args.gpu_memory_gb * GIB * keep,
        "cpu": args.cpu_memory_gb * GIB * keep,
        "host_memory": host_memory_words(args.cpu_memory_gb, host_assumed),
    }


def host_memory_words(cpu_memory_gb: float, assumed: bool) -> str:
    """The host memory a plan checked, saying when it was assumed rather than given."""
    return f"{cpu_memory_gb:g} GB host memory per pod" + (
        " (assumed: textsql's worker pods' default; pass --cpu_memory_gb with your pods')" if assumed else ""
    )


def _fits(row: dict, limits: dict) -> bool:
    return row["gpu_total_bytes"] <= limits["gpu"] and row["cpu_per_node_bytes"] <= limits["cpu"]


def _with_verdict(row: dict, limits: dict, gpu_memory_gb: float, cpu_memory_gb: float) -> dict:
    row = dict(row)
    row["gpu_gb"] = {k: round(v / GIB, 3) for k, v in row["gpu_bytes"].items()}
    row["gpu_total_gb"] = round(row["gpu_total_bytes"] / GIB, 3)
    row["cpu_per_node_gb"] = round(row["cpu_per_node_bytes"] / GIB, 3)
    row["fits_gpu"] = row["gpu_total_bytes"] <= gpu_memory_gb * GIB
    row["fits_cpu"] = row["cpu_per_node_bytes"] <= cpu_memory_gb * GIB
    row["fits_with_margin"] = _fits(row, limits)
    return row


def _recommend(shape, setup, args, strategies, limits):
    """(recommendation, problem): the first strategy in speed order that fits with the margin, and its largest batch."""
    for name in STRATEGIES:
        if strategies[name]["fits_with_margin"]:
            largest = largest_batch(shape, setup, name, limits)
            return {
                "strategy": name,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "largest_per_device_train_batch_size": largest,
                "predicted_gpu_gb": strategies[name]["gpu_total_gb"],
                "peak_phase": strategies[name]["peak_phase"],
                "reason": f"{name} is the fastest strategy whose peak over the run's phases fits in {1 - args.safety_margin:.0%} of "
                f"{args.gpu_memory_gb:g} GB"
                + f", and its host peak in {1 - args.safety_margin:.0%} of {limits['host_memory']}",
            }, None
    return None, _no_fit_message(shape, setup, args, strategies, limits)


def largest_batch(shape: ModelShape, setup: Setup, strategy: str, limits: dict) -> int:
    """The largest per-device batch (up to 4096) whose prediction fits the limits under `strategy`; 0 if none."""

    def fits(batch):
        return _fits(predict_strategy(shape, setup, strategy, batch), limits)

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH_SEARCHED and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_BATCH_SEARCHED + 1)
    while high - low > 1:  # fits(low) and not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _no_fit_message(shape, setup, args, strategies, limits) -> str:
    on_the_gpu = [name for name in STRATEGIES if strategies[name]["gpu_total_bytes"] <= limits["gpu"]]
    if on_the_gpu:  # the GPUs would do: the host is what falls short
        name = on_the_gpu[0]
        return (
            f"{name} fits the GPU ({strategies[name]['gpu_total_gb']:.1f} GB of the {limits['gpu'] / GIB:.1f} GB "
            f"allowed), but its host peak ({strategies[name]['cpu_per_node_gb']:.1f} GB per pod, "
            f"{strategies[name]['cpu_peak_phase']}) is over the {limits['cpu'] / GIB:.1f} GB allowed of "
            f"{limits['host_memory']}, as is every strategy's that fits the GPU. Pass --cpu_memory_gb with your pods' "
            "host memory and give them that much (the session's resource profile; Cluster(memory=...) for workers), or "
            "use more pods (--nodes), which divide ZeRO-3's host states."
        )
    smallest = min(STRATEGIES, key=lambda n: strategies[n]["gpu_total_bytes"])
    allowed = f"{args.gpu_memory_gb:g} GB less the {args.safety_margin:.0%} safety margin"
    fixes = []
    if args.nodes * args.gpus_per_node < 64:
        fixes.append("more pods (--nodes) or GPUs per pod, which divide the ZeRO-3 model states")
    if not args.activation_checkpointing:
        fixes.append("--activation_checkpointing True")
    if args.precision == "fp32":
        fixes.append("--precision bf16 (Ampere or newer)")
    if strategies[smallest]["peak_phase"] == "evaluation":
        fixes.insert(
            0,
            f"a smaller --per_device_eval_batch_size or fewer --execution_accuracy_num_beams (evaluation sets {smallest}'s peak: "
            f"textsql train's --per_device_eval_batch_size and --execution_accuracy_num_beams)",
        )
    if shape.causal and not args.lora:
        fixes.append("LoRA (--lora True) or QLoRA (--lora True --quantize_base nf4), which the plan then shows")
    elif shape.causal and args.quantize_base == "none":
        fixes.append("QLoRA (--quantize_base nf4)")
    fixes.append("shorter --max_source_length/--max_target_length or a smaller model")
    for name in STRATEGIES:
        batch = largest_batch(shape, setup, name, limits)
        if batch:
            return (
                f"A per-device batch of {args.per_device_train_batch_size} fits under no strategy for {shape.name} on "
                f"{args.nodes} x {args.gpus_per_node} GPU(s): the smallest prediction is "
                f"{strategies[smallest]['gpu_total_gb']:.1f} GB ({smallest}), over the {limits['gpu'] / GIB:.1f} GB "
                f"allowed ({allowed}). The fastest strategy that fits at all is {name} with a batch of at most "
                f"{batch}: pass --per_device_train_batch_size {batch} and raise --gradient_accumulation_steps to keep "
                f"the effective batch, or use {', or '.join(fixes)}."
            )
    cpu_note = ""
    if not strategies[smallest]["fits_cpu"]:
        cpu_note = (
            f" The host memory also falls short ({strategies[smallest]['cpu_per_node_gb']:.1f} GB per node needed)."
        )
    return (
        f"{shape.name} fits under no strategy on {args.nodes} x {args.gpus_per_node} GPU(s) of {args.gpu_memory_gb:g} GB, "
        f"not even with a batch of 1: the smallest prediction at batch {args.per_device_train_batch_size} is "
        f"{strategies[smallest]['gpu_total_gb']:.1f} GB ({smallest}), over the {limits['gpu'] / GIB:.1f} GB allowed "
        f"({allowed}).{cpu_note} Use {', or '.join(fixes)}."
    )


def _dsconfig_label(dsconfig) -> str | None:
    if dsconfig is None:
        return None

    return describe_strategy(dsconfig)["label"]
