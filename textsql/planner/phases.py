"""A run's phases and their peaks: the training step (model states + activations + buffers + overhead, under DeepSpeed or
FSDP), evaluation (the eval loss or generate()'s caches), checkpoint and final saves; the pod's peak is the largest."""

from __future__ import annotations

import math

from textsql.planner import causal as causal_lm
from textsql.planner.activations import activation_bytes, lora_activation_bytes
from textsql.planner.shape import (
    GIB,
    ModelShape,
)
from textsql.planner.states import (
    ADDITIONAL_BUFFER_FACTOR,
    Setup,
    bucket_bytes,
    lora_layers,
    lora_model_states,
    model_states,
    nvme_bytes,
    quantized_base,
    weight_copy_bytes,
    zero3_residency_for,
)
from textsql.strategy.table import FSDP_LAYOUT, NVME_STRATEGIES, STRATEGY_LAYOUT

# parameters + gradients + optimizer_states are the model states (DeepSpeed's estimators); weight_copies are the parameter
# copies held beyond them (ZeRO-3's gathered parameters, autocast's 16-bit weights); buckets are communication and
# gradient buffers.
COMPONENTS = ("parameters", "gradients", "optimizer_states", "weight_copies", "activations", "buckets", "overhead")


# What torch does not see. CUDA context with torch's kernels loaded lazily (CUDA >= 11.7, torch's default since 1.13):
# measured by the GPU check (bench/gpu, 2026-11-26: NVIDIA H200, CUDA 13.0, torch 2.11, driver 580.159) as the device
# memory in use beyond torch's reservation after the first allocation: 648,871,936 bytes (0.60 GiB; the estimate it
# replaces was 0.5 GiB, from pytorch/pytorch#86509's 287 MB bare context plus the kernels a step loads).
CUDA_CONTEXT_BYTES = 648_871_936


# NCCL's communicator buffers with more than one GPU: measured by the same check after a one-rank NCCL all-reduce on
# that H200 (NCCL 2.28.9): 585,105,408 bytes beyond the context (0.54 GiB; the estimate it replaces was 0.25 GiB from
# NCCL_BUFFSIZE's 4 MiB per channel and peer). A lower bound: more peers (several GPUs, several pods) add channels.
NCCL_BUFFER_BYTES = 585_105_408


# The caching allocator reserves more than it hands out (block rounding, fragmentation): pytorch/pytorch#40989 shows
# peak reserved / peak allocated of 1.11 for a training step (16726 / 15006 MB); 10% of everything allocated. The GPU
# check (bench/gpu, H200, 2026-11-26; 11 runs of t5-small's shape in bf16, batch 32, 48/40 tokens, every strategy and
# LoRA) measured 1.11-1.54 (median 1.32), but the planner's allocated bytes came out 12-18% high on the same runs, so
# its reserved prediction landed within -11% / +2% of the measurement except ZeRO-2/3 with CPU offload (+31% / +35%:
# under-predicted, the next thing to model). Kept at 10% until the allocated terms are calibrated too.
ALLOCATOR_OVERHEAD_FRACTION = 0.10


# Host memory of one training process besides model states: Python, torch + CUDA libraries, transformers,
# DeepSpeed, the tokenized dataset.
CPU_RUNTIME_BYTES_PER_RANK = 3 * GIB


