"""The GRPO stage (`textsql train --stage grpo`): TRL's GRPOTrainer on a finished run's model (a LoRA run's adapter
trained on, a full or merged model trained whole), the prepared dataset's prompts, and rewards from executing each
completion on its question's table (textsql.rewards); its final weights' SQL scored as a supervised run's are, and its
figures for the run summary. textsql.train.run imports this module only for --stage grpo (TRL is the grpo extra)."""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path

from textsql.adapter_record import is_adapter_folder, read_adapter_record
from textsql.arguments.grpo import reward_weights
from textsql.errors import TextsqlError
from textsql.extras import require_grpo_extra
from textsql.families import family_of
from textsql.hub import load_config, load_tokenizer
from textsql.loading import load_folder, read_folder
from textsql.paths import SUMMARY_FILE
from textsql.prepared import load_prepared, load_tables
from textsql.rewards import SqlRewards
from textsql.train.distributed import rank
from textsql.train.dstools import flops_profiler_for
from textsql.train.objective import Built, Inputs, load_base_model, load_training_data, ready_model, wrap_for_lora
from textsql.train.trainer import SqlScoring, sql_scores

require_grpo_extra()  # before TRL's import: without the extra, one paragraph naming it
from trl import GRPOTrainer  # noqa: E402

logger = logging.getLogger("textsql.train")

GRPO_COLUMNS = ("prompt", "table_id", "sql", "target")  # what generation reads and the rewards score against
# The logged figures a run summary keeps, each step's and the last: the weighted reward's mean and std, KL, completion
# length, the share of groups whose completions all earned the same weighted reward (TRL's frac_reward_zero_std) and
# the share whose completions are all right or all wrong (frac_execution_zero_std, textsql's: no execution signal,
# whatever the bonus says).
GRPO_FIGURES = (
    "reward",
    "reward_std",
    "rewards/execution/mean",
    "frac_execution_zero_std",
    "frac_reward_zero_std",
    "kl",
    "completions/mean_length",
    "completions/clipped_ratio",
)
ZERO_SIGNAL = "frac_execution_zero_std"


def check_grpo_model(model_id: str) -> None:
    """Refuses a model GRPO cannot train (T5), reading its config, or a LoRA run's base model's."""
    config = load_config(read_adapter_record(model_id)["base_model"] if is_adapter_folder(model_id) else model_id)
    family = family_of(config)
    if not family.causal:
        raise TextsqlError(
            f"--stage grpo trains causal LMs only (TRL's GRPOTrainer generates with a decoder-only model), and "
            f"'{model_id}' is a {family.name} model. Fine-tune it with the default --stage sft, or start GRPO from a "
            "causal LM's run (docs/grpo.md)."
        )


def parent_run(model_id: str) -> str | None:
    """The textsql run a GRPO stage starts from: the model folder when a run or merge wrote it, else None."""
    folder = Path(model_id)
    return str(folder.resolve()) if (folder / SUMMARY_FILE).is_file() or is_adapter_folder(folder) else None


def grpo_dataset(dataset_dir: str, max_samples: int | None, start: int = 0):
    """(the train split's prompts with their tables' ids and gold queries, the tables): what GRPO generates from and
    rewards against, from question `start` on (--grpo_questions_from), at most `max_samples`. Refuses a dataset
    prepared for T5 (no prompt column), and a start past the split's end."""
    dataset, _ = load_prepared(dataset_dir)
    train = dataset["train"]
    missing = [column for column in GRPO_COLUMNS if column not in train.column_names]
    if missing:
        raise TextsqlError(
            f"'{dataset_dir}' has no {', '.join(missing)} column(s): GRPO needs a dataset prepared for a causal LM "
            "from the release files (prompts and tables). Prepare it with `textsql prep --model_id <the causal model> "
            "--source_format question+header`."
        )
    train = train.select_columns(list(GRPO_COLUMNS))
    if start:
        if start >= len(train):
            raise TextsqlError(
                f"--grpo_questions_from {start} is past the train split's {len(train)} questions of '{dataset_dir}': "
                "give a smaller index (the supervised run's --max_train_samples), or leave it out for all of them."
            )
        train = train.select(range(start, len(train)))
    if max_samples:
        train = train.select(range(min(max_samples, len(train))))
    return train, load_tables(dataset_dir)


