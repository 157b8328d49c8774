"""One rank of textsql's FSDP2 logic on the CPU (gloo): accelerate's real FSDP2 wrapping of a tiny model (T5 with and
without textsql's tied-embedding unit, or a causal LM), its own decoder layers as the units, one training step against an
unsharded copy, generation with synced_gpus, and the full state dict gathered and saved. Each rank writes
RESULTS_DIR/rank<N>.json for tests/integration/test_fsdp.py.

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P \\
        tests/integration/fsdp_ranks.py MODEL_DIR RESULTS_DIR

The Trainer itself turns FSDP on only on GPUs (on a CPU it silently trains DDP), so this drives the same pieces the
Trainer does: accelerate's FullyShardedDataParallelPlugin and fsdp2_prepare_model, after textsql's grouping.
"""

import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, register_fsdp_forward_method

from textsql.families import family_of
from textsql.hub import load_model
from textsql.strategy.fsdpconfig import load_fsdpconfig, resolve_fsdpconfig_path
from textsql.train.fsdp import (
    accelerate_fsdp2_kwargs,
    full_state_dict,
    group_tied_embeddings,
    synced_generation,
    tied_embedding_modules,
    wrapped_layer_classes,
)

STRATEGIES = ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_full_shard_offload", "fsdp_hybrid_shard")


def accelerator_for(config: dict, rank: int):
    """What accelerate's fsdp2_prepare_model reads from an Accelerator: the FSDP2 plugin the Trainer builds from the
    config (transformers' _process_fsdp_args), the mesh (2-D for hybrid sharding) and the mixed precision."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        # None, as the shipped configs leave it out: accelerate wraps the model's own _no_split_modules
        transformer_cls_names_to_wrap=config.get("transformer_layer_cls_to_wrap"),
        reshard_after_forward=config["reshard_after_forward"],
        # The Trainer's CPUOffloadPolicy() pins host memory, which needs a GPU; unpinned, the same offload path runs.
        cpu_offload=CPUOffloadPolicy(pin_memory=False) if config["cpu_offload"] else False,
    )
    mesh, names = None, None
    if config.get("hybrid_shard"):  # one "pod" of two ranks: replicate 1 x shard 2, as ParallelismConfig builds it
        names = ("dp_replicate", "dp_shard")
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=names)
    return types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=mesh,
        parallelism_config=types.SimpleNamespace(fsdp_dim_names=names),
        mixed_precision="no",
        is_main_process=rank == 0,
        device=torch.device("cpu"),
    )


def batch(rank: int | None, causal: bool = False):
    """A fixed batch of 4 (equal lengths: the mean of two halves' losses is the whole batch's); a rank its half. A causal
    LM's labels are its inputs."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randint(5, 100, (4, 12), generator=generator)
    labels = inputs.clone() if causal else torch.randint(5, 100, (4, 6), generator=generator)
    if rank is None:
        return inputs, labels
    return inputs[2 * rank : 2 * rank + 2], labels[2 * rank : 2 * rank + 2]


def step(model, inputs, labels):
    # Adam's first step is lr * g / (|g| + eps): with the default eps (1e-8) a gradient at rounding level (the two ranks
    # sum in another order than one process) moves by up to lr either way, and the comparison measured the machine's
    # floating-point order (3.3e-5 on one CPU, under 2e-5 on another). eps 1e-3 keeps Adam's sharded states and makes
    # the step proportional to the gradient there.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    loss = model(input_ids=inputs, labels=labels).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def reference_run(model_dir: str, rank: int, causal: bool) -> dict:
    """One unsharded AdamW step on the whole batch and a greedy answer to this rank's own question (of its own length):
    what every sharded run is compared with."""
    reference = load_model(model_dir)
    loss = step(reference, *batch(None, causal))
    question = batch(None, causal)[0][rank : rank + 1, : 4 + 4 * rank]
    return {
        "loss": float(loss),
        "whole": {name: p.detach() for name, p in reference.named_parameters()},
        "question": question,
        "answer": reference.generate(question, max_new_tokens=8 + 6 * rank, do_sample=False),
    }


def strategy_row(model_dir: str, name: str, rank: int, reference: dict, folder: Path) -> dict:
    """One FSDP2 strategy (a shipped config's name) as the Trainer would wrap the model: the units, one step on this
    rank's half of the batch, synced generation, and the gathered state dict (rank 0 saves it into `folder` and loads
    it back)."""
    config = load_fsdpconfig(resolve_fsdpconfig_path(name))
    model = load_model(model_dir)
    causal = family_of(model.config).causal
    accelerator = accelerator_for(config, rank)
    units = wrapped_layer_classes(model, config)  # what train() checks and logs before the Trainer wraps
    layers = [m for m in model.modules() if type(m).__name__ in units]
    # as the Trainer does: T5's tied modules grouped first; a causal LM's two accelerate groups itself
    grouped = [] if causal else group_tied_embeddings(model, **accelerate_fsdp2_kwargs(accelerator))
    model = fsdp2_prepare_model(accelerator, model)
    loss = step(model, *batch(rank, causal))
    dist.all_reduce(loss)
    register_fsdp_forward_method(model, "generate")  # as the Trainer does
    synced = synced_generation(zero3=False, fsdp=True, world_size=dist.get_world_size())
    answer = model.generate(reference["question"], max_new_tokens=8 + 6 * rank, do_sample=False, synced_gpus=synced)
    state = full_state_dict(model, torch.float32)
    row = {
        "grouped": len(grouped),
        "embeddings_one_unit": isinstance(model.get_input_embeddings(), FSDPModule),
        "units": units,
        "decoder_layers": len(layers),
        "decoder_layers_sharded": all(isinstance(m, FSDPModule) for m in layers),
        "offload_policy": type(accelerate_fsdp2_kwargs(accelerator)["offload_policy"]).__name__,
        "mean_loss": float(loss) / dist.get_world_size(),
        "reference_loss": reference["loss"],
        "same_answer": bool(torch.equal(answer, reference["answer"])),
        "synced_gpus": synced,
        "state_on_rank": len(state),
    }
    if rank == 0:
        whole = reference["whole"]
        row["names_match"] = sorted(state) == sorted(whole)
        row["max_difference"] = max(float((state[k] - whole[k]).abs().max()) for k in whole)
        row["all_float32"] = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in state.values())
        model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
        again = load_model(str(folder))
        row["saved_architectures"] = again.config.architectures
        row["reloaded_max_difference"] = max(
            float((p.detach() - whole[k]).abs().max()) for k, p in again.named_parameters()
        )
    dist.barrier()
    return row


def main(model_dir: str, results_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    report = {"rank": rank, "world_size": dist.get_world_size(), "strategies": {}}

    plain = load_model(model_dir)
    causal = family_of(plain.config).causal
    report["family"] = family_of(plain.config).name
    if not causal:  # Without textsql's unit, accelerate's own wrapping stops on T5 at the first forward pass.
        config = load_fsdpconfig(resolve_fsdpconfig_path("fsdp_full_shard"))
        report["tied_modules"] = sorted(
            name for name, m in plain.named_modules() if any(m is t for t in tied_embedding_modules(plain))
        )
        try:
            wrapped = fsdp2_prepare_model(accelerator_for(config, rank), plain)
            wrapped(input_ids=batch(rank)[0], labels=batch(rank)[1])
            report["without_grouping"] = "ran"
        except ValueError as error:
            report["without_grouping"] = str(error)

    reference = reference_run(model_dir, rank, causal)
    for name in STRATEGIES:
        report["strategies"][name] = strategy_row(model_dir, name, rank, reference, Path(results_dir) / name)
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