def predict(
    shape: ModelShape,
    setup: Setup,
    stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    batch: int,
    nvme: bool = False,
) -> dict:
    """Bytes per GPU by component (and their total), host bytes per node, for one strategy and batch (LoRA when
    setup.lora_rank is set). `nvme`: what is offloaded goes to NVMe (nvme_bytes) instead of host memory."""
    settings = dict(setup.settings)
    lora = lora_layers(shape, setup.lora_rank, setup.lora_targets) if setup.lora_rank else None
    quantized = quantized_base(shape, setup.quantize_base) if lora and setup.quantize_base != "none" else None
    # --lora_base_dtype bfloat16: the frozen base in bf16 where the run computes in bf16 without DeepSpeed (which
    # holds it in the training dtype already)
    bf16_base = bool(lora) and not quantized and stage == 0 and setup.lora_base_dtype == "bfloat16"
    if lora is None:
        states = model_states(
            shape.parameters,
            shape.largest_layer_parameters,
            stage,
            offload_optimizer,
            offload_param,
            setup.gpus_per_node,
            setup.nodes,
            setup.precision,
        )
    else:
        states = lora_model_states(
            shape.parameters,
            lora["trainable"],
            shape.largest_layer_parameters,
            stage,
            offload_optimizer,
            offload_param,
            setup.gpus_per_node,
            setup.nodes,
            setup.precision,
            base_bytes=quantized["total"] if quantized else 2 * shape.parameters if bf16_base else None,
        )
    activations = _step_activations(shape, setup, batch, stage, lora, quantized, bf16_base)
    buckets = bucket_bytes(
        shape,
        settings,
        stage,
        offload_optimizer,
        setup.precision,
        setup.gpus,
        trainable=None if lora is None else lora["trainable"],
    )
    residency = zero3_residency_for(shape, settings, setup.gradient_checkpointing) if stage == 3 else None
    copies = weight_copy_bytes(shape, stage, setup.precision, residency, quantized, bf16_base)
    reclaimable = buckets.get("gradients_awaiting_copy", 0)
    gpu = {
        "parameters": states["parameters"],
        "gradients": states["gradients"],
        "optimizer_states": states["optimizer_states"],
        "weight_copies": sum(copies.values()),
        "activations": activations["total"],
        "buckets": sum(buckets.values()) - reclaimable,
    }
    allocated = sum(gpu.values())
    unseen_by_torch = CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if setup.gpus > 1 else 0)
    gpu["overhead"] = int(ALLOCATOR_OVERHEAD_FRACTION * allocated) + unseen_by_torch
    total = sum(gpu.values())
    disk = nvme_bytes(shape, setup, shape.parameters if lora is None else lora["trainable"]) if nvme else None
    if disk is not None:
        states["cpu_model_states"] = disk["host_bytes"]
    cpu = int(states["cpu_model_states"] + CPU_RUNTIME_BYTES_PER_RANK * setup.gpus_per_node)
    return {
        "nvme": disk,
        "gpu_bytes": gpu,
        "gpu_total_bytes": total,
        "torch_allocated_bytes": allocated,
        "torch_reserved_bytes": total - unseen_by_torch,
        "model_states_bytes": states["parameters"] + states["gradients"] + states["optimizer_states"],
        "activations_detail": activations,
        "buckets_detail": buckets,
        # Reserved at the peak while memory is free, given back when it runs short (the caching allocator then waits
        # for the copies instead of failing: states.offload_bytes): not in the total a batch needs to fit, but in the
        # peak a run measures (textsql.planner.check).
        "reclaimable_bytes": int(reclaimable * (1 + ALLOCATOR_OVERHEAD_FRACTION)),
        "weight_copies_detail": copies,
        "zero3_residency": residency,
        "overhead_detail": {
            "allocator": gpu["overhead"] - unseen_by_torch,
            "cuda_context": CUDA_CONTEXT_BYTES,
            "nccl": unseen_by_torch - CUDA_CONTEXT_BYTES,
        },
        "cpu_per_node_bytes": cpu,
        "cpu_model_states_bytes": states["cpu_model_states"],
        "trainable_parameters": shape.parameters if lora is None else lora["trainable"],
        "quantized_base": quantized,
    }


def _step_activations(
    shape: ModelShape, setup: Setup, batch: int, stage: int, lora, quantized, bf16_base: bool
) -> dict:
    """The training step's activations by term (and their total): the model's, LoRA's adapters', int8 bases' inputs."""
    activations = activation_bytes(
        shape,
        batch,
        setup.source_length,
        setup.target_length,
        setup.precision,
        setup.gradient_checkpointing,
        autocast=stage == 0 and setup.precision != "fp32" and not bf16_base,
        frozen=lora is not None and quantized is None,  # bitsandbytes' matmuls keep their inputs, frozen or not
        fused_loss=setup.fused_loss,
    )
    if lora is not None:
        activations["lora"] = lora_activation_bytes(
            lora, batch, setup.source_length, setup.target_length, setup.precision, setup.gradient_checkpointing, shape
        )
        activations["total"] += activations["lora"]
    if quantized is not None and setup.quantize_base == "int8" and shape.causal:
        tokens = batch * (setup.source_length + setup.target_length)
        layers = 1 if setup.gradient_checkpointing else shape.causal.layers
        activations["int8_inputs"] = layers * causal_lm.int8_matmul_input_bytes(shape.causal, tokens)
        activations["total"] += activations["int8_inputs"]
    return activations