LEARNABLE_FILE = "learnable.json"  # each train question's success rate before GRPO (--learnable_only)


def success_rates(
    model,
    tokenizer,
    train_set,
    tables,
    samples: int,
    temperature: float,
    max_new_tokens: int,
    *,
    batch_questions: int = 8,
    seed: int = 0,
    eos_ids=None,
) -> list[float]:
    """Each question's share of `samples` completions, sampled at `temperature` as GRPO samples them, that the execution
    reward pays (textsql.rewards). Seeded (every rank draws the same) and without touching the global RNG."""
    import torch

    rewards = SqlRewards(tables, eos_ids or [tokenizer.eos_token_id])
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    rates = []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            model_was_training = model.training
            model.eval()
            device = next(model.parameters()).device
            for start in range(0, len(train_set), batch_questions):
                rows = train_set.select(range(start, min(start + batch_questions, len(train_set))))
                encoded = tokenizer(list(rows["prompt"]), return_tensors="pt", padding=True).to(device)
                out = model.generate(
                    **encoded,
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    num_return_sequences=samples,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
                )
                texts = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
                repeat = [value for value in range(len(rows)) for _ in range(samples)]
                paid = rewards.execution(
                    texts,
                    table_id=[rows["table_id"][i] for i in repeat],
                    sql=[rows["sql"][i] for i in repeat],
                    target=[rows["target"][i] for i in repeat],
                )
                rates += [sum(paid[i * samples : (i + 1) * samples]) / samples for i in range(len(rows))]
            model.train(model_was_training)
    finally:
        tokenizer.padding_side = side
    return rates


def learnable_statistics(rates: list[float], samples: int) -> dict:
    """What the success rates say: questions, those with 0 < success < 1 (kept by --learnable_only), the shares at 0
    and at 1, the mean, and how many questions at each rate (k/samples)."""
    total = len(rates)
    counts = {f"{k}/{samples}": sum(1 for r in rates if round(r * samples) == k) for k in range(samples + 1)}
    return {
        "questions": total,
        "samples": samples,
        "kept": sum(1 for r in rates if 0 < r < 1),
        "share_at_0": sum(1 for r in rates if r == 0) / total if total else None,
        "share_at_1": sum(1 for r in rates if r == 1) / total if total else None,
        "mean_success": sum(rates) / total if total else None,
        "distribution": counts,
    }


def learnable_questions(model, tokenizer, train_set, tables, training_args, output_dir) -> tuple:
    """(the train questions GRPO trains on, the filter's statistics for the summary): with --learnable_only, those the
    starting model gets right some of the time only, each question's rate written to LEARNABLE_FILE (read back when
    the run resumes). Without it, every question and None."""
    if not training_args.learnable_only:
        return train_set, None
    samples = training_args.learnable_samples or training_args.num_generations
    path = Path(output_dir) / LEARNABLE_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    start = training_args.grpo_questions_from
    recorded = (record.get("samples"), record.get("questions_from", 0), len(record.get("rates", [])))
    if recorded != (samples, start, len(train_set)):  # measured for other questions or sample counts: measure again
        rates = success_rates(
            model, tokenizer, train_set, tables, samples, training_args.temperature,
            training_args.max_completion_length, seed=training_args.seed,
        )  # fmt: skip
        record = {"samples": samples, "temperature": training_args.temperature, "questions_from": start, "rates": rates}
        if rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record) + "\n")
    statistics = {**learnable_statistics(record["rates"], samples), "file": str(path)}
    kept = [i for i, rate in enumerate(record["rates"]) if 0 < rate < 1]
    if not kept:
        raise TextsqlError(
            f"--learnable_only True kept no question: the starting model gets all {len(train_set)} train questions "
            f"always right ({statistics['share_at_1']:.0%}) or always wrong ({statistics['share_at_0']:.0%}) in "
            f"{samples} samples. Use more questions (--max_train_samples), more --learnable_samples, or a higher "
            "--temperature, or leave --learnable_only out."
        )
    logger.info(
        "--learnable_only: %d of %d train questions kept (0 < success < 1 in %d samples); at 0: %.0f%%, at 1: %.0f%%",
        len(kept), len(train_set), samples, 100 * statistics["share_at_0"], 100 * statistics["share_at_1"],
    )  # fmt: skip
    return train_set.select(kept), statistics


