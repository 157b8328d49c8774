"""Supervised fine-tuning (`--stage sft`, the default): textsql's Trainer (Seq2SeqTrainer or Trainer by the model
family; one optimizer step's loss over all its label tokens whatever the accumulation and ranks, real tokens and
throughput logged, SQL scored at the end of training or at each evaluation) and the stage's build: the prepared
splits, the model (LoRA-wrapped when asked), the collator."""

from __future__ import annotations

import inspect
import logging
import time

from transformers import Seq2SeqTrainer, Trainer

from textsql.errors import TextsqlError
from textsql.families import Family, family_of
from textsql.hub import load_tokenizer
from textsql.train import watch
from textsql.train.collate import TOKEN_COUNTS_KEY, CountTokens, make_collator
from textsql.train.distributed import gather_fields
from textsql.train.dstools import flops_profiler_for
from textsql.train.fsdp import accelerate_fsdp2_kwargs, group_tied_embeddings
from textsql.train.objective import Built, Inputs, load_base_model, load_training_data, ready_model, wrap_for_lora
from textsql.train.speed import TOKEN_COUNTS, apply_speed, mfu_figures, training_flops, with_label_positions
from textsql.train.trainer import SqlScoring, sql_scores

logger = logging.getLogger("textsql.train")


def build(inputs: Inputs) -> Built:
    """The supervised run's trainer: the prepared train and validation splits, the base model (fp32, or QLoRA's
    quantized base) made ready and wrapped in a LoRA adapter when --lora asks, the family's collator, and the
    validation questions its SQL is scored on."""
    model_args, data_args, training_args, plan = inputs.model, inputs.data, inputs.training, inputs.plan
    model_tokenizer = load_tokenizer(model_args.model_id)
    train_set, eval_set, data_meta, tokenizer = load_training_data(data_args, model_tokenizer)
    if eval_set is None and training_args.eval_strategy != "no":
        raise TextsqlError(
            f"'{data_args.dataset_dir}' has no validation split; pass --eval_strategy no to train without evaluation."
        )
    model = load_base_model(model_args.model_id, training_args, plan)
    family = ready_model(model, tokenizer, data_meta, inputs)
    adapter = None
    if training_args.lora:
        model, adapter = wrap_for_lora(model, model_args, training_args, tokenizer, model_tokenizer)
    multiple = 8 if plan.accelerator == "cuda" else None
    collator = make_collator(family, tokenizer, model, packing=training_args.packing, pad_to_multiple_of=multiple)
    trainer = trainer_class(family)(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        processing_class=tokenizer,
        sql_scoring=SqlScoring.for_run(data_args, data_meta, eval_set is not None),
    )
    return Built(trainer, adapter, data_meta, family)


