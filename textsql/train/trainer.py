"""The Trainer textsql trains with (Seq2SeqTrainer or Trainer by the model family; one optimizer step's loss over all
its label tokens whatever the accumulation and ranks, real tokens and throughput logged, execution accuracy at the end
of training or at each evaluation), the final model saved in one dtype whatever the strategy, and each rank's peak memory."""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from pathlib import Path

from textsql.evaluate import decode_and_score
from textsql.families import Family, family_named
from textsql.train.collate import TOKEN_COUNTS_KEY, CountTokens
from textsql.train.distributed import rank
from textsql.train.fsdp import accelerate_fsdp2_kwargs, full_state_dict, group_tied_embeddings, synced_generation
from textsql.train.speed import TOKEN_COUNTS, apply_speed, mfu_figures, training_flops

logger = logging.getLogger("textsql.train")


def forward_divides_by_token_count(model) -> bool:
    """Whether the model's forward turns the Trainer's `num_items_in_batch` (the real label tokens of the whole optimizer
    step) into its loss: the sum over its micro-batch's tokens divided by it. transformers' causal LMs do, through
    `self.loss_function`; T5 takes the keyword into its **kwargs and drops it, returning the mean over its own
    micro-batch's tokens. A class that says so (`accepts_loss_kwargs`) is believed; `model` is unwrapped (no peft)."""
    declared = getattr(model, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    return "loss_function" in inspect.unwrap(type(model).forward).__code__.co_names


def make_trainer_class(family: Family = None):
    """The family's Trainer (Seq2SeqTrainer for T5, Trainer for causal LMs; T5's without a family) whose step's loss is
    one batch's whatever the accumulation and ranks, that counts real (non-pad) tokens and logs throughput to
    TensorBoard."""
    import transformers

    family = family or family_named("t5")

    class TextsqlTrainer(getattr(transformers, family.trainer_class_name)):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.real_tokens = 0
            # The tokens of each batch, counted on the host as the collator makes it (CountTokens): no device work
            # and no sync per step; they also give the step's FLOPs (textsql.train.speed.training_flops).
            self.token_counts = dict.fromkeys(TOKEN_COUNTS, 0)
            self._pending_tokens = 0
            self._last_log = (time.perf_counter(), 0, 0)
            self._parameters_for_flops = None
            if self.data_collator is not None:
                self.data_collator = CountTokens(self.data_collator)
            apply_speed(self, family)
            from transformers.loss.loss_utils import ForCausalLMLoss
            from transformers.trainer_utils import unwrap_peft_model

            base = unwrap_peft_model(self.model)
            self.forward_divides_by_token_count = forward_divides_by_token_count(base)
            if self.forward_divides_by_token_count and not getattr(base.config, "is_encoder_decoder", False):
                # The step's tokens counted as the model's loss function counts them: a causal LM's first position
                # predicts nothing. The Trainer tells from the class name (loss_type), which GPT-2's does not carry.
                self._loss_shifts_labels = getattr(base, "loss_function", None) is ForCausalLMLoss

        execution_scoring = None  # a textsql.evaluate.ScoringSet when execution accuracy is scored
        execution_each_evaluation = False  # scored at every evaluation, not only on the final weights
        execution_decoding = {"decoding": "greedy", "num_beams": 1, "max_new_tokens": 128}
        last_evaluation = None  # (global step, metrics) of the latest evaluate()

        def evaluate(self, *args, **kwargs):
            metrics = super().evaluate(*args, **kwargs)
            if self.execution_scoring is not None and self.execution_each_evaluation:
                metrics.update(self.logged_sql_scores())
            self.last_evaluation = (self.state.global_step, dict(metrics))
            return metrics

        def final_evaluation(self) -> dict:
            """The final weights' metrics: those of the evaluation training ended with when it fell on the last step (the same
            weights; scoring them again costs a whole generation pass on a large model), else a new evaluation; and
            their SQL scored where that evaluation did not (the default: only here, once)."""
            step, metrics = self.last_evaluation or (None, None)
            if step != self.state.global_step or self.args.load_best_model_at_end:
                metrics = self.evaluate()
            if self.execution_scoring is not None and "eval_execution_accuracy" not in metrics:
                metrics = {**metrics, **self.logged_sql_scores()}
            return metrics

        def logged_sql_scores(self) -> dict:
            """sql_scores(), logged as the evaluation's metrics are (TensorBoard, MLflow, the log history)."""
            scores = self.sql_scores()
            self.log(scores)
            return scores

        def _prepare_for_training(self, *args, **kwargs):
            # Before accelerate wraps the model (inside the Trainer's preparation): T5's tied embeddings in one unit.
            fsdp2 = self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2
            if fsdp2 and not family.causal:  # a causal LM ties two modules at most, which accelerate groups itself
                if group_tied_embeddings(self.model, **accelerate_fsdp2_kwargs(self.accelerator)):
                    logger.info("FSDP: T5's tied embeddings (shared, embed_tokens, lm_head) form one FSDP unit")
            return super()._prepare_for_training(*args, **kwargs)

        def sql_scores(self) -> dict:
            """WikiSQL's scores of the scoring set as eval metrics: execution and logical-form accuracy, exact match, and
            the share of each part of the query right (eval_sql_<component>). Every rank generates the same questions:
            under ZeRO-3 and FSDP they must step through generate() together."""
            from transformers.integrations import is_deepspeed_zero3_enabled

            decoding = self.execution_decoding
            _, metrics = decode_and_score(
                self.accelerator.unwrap_model(self.model),
                self.processing_class,
                self.execution_scoring,
                decoding=decoding["decoding"],
                num_beams=decoding["num_beams"],
                max_new_tokens=decoding["max_new_tokens"],
                batch_size=self.args.per_device_eval_batch_size,
                synced_gpus=synced_generation(is_deepspeed_zero3_enabled(), self.is_fsdp_enabled, self.args.world_size),
                progress=False,
                device=self.args.device,
            )
            scores = {
                f"eval_{name}": metrics[name] for name in ("execution_accuracy", "logical_form_accuracy", "exact_match")
            }
            scores.update({f"eval_sql_{name}": share for name, share in metrics["components"].items()})
            return scores

        flops_profiling = None  # a textsql.train.dstools.FlopsProfilerCallback profiling a step without DeepSpeed

        def _prepare_inputs(self, inputs):
            # The batch's token counts (CountTokens) are the trainer's, never the model's: taken out here, where
            # training and evaluation batches both pass; counted for training only.
            counts = inputs.pop(TOKEN_COUNTS_KEY, None)
            if counts is not None and self.model.training:
                for name, value in zip(TOKEN_COUNTS, counts):
                    self.token_counts[name] += value
                self._pending_tokens += counts[0] + (0 if family.causal else counts[1])
            return super()._prepare_inputs(inputs)

        def floating_point_ops(self, inputs) -> int:
            # The Trainer asks this for every micro-batch (total_flos in the run's metrics); transformers counts the
            # model's parameters again on each call, a walk over every parameter per step. Counted once here.
            main = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
            if main is None or not hasattr(self.model, "num_parameters"):
                return 0
            if self._parameters_for_flops is None:
                self._parameters_for_flops = self.model.num_parameters(exclude_embeddings=True)
            return 6 * main.numel() * self._parameters_for_flops

        def mfu_figures(self, seconds: float, gpu: str | None, precision: str, tf32: bool) -> dict:
            """run_summary.json's `mfu`: this rank's model FLOPs over the training time, against the GPU's peak."""
            config = self.accelerator.unwrap_model(self.model).config
            at_labels = getattr(self.args, "fused_loss", "none") != "none"
            flops = training_flops(config, self.token_counts, logits_at_labels=at_labels)
            return dict(mfu_figures(flops, seconds, gpu, precision, tf32), token_counts=dict(self.token_counts))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            """Each micro-batch's share of its optimizer step's loss: the sum of its label tokens' losses divided by
            `num_items_in_batch`, the real (non -100) label tokens of the step (every micro-batch it accumulates, and
            every rank's with average_tokens_across_devices, when the Trainer also multiplies by the world size to
            undo the ranks' gradient averaging). Summed over the accumulation, that is the loss of the whole batch at
            once, in value, gradient and update (docs/training.md, "Gradient accumulation and several ranks"). A
            forward that ignores the count (T5's) returns its micro-batch's mean: weighted here by its share of the
            tokens, where the Trainer would add the accumulated means and so multiply the step's loss and gradient by
            the accumulation."""
            if (
                num_items_in_batch is None  # the Trainer divides each micro-batch's mean by the accumulation itself
                or self.forward_divides_by_token_count
                or self.label_smoother is not None
                or self.compute_loss_func is not None
            ):
                return self._model_loss(model, inputs, return_outputs, num_items_in_batch)
            # Counted as the Trainer counts num_items_in_batch (a causal LM's first position predicts nothing).
            labels = inputs.get("shift_labels")
            if labels is None:
                labels = inputs["labels"][..., 1:] if self._loss_shifts_labels else inputs["labels"]
            tokens = labels.ne(-100).sum()
            loss, outputs = self._model_loss(model, inputs, True, num_items_in_batch)
            loss = loss * tokens.to(loss.device) / num_items_in_batch
            return (loss, outputs) if return_outputs else loss

        def _model_loss(self, model, inputs, return_outputs, num_items_in_batch):
            """The Trainer's loss: the forward, profiled alone when the flops profiler runs without DeepSpeed (as the
            DeepSpeed engine profiles it)."""
            if self.flops_profiling is None:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with self.flops_profiling.forward():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def log(self, logs, start_time=None):
            self.real_tokens += self._pending_tokens
            self._pending_tokens = 0
            now, last_step, last_tokens = time.perf_counter(), *self._last_log[1:]
            last_time = self._last_log[0]
            if "loss" in logs and self.state.global_step > last_step and now > last_time:
                steps = self.state.global_step - last_step
                samples = (
                    steps * self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
                )
                logs["samples_per_second"] = round(samples / (now - last_time), 3)
                # Rank 0's real tokens times the world size: the others see batches of the same distribution.
                logs["real_tokens_per_second"] = round(
                    (self.real_tokens - last_tokens) * self.args.world_size / (now - last_time), 1
                )
                self._last_log = (now, self.state.global_step, self.real_tokens)
            super().log(logs, start_time)

    return TextsqlTrainer


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
