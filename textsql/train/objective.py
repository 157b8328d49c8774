"""What every training objective (textsql.train.sft, textsql.train.grpo) builds from and hands back, and what they
load alike: the prepared splits and tokenizer, the base model (fp32, or QLoRA's quantized base), LoRA's wrapping, and
the model made ready for the dataset (its source settings, the embeddings grown for added characters)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from textsql.adapter_record import adapter_record, base_fingerprint
from textsql.adapters import apply_lora, parameter_counts
from textsql.arguments.training import DataArguments, ModelArguments, TextsqlTrainingArguments
from textsql.families import Family, family_of
from textsql.hub import load_model
from textsql.loading import load_quantized_base
from textsql.prepared import load_prepared, tokenizer_for_training
from textsql.prompts import check_source_settings, record_source_settings
from textsql.strategy.devices import quantized_compute_dtype
from textsql.train.fsdp import wrapped_layer_classes
from textsql.vocabulary import added_token_ids, fit_embeddings

logger = logging.getLogger("textsql.train")


@dataclass
class Inputs:
    """What an objective builds its trainer from: the arguments (training's finalized for this process, and as given:
    GRPO builds TRL's config from those) and what textsql.train.run.set_up_run decided (device, folder, strategy)."""

    model: ModelArguments
    data: DataArguments
    training: TextsqlTrainingArguments
    given: TextsqlTrainingArguments
    plan: object  # textsql.train.run.RunSetup (run imports this module)


@dataclass
class Built:
    """What an objective hands the run: its trainer (final_evaluation, tokens_read, summary_figures and flops_profiler
    besides the Trainer's own), the LoRA adapter's record (the adapter is saved instead of the model; None for a whole
    model), the prepared dataset's metadata and the model's family."""

    trainer: object
    adapter: dict | None
    data_meta: dict
    family: Family


def load_training_data(data: DataArguments, model_tokenizer):
    """(train split, validation split or None, metadata, tokenizer): only the model's columns, and the tokenizer to train
    with (the model's own, or prep's copy with the characters it lacked; see textsql.prepared.tokenizer_for_training)."""

    dataset, metadata = load_prepared(data.dataset_dir)
    tokenizer = tokenizer_for_training(model_tokenizer, data.dataset_dir, metadata)
    columns = ["input_ids", "attention_mask", "labels"]
    train = dataset["train"].select_columns(columns)
    if data.max_train_samples:
        train = train.select(range(min(data.max_train_samples, len(train))))
    evaluation = dataset["validation"].select_columns(columns) if "validation" in dataset else None
    if evaluation is not None and data.max_eval_samples:
        evaluation = evaluation.select(range(min(data.max_eval_samples, len(evaluation))))
    return train, evaluation, metadata, tokenizer


def load_base_model(model_id: str, training_args: TextsqlTrainingArguments, plan):
    """The model to train: in fp32, or for QLoRA (--quantize_base) quantized, computing in bf16 on Ampere and newer
    GPUs and fp32 elsewhere, its 4-bit weights stored in that dtype where ZeRO-3 or FSDP shards them (`plan`: the
    run's textsql.train.run.RunSetup)."""
    if training_args.quantize_base == "none":
        import torch

        # fp32 whatever the checkpoint's config says (Qwen2.5 and Llama save bf16, bloom and opt fp16; transformers 5
        # loads that dtype by default): the optimizer's states and updates need fp32 weights, and --precision's
        # mixed precision (autocast, DeepSpeed's bf16) computes in the lower dtype from them.
        return load_model(model_id, dtype=torch.float32)
    sharded = plan.strategy.get("zero_stage") == 3 or plan.fsdpconfig is not None
    gpus = plan.devices.gpus if plan.accelerator == "cuda" else ()
    # bitsandbytes quantizes while loading onto the rank's own GPU; ZeRO-3 and FSDP place the shards themselves
    placement = {"device_map": {"": training_args.local_process_index}} if gpus and not sharded else {}
    compute = quantized_compute_dtype(gpus)
    return load_quantized_base(model_id, training_args.quantize_base, compute, sharded, **placement)


def ready_model(model, tokenizer, data_meta: dict, inputs: Inputs) -> Family:
    """Make the loaded model ready for the prepared dataset and return its family (seq2seq or causal: the collator and
    the Trainer follow): the source settings checked and recorded, the embeddings grown for the characters prep added
    to the tokenizer, the KV cache off under activation checkpointing."""
    from transformers import set_seed

    family = family_of(model.config)
    if inputs.plan.fsdpconfig is not None:
        logger.info("FSDP units: %s", ", ".join(wrapped_layer_classes(model, inputs.plan.fsdpconfig)))
    check_source_settings(model.config, data_meta, inputs.data.dataset_dir)
    record_source_settings(model.config, data_meta)  # every saved copy of the model says what it reads
    # The rows grown for the added characters are drawn at random: from the seed alone, whatever the strategy drew
    # while loading (zero.Init does), so a LoRA adapter, which trains those rows from there, is the same under each.
    set_seed(inputs.training.seed)
    if fit_embeddings(model, tokenizer):
        logger.info("Grew the embeddings to %d ids for the characters prep added to the tokenizer", len(tokenizer))
    if inputs.training.activation_checkpointing:
        model.config.use_cache = False
    return family


def wrap_for_lora(model, model_args, training_args, tokenizer, model_tokenizer):
    """(the model wrapped by peft, the adapter's record): LoRA on the preset's layers, and the rows of the characters
    prep added to the tokenizer trained (the base model never trained them; frozen, it could never write them)."""
    token_ids = added_token_ids(tokenizer, model_tokenizer)
    # of the checkpoint's files, whatever the strategy holds in memory
    fingerprint = base_fingerprint(model_args.model_id)
    from transformers import set_seed

    # The adapter's initial values depend on the seed only: every rank, every strategy starts from the same adapter
    # (ZeRO-3 partitions each rank's own copy without a broadcast; loading under zero.Init draws random numbers).
    set_seed(training_args.seed)
    peft_model = apply_lora(model, training_args, token_ids)
    if training_args.activation_checkpointing:
        peft_model.enable_input_require_grads()  # the frozen embedding's output must carry gradients into checkpointed blocks
    trainable, total = parameter_counts(peft_model)
    logger.info(
        "LoRA r=%d alpha=%g on %s: %d of %d parameters train (%.2f%%), %d embedding rows of added characters among them",
        training_args.lora_rank,
        training_args.lora_alpha,
        training_args.lora_targets,
        trainable,
        total,
        100 * trainable / total,
        len(token_ids),
    )
    base_model = str(Path(model_args.model_id).resolve()) if Path(model_args.model_id).is_dir() else model_args.model_id
    return peft_model, adapter_record(peft_model, training_args, base_model, tokenizer, token_ids, fingerprint)