def fsdp_units(shape: ModelShape) -> dict:
    """Parameters of the FSDP units textsql wraps: one T5 block of each stack, and the rest (the tied embeddings, with
    the final layer norms) as the embedding unit. A causal LM's: its decoder layer (the model's _no_split_modules), and
    the rest (embeddings, output layer, final norm) as the embedding unit."""
    if shape.causal:
        blocks = shape.num_layers * shape.block_parameters
        return {
            "encoder_block": 0,
            "decoder_block": shape.block_parameters,
            "blocks": blocks,
            "embeddings": max(0, shape.parameters - blocks),
        }
    d, inner, f = shape.d_model, shape.num_heads * shape.d_kv, shape.d_ff
    feed_forward = (3 if shape.gated else 2) * d * f + d
    encoder_block = 4 * d * inner + d + feed_forward
    decoder_block = 8 * d * inner + 2 * d + feed_forward
    blocks = shape.num_layers * encoder_block + shape.num_decoder_layers * decoder_block
    return {
        "encoder_block": encoder_block,
        "decoder_block": decoder_block,
        "blocks": blocks,
        "embeddings": max(0, shape.parameters - blocks),
    }


def predict_fsdp(
    shape: ModelShape, setup: Setup, reshard_after_forward: bool, offload: bool, hybrid: bool, batch: int
) -> dict:
    """Bytes per GPU by component (and their total), host bytes per node, under FSDP2: the model states sharded in fp32
    over the GPUs (one pod's with hybrid sharding), and the gathered units in the compute dtype."""
    P = shape.parameters
    shards = setup.gpus_per_node if hybrid else setup.gpus
    low = 4 if setup.precision == "fp32" else 2
    units = fsdp_units(shape)
    block = max(units["encoder_block"], units["decoder_block"])
    largest_unit = max(block, units["embeddings"])
    sharded = {
        "parameters": math.ceil(4 * P / shards),
        "gradients": math.ceil(4 * P / shards),
        "optimizer_states": math.ceil(8 * P / shards),
    }
    gathered_blocks = 2 * block if reshard_after_forward else units["blocks"]
    copies = {"embeddings": low * units["embeddings"], "blocks": low * gathered_blocks}
    buckets = {"unsharded_gradient": low * largest_unit, "reduce_scatter_fp32": 4 * largest_unit}
    activations = activation_bytes(
        shape,
        batch,
        setup.source_length,
        setup.target_length,
        setup.precision,
        setup.gradient_checkpointing,
        autocast=False,
    )
    load_cpu = P * 4 * setup.gpus_per_node * ADDITIONAL_BUFFER_FACTOR  # every rank loads the fp32 checkpoint first
    cpu_states = load_cpu + (16 * P * setup.gpus_per_node / shards if offload else 0)
    gpu = {
        "parameters": 0 if offload else sharded["parameters"],
        "gradients": 0 if offload else sharded["gradients"],
        "optimizer_states": 0 if offload else sharded["optimizer_states"],
        "weight_copies": sum(copies.values()),
        "activations": activations["total"],
        "buckets": sum(buckets.values()),
    }
    allocated = sum(gpu.values())
    unseen_by_torch = CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if setup.gpus > 1 else 0)
    gpu["overhead"] = int(ALLOCATOR_OVERHEAD_FRACTION * allocated) + unseen_by_torch
    total = sum(gpu.values())
    cpu = int(cpu_states + CPU_RUNTIME_BYTES_PER_RANK * setup.gpus_per_node)
    return {
        "gpu_bytes": gpu,
        "gpu_total_bytes": total,
        "torch_allocated_bytes": allocated,
        "torch_reserved_bytes": total - unseen_by_torch,
        "model_states_bytes": gpu["parameters"] + gpu["gradients"] + gpu["optimizer_states"],
        "activations_detail": activations,
        "buckets_detail": buckets,
        "weight_copies_detail": copies,
        "zero3_residency": None,
        "fsdp_units": units | {"sharded_over": shards},
        "overhead_detail": {
            "allocator": gpu["overhead"] - unseen_by_torch,
            "cuda_context": CUDA_CONTEXT_BYTES,
            "nccl": unseen_by_torch - CUDA_CONTEXT_BYTES,
        },
        "cpu_per_node_bytes": cpu,
        "cpu_model_states_bytes": int(cpu_states),
    }


# In the order a run meets them; where two phases predict the same peak, the earlier one is named.
PHASES = ("training", "evaluation", "checkpoint_save", "final_save")