def forward_divides_by_token_count(model) -> bool:
    """Whether the model's forward turns the Trainer's `num_items_in_batch` (the real label tokens of the whole optimizer
    step) into its loss: the sum over its micro-batch's tokens divided by it. transformers' causal LMs do, through
    `self.loss_function`; T5 takes the keyword into its **kwargs and drops it, returning the mean over its own
    micro-batch's tokens. A class that says so (`accepts_loss_kwargs`) is believed; `model` is unwrapped (no peft)."""
    declared = getattr(model, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    return "loss_function" in inspect.unwrap(type(model).forward).__code__.co_names


class SupervisedTraining:
    """textsql's supervised Trainer, mixed into transformers' Trainer or Seq2SeqTrainer (TextsqlTrainer,
    TextsqlSeq2SeqTrainer): a step's loss is one batch's whatever the accumulation and ranks, real (non-pad) tokens
    are counted and throughput logged to TensorBoard, the speed levers applied, and the SQL of `sql_scoring`'s
    questions scored (textsql.train.trainer.sql_scores) on the final weights or at every evaluation."""

    def __init__(self, *args, sql_scoring: SqlScoring | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        from transformers.loss.loss_utils import ForCausalLMLoss
        from transformers.trainer_utils import unwrap_peft_model

        base = unwrap_peft_model(self.model)
        self.family: Family = family_of(base.config)
        self.sql_scoring = sql_scoring
        self.last_evaluation = None  # (global step, metrics) of the latest evaluate()
        self.real_tokens = 0
        # The tokens of each batch, counted on the host as the collator makes it (CountTokens): no device work
        # and no sync per step; they also give the step's FLOPs (textsql.train.speed.training_flops).
        self.token_counts = dict.fromkeys(TOKEN_COUNTS, 0)
        self._pending_tokens = 0
        self._last_log = (time.perf_counter(), 0, 0)
        self._parameters_for_flops = None
        if self.data_collator is not None:
            self.data_collator = CountTokens(self.data_collator)
        apply_speed(self, self.family)
        self.data_collator = with_label_positions(self.args, self.data_collator)
        # a FlopsProfilerCallback profiling --flops_profiler's step, or None; without DeepSpeed it profiles each
        # forward of the step through compute_loss
        self.flops_profiler = flops_profiler_for(self)
        self.forward_divides_by_token_count = forward_divides_by_token_count(base)
        if self.forward_divides_by_token_count and not getattr(base.config, "is_encoder_decoder", False):
            # The step's tokens counted as the model's loss function counts them: a causal LM's first position
            # predicts nothing. The Trainer tells from the class name (loss_type), which GPT-2's does not carry.
            self._loss_shifts_labels = getattr(base, "loss_function", None) is ForCausalLMLoss

    def evaluate(self, *args, **kwargs):
        metrics = super().evaluate(*args, **kwargs)
        if self.sql_scoring is not None and self.sql_scoring.each_evaluation:
            # after the Trainer's on_evaluate, which ended the evaluation's phase: the scoring is one too
            with watch.phase("evaluation", after=watch.current()["name"]):
                metrics.update(self.logged_sql_scores())
        self.last_evaluation = (self.state.global_step, dict(metrics))
        return metrics

    def final_evaluation(self) -> dict:
        """The final weights' metrics ({} without a validation split): those of the evaluation training ended with
        when it fell on the last step (the same weights; scoring them again costs a whole generation pass on a large
        model), else a new evaluation; and their SQL scored where that evaluation did not (the default: only here,
        once)."""
        if self.eval_dataset is None:
            return {}
        step, metrics = self.last_evaluation or (None, None)
        if step != self.state.global_step or self.args.load_best_model_at_end:
            metrics = self.evaluate()
        if self.sql_scoring is not None and "eval_execution_accuracy" not in metrics:
            metrics = {**metrics, **self.logged_sql_scores()}
        return metrics

    def sql_scores(self) -> dict:
        """WikiSQL's scores of the scoring set as eval metrics (textsql.train.trainer.sql_scores)."""
        return sql_scores(self, self.sql_scoring)

    def logged_sql_scores(self) -> dict:
        """sql_scores(), logged as the evaluation's metrics are (TensorBoard, MLflow, the log history)."""
        scores = self.sql_scores()
        self.log(scores)
        return scores

    def tokens_read(self) -> int:
        """The real (non-pad) tokens every rank trained on; every rank calls it (it gathers)."""
        return sum(r["real_tokens"] for r in gather_fields({"real_tokens": int(self.real_tokens)}))

    def summary_figures(self, summary) -> None:
        """The stage's own figures in the run summary: the run's model FLOPs and MFU (textsql.train.speed)."""
        gpu = summary.peak_memory_per_rank[0].get("device") if summary.device == "cuda" else None
        summary.mfu = self.mfu_figures(summary.train_runtime, gpu, summary.precision, summary.tf32)

    def _prepare_for_training(self, *args, **kwargs):
        # Before accelerate wraps the model (inside the Trainer's preparation): T5's tied embeddings in one unit.
        fsdp2 = self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2
        if fsdp2 and not self.family.causal:  # a causal LM ties two modules at most, which accelerate groups itself
            if group_tied_embeddings(self.model, **accelerate_fsdp2_kwargs(self.accelerator)):
                logger.info("FSDP: T5's tied embeddings (shared, embed_tokens, lm_head) form one FSDP unit")
        return super()._prepare_for_training(*args, **kwargs)

    def _prepare_inputs(self, inputs):
        # The batch's token counts (CountTokens) are the trainer's, never the model's: taken out here, where
        # training and evaluation batches both pass; counted for training only.
        counts = inputs.pop(TOKEN_COUNTS_KEY, None)
        if counts is not None and self.model.training:
            for name, value in zip(TOKEN_COUNTS, counts):
                self.token_counts[name] += value
            self._pending_tokens += counts[0] + (0 if self.family.causal else counts[1])
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
        if self.flops_profiler is None or self.flops_profiler.deepspeed:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.flops_profiler.forward():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def log(self, logs, start_time=None):
        self.real_tokens += self._pending_tokens
        self._pending_tokens = 0
        now, last_step, last_tokens = time.perf_counter(), *self._last_log[1:]
        last_time = self._last_log[0]
        if "loss" in logs and self.state.global_step > last_step and now > last_time:
            steps = self.state.global_step - last_step
            samples = steps * self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
            logs["samples_per_second"] = round(samples / (now - last_time), 3)
            # Rank 0's real tokens times the world size: the others see batches of the same distribution.
            logs["real_tokens_per_second"] = round(
                (self.real_tokens - last_tokens) * self.args.world_size / (now - last_time), 1
            )
            self._last_log = (now, self.state.global_step, self.real_tokens)
        super().log(logs, start_time)


class TextsqlTrainer(SupervisedTraining, Trainer):
    """Supervised fine-tuning of a causal LM (SupervisedTraining on transformers' Trainer)."""


class TextsqlSeq2SeqTrainer(SupervisedTraining, Seq2SeqTrainer):
    """Supervised fine-tuning of an encoder-decoder model, T5 (SupervisedTraining on transformers' Seq2SeqTrainer)."""


TRAINER_CLASSES = {"Trainer": TextsqlTrainer, "Seq2SeqTrainer": TextsqlSeq2SeqTrainer}


def trainer_class(family: Family) -> type:
    """The supervised Trainer class for the model family (its base class as the family names it)."""
    return TRAINER_CLASSES[family.trainer_class_name]