def policy_model(model_id: str, training_args, load_full, wrap_for_lora):
    """(the model GRPO trains, the adapter record to save it with, or None for a whole model). A LoRA run's adapter
    is trained on (its base quantized again where it was a QLoRA run); a whole model is trained whole, or wrapped in a
    new adapter with --lora True. `load_full` and `wrap_for_lora` are textsql.train.objective's loaders."""
    if is_adapter_folder(model_id):
        folder = read_folder(model_id)
        if training_args.quantize_base not in ("none", folder.quantize_base):
            raise TextsqlError(
                f"'{model_id}' is a {'QLoRA' if folder.quantize_base != 'none' else 'LoRA'} run on a "
                f"{folder.quantize_base} base; GRPO continues its adapter on that base. Leave --quantize_base out."
            )
        if training_args.lora and training_args.lora_settings() != folder.record.get("lora"):
            logger.info(
                "--stage grpo continues the adapter of %s with its own settings: %s",
                model_id,
                folder.record.get("lora"),
            )
        model, _ = load_folder(folder, trainable=True)  # left on the CPU for the Trainer; its folders' pickles checked
        return model, folder.record
    model = load_full()
    if training_args.lora:
        return wrap_for_lora(model)
    return model, None


def grpo_config(training_args, decided: dict):
    """TRL's GRPOConfig: every TrainingArguments value of `training_args` (not finalized), textsql's decisions for the
    run (precision, CPU, folder, DeepSpeed), and the stage's own settings."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    values = {f.name: getattr(training_args, f.name) for f in fields(TrainingArguments) if f.init}
    values.update(decided)
    values.update(
        num_generations=training_args.num_generations,
        max_completion_length=training_args.max_completion_length,
        temperature=training_args.temperature,
        beta=training_args.beta,
        loss_type=training_args.loss_type,
        scale_rewards=training_args.scale_rewards,
        mask_truncated_completions=training_args.mask_truncated_completions,
        gradient_checkpointing=training_args.activation_checkpointing,
        eval_strategy="no",  # scored on validation questions at the end instead (execution accuracy)
        # one group per prompt on each step: the generation batch is the train batch
        per_device_train_batch_size=training_args.per_device_train_batch_size,
        remove_unused_columns=False,
        log_completions=False,
        reward_weights=None,  # set from the chosen functions below
    )
    if (values["per_device_train_batch_size"] * values["gradient_accumulation_steps"]) % training_args.num_generations:
        raise TextsqlError(
            f"--per_device_train_batch_size x --gradient_accumulation_steps "
            f"({values['per_device_train_batch_size']} x {values['gradient_accumulation_steps']}) counts completions "
            f"under --stage grpo and must be a multiple of --num_generations ({training_args.num_generations}): "
            f"e.g. --per_device_train_batch_size {2 * training_args.num_generations}."
        )
    try:
        return GRPOConfig(**values)
    except ValueError as error:
        raise TextsqlError(f"Invalid GRPO arguments: {error}") from None


def build(inputs: Inputs) -> Built:
    """The GRPO run's trainer: the parent run's model (policy_model) made ready, the train split's prompts and tables,
    TRL's config from the arguments as given, and the validation questions its final weights' SQL is scored on."""
    model_args, data_args, training_args, plan = inputs.model, inputs.data, inputs.training, inputs.plan
    check_grpo_model(model_args.model_id)
    model_tokenizer = load_tokenizer(model_args.model_id)
    _, eval_set, data_meta, tokenizer = load_training_data(data_args, model_tokenizer)
    train_set, tables = grpo_dataset(
        data_args.dataset_dir, data_args.max_train_samples, training_args.grpo_questions_from
    )
    model, adapter = policy_model(
        model_args.model_id,
        training_args,
        lambda: load_base_model(model_args.model_id, training_args, plan),
        lambda loaded: wrap_for_lora(loaded, model_args, training_args, tokenizer, model_tokenizer),
    )
    if adapter is not None and not training_args.lora:  # the parent's adapter, trained on: its settings recorded
        plan.strategy["lora"] = adapter.get("lora")
    family = ready_model(model, tokenizer, data_meta, inputs)
    config = grpo_config(inputs.given, plan.trainer_settings)
    train_set, learnable = learnable_questions(model, tokenizer, train_set, tables, training_args, plan.output_dir)
    stage_record = {**grpo_record(training_args, parent_run(model_args.model_id)), "learnable": learnable}
    trainer = TextsqlGrpoTrainer(
        model=model,
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        tables=tables,
        weights_text=training_args.reward_weights,
        sql_scoring=SqlScoring.for_run(data_args, data_meta, eval_set is not None),
        stage_record=stage_record,
    )
    return Built(trainer, adapter, data_meta, family)


class TextsqlGrpoTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with textsql's SQL rewards, weighted as --reward_weights says; its final weights scored on
    `sql_scoring`'s validation questions as the supervised trainer scores its own (textsql.train.trainer.sql_scores:
    greedy, or the decoding asked for; TRL evaluates otherwise), and the stage's record and figures for the summary."""

    def __init__(
        self,
        *,
        model,
        args,
        train_dataset,
        processing_class,
        tables: dict,
        weights_text: str,
        sql_scoring: SqlScoring | None = None,
        stage_record: dict | None = None,
    ):
        eos = model.generation_config.eos_token_id
        eos_ids = [processing_class.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])]
        functions, weights = SqlRewards(tables, eos_ids).functions(reward_weights(weights_text))
        args.reward_weights = weights
        super().__init__(
            model=model,
            reward_funcs=functions,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
        )
        self.sql_scoring = sql_scoring
        self.stage_record = stage_record or {}
        self.flops_profiler = flops_profiler_for(self)  # under DeepSpeed the engine profiles the step

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (every rank's, gathered), and the share of groups with no execution signal logged beside
        them (ZERO_SIGNAL): TRL's frac_reward_zero_std reads the weighted sum, where a bonus hides a group that is all
        wrong or all right."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][ZERO_SIGNAL].append(execution_zero_signal(rewards_per_func[:, 0], self.num_generations))
        return rewards_per_func

    def final_evaluation(self) -> dict:
        """The final weights' SQL scores ({} without a validation split or with --execution_accuracy_samples 0)."""
        return sql_scores(self, self.sql_scoring) if self.sql_scoring is not None else {}

    def tokens_read(self) -> int:
        """The tokens GRPO's steps read, prompts and completions, every rank's (TRL's last logged num_tokens)."""
        return grpo_tokens(self.state.log_history)

    def summary_figures(self, summary) -> None:
        """The stage's record (its settings, its parent run) and its logged figures in the run summary."""
        summary.grpo = {**self.stage_record, **grpo_figures(self.state.log_history)}


def execution_zero_signal(execution, group: int) -> float:
    """The share of groups (`group` consecutive completions of one prompt) whose execution rewards are all equal: all
    right or all wrong, so GRPO learns nothing about right answers from them."""
    grouped = execution.reshape(-1, group)
    return (grouped == grouped[:, :1]).all(dim=1).float().mean().item()


def grpo_figures(log_history: list[dict]) -> dict:
    """The whole curve (`steps`: each logged step's GRPO_FIGURES and rewards' means), the last logged value of each,
    how many steps logged them, and the first logged reward and execution mean, to see what the stage changed."""
    logged = [h for h in log_history if "reward" in h]
    if not logged:
        return {}

    def figures_of(entry: dict) -> dict:
        kept = {name: entry[name] for name in GRPO_FIGURES if name in entry}
        kept.update({k: v for k, v in entry.items() if k.startswith("rewards/") and k.endswith("/mean")})
        return kept

    figures = figures_of(logged[-1])
    figures.update(first_reward=logged[0]["reward"], logged_steps=len(logged))
    figures["first_execution"] = logged[0].get("rewards/execution/mean")
    figures["steps"] = [{"step": entry.get("step"), **figures_of(entry)} for entry in logged]
    return figures


def grpo_tokens(log_history: list[dict]) -> int:
    """The tokens GRPO's steps read, prompts and completions, every rank's (TRL's last logged num_tokens)."""
    return int(next((h["num_tokens"] for h in reversed(log_history) if "num_tokens" in h), 0))


def grpo_record(training_args, parent: str | None) -> dict:
    """The stage as the run summary records it: its settings and its parent run."""
    return {**training_args.grpo_settings(), "parent_run": parent}