def generation_bytes(shape: ModelShape, setup: Setup, fp32_module: bool = False) -> dict:
    """GPU bytes an evaluation adds to what stays between training steps: the evaluation loss's forward pass (no
    gradients: the logits, their fp32 copy in 16-bit training, and the fp32 log-softmax, eval batch x target x
    vocabulary) or, when evaluation generates
    SQL (setup.eval_num_beams > 0: textsql's execution accuracy), generate()'s working set, whichever is larger.

    generate() holds, for eval batch x beams rows: the encoder output (source x d_model), the cross-attention keys and
    values of every decoder layer (2 x source x heads x d_kv), the self-attention cache grown to the target length
    (2 x target x heads x d_kv per layer), and each step's scores over the vocabulary in fp32 (the logits' copy, the
    log-softmax, the beam scores added: three rows x vocabulary tensors). generate() runs the module in its own dtype
    (no autocast): `fp32_module` for plain PyTorch, whose module is fp32 whatever the precision.
    """
    if shape.causal:
        return causal_lm.generation_bytes(
            shape.causal,
            setup.eval_batch,
            setup.eval_num_beams,
            setup.source_length + setup.target_length,
            setup.precision,
            fp32_module,
        )
    s = shape
    e = 4 if setup.precision == "fp32" else 2
    inner, src, tgt = s.num_heads * s.d_kv, setup.source_length, setup.target_length
    loss_forward = setup.eval_batch * tgt * s.vocab_size * (e + 4 + (4 if e == 2 else 0))
    detail = {"loss_forward": int(loss_forward)}
    if setup.eval_num_beams:
        e = 4 if fp32_module else e
        rows = setup.eval_batch * setup.eval_num_beams
        detail |= {
            "encoder_output": rows * src * s.d_model * e,
            "cross_attention_cache": s.num_decoder_layers * 2 * rows * src * inner * e,
            "self_attention_cache": s.num_decoder_layers * 2 * rows * tgt * inner * e,
            "step_scores": 3 * rows * s.vocab_size * 4,
        }
    generate = sum(v for k, v in detail.items() if k != "loss_forward")
    detail["total"] = int(max(loss_forward, generate))
    return detail


