"""What every objective's trainer shares: its SQL scored on validation questions (one path, whichever objective
trained), the final model saved in one dtype whatever the strategy, each rank's peak memory, one GPU per process."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from textsql.evaluate import ScoringSet, decode_and_score, load_scoring_set, sql_token_budget
from textsql.families import best_setting
from textsql.prepared import prepared_family
from textsql.train.distributed import rank
from textsql.train.fsdp import full_state_dict, synced_generation

logger = logging.getLogger("textsql.train")


@dataclass(frozen=True)
class SqlScoring:
    """What a trainer scores its model's SQL on, and how: the validation questions (`--execution_accuracy_samples`), the
    decoding, the token budget, and whether every evaluation scores it or only the final weights."""

    scoring: ScoringSet
    decoding: str = "greedy"
    num_beams: int = 1
    max_new_tokens: int = 128
    each_evaluation: bool = False

    @classmethod
    def for_run(cls, data_args, data_meta: dict, has_validation: bool) -> SqlScoring | None:
        """The run's scoring from its DataArguments and the prepared dataset's metadata; None without a validation
        split or with --execution_accuracy_samples 0."""
        if not (has_validation and data_args.execution_accuracy_samples):
            return None
        return cls(
            load_scoring_set(data_args.dataset_dir, "validation", data_args.execution_accuracy_samples),
            decoding=best_setting(  # auto: the family's best (textsql.families.best_settings)
                "decoding",
                data_args.execution_accuracy_decoding,
                prepared_family(data_meta),
                data_meta.get("has_tables", True),
            ),
            num_beams=data_args.execution_accuracy_num_beams,
            max_new_tokens=sql_token_budget(data_meta),
            each_evaluation=data_args.execution_accuracy_each_evaluation,
        )

    @property
    def questions(self) -> int:
        return len(self.scoring.sources)


def sql_scores(trainer, scoring: SqlScoring) -> dict:
    """WikiSQL's scores of `scoring`'s questions by the trainer's model (any objective's trainer) as eval metrics:
    execution and logical-form accuracy, exact match, and the share of each part of the query right (eval_sql_<part>).
    Every rank generates the same questions: under ZeRO-3 and FSDP they must step through generate() together."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    _, metrics = decode_and_score(
        trainer.accelerator.unwrap_model(trainer.model),
        trainer.processing_class,
        scoring.scoring,
        decoding=scoring.decoding,
        num_beams=scoring.num_beams,
        max_new_tokens=scoring.max_new_tokens,
        batch_size=trainer.args.per_device_eval_batch_size,
        synced_gpus=synced_generation(is_deepspeed_zero3_enabled(), trainer.is_fsdp_enabled, trainer.args.world_size),
        progress=False,
        device=trainer.args.device,
        # each batch generated is a prediction step to the callbacks: a pod watching this rank's progress sees one
        on_batch=lambda: trainer.callback_handler.on_prediction_step(trainer.args, trainer.state, trainer.control),
    )
    scores = {f"eval_{name}": metrics[name] for name in ("execution_accuracy", "logical_form_accuracy", "exact_match")}
    scores.update({f"eval_sql_{name}": share for name, share in metrics["components"].items()})
    return scores


def peak_memory(accelerator: str | None = None) -> dict:
    """This rank's peak memory: CUDA max allocated/reserved on a GPU, resident set size on the CPU."""
    import resource

    import torch

    info = {"rank": rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "host": socket.gethostname()}
    info["cpu_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if (accelerator or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        info["device"] = torch.cuda.get_device_name()
        info["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        info["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        info["device"] = "cpu"
    return info


def pin_to_one_gpu(training_args) -> None:
    """One process that sees several GPUs trains on the first only: the Trainer would wrap the model in nn.DataParallel
    (slow, and every figure of the run would describe one process driving several GPUs). Use all of them with one rank
    per GPU: `textsql.train.local_launch.run_training(argv)` (the notebooks' way) or `deepspeed --num_gpus N --module textsql.train`."""
    if training_args.world_size == 1 and training_args.n_gpu > 1:
        logger.warning(
            "%d GPUs are visible to this one process; training on %s only. To train on all of them, start one "
            "rank per GPU (textsql.train.local_launch.run_training, or `deepspeed --num_gpus %d --module textsql.train ...`).",
            training_args.n_gpu,
            training_args.device,
            training_args.n_gpu,
        )
        training_args._n_gpu = 1


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on the GPU may use TF32 in this process (what really runs, not what was asked)."""
    import torch

    if not torch.cuda.is_available():
        return False
    return torch.backends.cuda.matmul.fp32_precision == "tf32" or bool(torch.backends.cuda.matmul.allow_tf32)


def save_final_model(trainer, output_dir: Path, dtype: str) -> None:
    """Save the trained weights in one dtype whatever the strategy ran (fp32 by default), with the tokenizer; every rank
    calls it. FSDP2 holds fp32 shards, gathered whole on rank 0. DeepSpeed holds the fp32 master weights in its
    optimizer (the module itself is bf16 under bf16 ZeRO-1/2, and placeholders under ZeRO-3): they are read with
    safe_get_full_fp32_param, collectively under ZeRO-3. The result loads without DeepSpeed or FSDP, so scores compare
    across strategies and the model can be fine-tuned again on any strategy.
    """
    import torch

    target = getattr(torch, dtype)
    model = trainer.model
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, param in model.named_parameters():  # the same order on every rank: each call is a collective
            full = safe_get_full_fp32_param(param)
            state[name] = (
                (param if full is None else full).detach().to("cpu", target)
            )  # None: a frozen ZeRO-1/2 parameter, whole
    elif trainer.is_fsdp_enabled:
        state = full_state_dict(model, target)  # FSDP2's fp32 shards gathered on rank 0, collectively
    else:
        state = {name: param.detach().to("cpu", target) for name, param in model.named_parameters()}
    # Under FSDP only rank 0 holds the gathered weights.
    each_node = trainer.args.save_on_each_node and trainer.is_local_process_zero() and not trainer.is_fsdp_enabled
    if trainer.is_world_process_zero() or each_node:
        model.save_pretrained(str(output_dir), state_dict=state, safe_serialization=True)
        # save_pretrained records the module's dtype (bf16 under DeepSpeed bf16); from_pretrained(dtype="auto") reads it.
        model.config.dtype = dtype
        model.config.save_pretrained(str(output_dir))
        trainer.processing_class.save_pretrained(str(output_dir))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