def predict_phases(
    shape: ModelShape, setup: Setup, row: dict, stage: int, offload_optimizer: bool, fsdp: bool = False
) -> dict:
    """Each phase's predicted GPU bytes per GPU and host bytes per pod, from the training step's prediction `row`
    (predict or predict_fsdp for the same strategy). Between training steps the activations are freed; what stays
    (held) is the parameters, optimizer states and buffers, DeepSpeed's gradient partitions (the Trainer frees
    PyTorch's and FSDP's gradients), and ZeRO-3's / FSDP's gathered parameters (counted whole: generate() runs every
    module again and again, so the coordinator's trace never settles).

    - training: the row itself.
    - evaluation: held + generation_bytes (the eval loss's forward pass, or generate()'s caches and scores).
    - checkpoint_save: held on the GPU (ZeRO-3 gathers one module at a time, already counted; safetensors copies one
      tensor at a time to the host). On the host: rank 0's whole model in the module's dtype (ZeRO-3 with
      stage3_gather_16bit_weights_on_model_save: the gathered 16-bit state dict; else safetensors' host copies of the
      GPU tensors, kept until the file is written; fp32 without DeepSpeed and under FSDP), and on each rank torch.save's host copy of the largest optimizer tensor on the GPU (the flat fp32
      partition, 4P/N bytes; none when the optimizer is offloaded, its states already on the host).
    - final_save: textsql's save_final_model writes fp32: on the GPU, the full fp32 copy of one parameter at a time
      (DeepSpeed's safe_get_full_fp32_param, FSDP's full_tensor: the largest parameter, plus its fp32 partition
      brought from the host under ZeRO-3 offload); plain PyTorch copies to the host directly. On the host, every rank
      builds the whole fp32 state dict on the host (4P each; under FSDP rank 0 alone), which safetensors writes
      without a copy. With LoRA, textsql saves the adapter alone: its trainable parameters in fp32 on each rank.
    The pod's peak is the largest phase (peak_phase names it; cpu_peak_phase the host's).
    """
    P, N = shape.parameters, setup.gpus
    low = 4 if setup.precision == "fp32" else 2
    largest = max(shape.parameter_sizes, default=shape.largest_layer_parameters)
    gpu = row["gpu_bytes"]
    held_parts = {
        "parameters": gpu["parameters"],
        "gradients": gpu["gradients"] if stage > 0 and not fsdp else 0,
        "optimizer_states": gpu["optimizer_states"],
        "weight_copies": gpu["weight_copies"] if stage == 3 or fsdp else 0,
        "buckets": gpu["buckets"],
    }
    held = sum(held_parts.values())  # what stays between training steps
    train_cpu = row["cpu_per_node_bytes"]
    lora = setup.lora_rank > 0
    trainable = row.get("trainable_parameters", P)
    # ZeRO-3: the gathered 16-bit state dict on the host (safetensors writes host tensors without a copy; with LoRA
    # too: the Trainer gathers the whole model, then PEFT keeps the adapter); else safetensors' host copies of the
    # module's weights on the GPU (with LoRA, the adapter's), all kept until the file is written.
    if stage == 3 and not fsdp:
        model_on_rank0 = low * P
    else:
        model_on_rank0 = (4 if stage == 0 or fsdp else low) * (trainable if lora else P)
    largest_state = 4 * (trainable if lora else largest) if stage == 0 else math.ceil(4 * trainable / N)
    optimizer_copy = 0 if offload_optimizer else largest_state
    if lora:  # textsql saves the adapter alone (adapter_state on every rank): its parameters, gathered whole
        final_gpu, state_dicts = 0, 4 * trainable * setup.gpus_per_node
    elif stage == 0 and not fsdp:
        final_gpu, state_dicts = 0, 4 * P * setup.gpus_per_node
    else:
        final_gpu = 4 * largest + (math.ceil(4 * largest / N) if stage == 3 and offload_optimizer else 0)
        state_dicts = 4 * P * (1 if fsdp else setup.gpus_per_node)
    generation = generation_bytes(shape, setup, fp32_module=stage == 0 and not fsdp)
    extra = {
        "evaluation": (generation["total"], 0),
        "checkpoint_save": (0, model_on_rank0 + optimizer_copy * setup.gpus_per_node),
        "final_save": (final_gpu, state_dicts),
    }
    unseen = row["gpu_total_bytes"] - row["torch_reserved_bytes"]
    phases = {
        "training": {
            "gpu_total_bytes": row["gpu_total_bytes"],
            "gpu_added_bytes": row["torch_allocated_bytes"] - held,
            "allocated_bytes": row["torch_allocated_bytes"],
            "cpu_per_node_bytes": train_cpu,
            "cpu_added_bytes": 0,
        }
    }
    for name, (added_gpu, added_cpu) in extra.items():
        allocated = held + added_gpu
        phases[name] = {
            "gpu_total_bytes": allocated + int(ALLOCATOR_OVERHEAD_FRACTION * allocated) + unseen,
            "gpu_added_bytes": int(added_gpu),
            "allocated_bytes": int(allocated),
            "cpu_per_node_bytes": int(train_cpu + added_cpu),
            "cpu_added_bytes": int(added_cpu),
        }
    phases["evaluation"]["generation_detail"] = generation
    for phase in phases.values():
        phase["gpu_total_gb"] = round(phase["gpu_total_bytes"] / GIB, 3)
        phase["cpu_per_node_gb"] = round(phase["cpu_per_node_bytes"] / GIB, 3)
    return {
        "phases": phases,
        "held_between_steps_bytes": held,
        "held_between_steps_detail": held_parts,
        "peak_phase": max(PHASES, key=lambda n: phases[n]["gpu_total_bytes"]),
        "cpu_peak_phase": max(PHASES, key=lambda n: phases[n]["cpu_per_node_bytes"]),
    }


def with_phases(shape: ModelShape, setup: Setup, row: dict, stage: int, offload_optimizer: bool, fsdp: bool) -> dict:
    """The training step's row with its phases added, and its totals the pod's peak: the largest phase (the
    training step's own figures stay in training_gpu_total_bytes, training_cpu_per_node_bytes and gpu_bytes)."""
    found = predict_phases(shape, setup, row, stage, offload_optimizer, fsdp)
    phases = found["phases"]
    return dict(
        row,
        **found,
        training_gpu_total_bytes=row["gpu_total_bytes"],
        training_cpu_per_node_bytes=row["cpu_per_node_bytes"],
        gpu_total_bytes=phases[found["peak_phase"]]["gpu_total_bytes"],
        cpu_per_node_bytes=phases[found["cpu_peak_phase"]]["cpu_per_node_bytes"],
    )


def predict_strategy(shape: ModelShape, setup: Setup, strategy: str, batch: int) -> dict:
    """The pod's peak over a run's phases (with_phases) for a strategy of the table, by name."""
    if strategy in FSDP_LAYOUT:
        reshard, offload, hybrid = FSDP_LAYOUT[strategy]
        row = predict_fsdp(shape, setup, reshard, offload, hybrid, batch)
        return with_phases(shape, setup, row, 3, offload, fsdp=True)
    stage, offload_optimizer, offload_param = STRATEGY_LAYOUT[strategy]
    row = predict(shape, setup, stage, offload_optimizer, offload_param, batch, nvme=strategy in NVME_STRATEGIES)
    return with_phases(shape, setup, row, stage, offload_optimizer, fsdp=False)
