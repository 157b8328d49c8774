"""GRPO moves the model toward what the execution reward pays, on the tiny Qwen2 in this process: a TextsqlGrpoTrainer
whose sampler returns the gold SQL for half of a question's completions and a wrong (but clean, executable) query for
the other half; the rewards per completion (1 and 0.1), the advantages' signs, and one optimizer step that raises the
log-probability of the rewarded completion and lowers the punished one's."""

import json

import pytest


def completion_logprob(model, tokenizer, prompt: str, completion_ids: list[int]) -> float:
    """log p(completion | prompt) under the model, summed over the completion's tokens."""
    import torch

    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    ids = torch.tensor([prompt_ids + completion_ids])
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None]).sum().item()


def wrong_query(row: dict, table: dict) -> str:
    """Another column selected with the gold's conditions dropped: parses and executes on the table, another result."""
    gold = json.loads(row["sql"])
    other = next(name for i, name in enumerate(table["header"]) if i != gold["sel"])
    return f"SELECT {other} FROM table"


def test_one_step_moves_the_model_toward_the_gold_completions(causal_assets, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from textsql.train.grpo import TextsqlGrpoTrainer, grpo_dataset

    data_dir, model_dir = causal_assets
    torch.manual_seed(0)
    train, tables = grpo_dataset(str(data_dir), 1)  # one question: its 4 completions are one group
    row = train[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    gold_ids = tokenizer(" " + row["target"], add_special_tokens=False).input_ids + [eos]
    wrong_ids = tokenizer(" " + wrong_query(row, tables[row["table_id"]]), add_special_tokens=False).input_ids + [eos]
    before = [completion_logprob(model, tokenizer, row["prompt"], ids) for ids in (gold_ids, wrong_ids)]
    seen = {}

    class StubbedSampler(TextsqlGrpoTrainer):
        """Generation replaced: completions 0 and 2 of each group are the gold SQL, 1 and 3 the wrong query."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **_):
            return [list(gold_ids if i % 2 == 0 else wrong_ids) for i in range(len(prompt_ids))], None

        def _calculate_rewards(self, *args, **kwargs):
            seen["rewards"] = super()._calculate_rewards(*args, **kwargs).clone()
            return seen["rewards"]

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            seen["advantages"] = output["advantages"].clone()
            return output

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=32,
        max_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = StubbedSampler(
        model=model,
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        tables=tables,
        weights_text="execution=1.0,executes=0.1",
    )
    trainer.train()
    # the rewards per completion, functions in REWARDS' order: execution, then the executes bonus
    assert seen["rewards"].tolist() == [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    advantages = seen["advantages"].flatten()
    assert (advantages[0::2] > 0).all() and (advantages[1::2] < 0).all(), advantages
    logged = next(h for h in trainer.state.log_history if "reward" in h)
    assert logged["rewards/execution/mean"] == 0.5 and logged["frac_execution_zero_std"] == 0.0
    assert logged["reward"] == pytest.approx(0.55)
    after = [completion_logprob(trainer.model, tokenizer, row["prompt"], ids) for ids in (gold_ids, wrong_ids)]
    assert after[0] > before[0], (before, after)  # the rewarded completion became likelier
    assert after[1] < before[1], (before, after)  # the punished one less likely


def test_success_rates_are_sampled_and_the_learnable_filter_keeps_0_lt_success_lt_1(causal_assets, tmp_path):
    """The tiny model's success rates, sampled as GRPO samples (seeded: the same twice), and --learnable_only's filter
    and statistics on rates recorded in the run folder (the tiny model itself gets nothing right)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from textsql.arguments.training import TextsqlTrainingArguments
    from textsql.errors import TextsqlError
    from textsql.train.grpo import LEARNABLE_FILE, grpo_dataset, learnable_questions, success_rates

    data_dir, model_dir = causal_assets
    train, tables = grpo_dataset(str(data_dir), 6)
    later, _ = grpo_dataset(str(data_dir), 2, start=3)  # --grpo_questions_from: questions a supervised run never saw
    assert list(later["target"]) == list(train["target"][3:5])
    with pytest.raises(TextsqlError, match="--grpo_questions_from 100000 is past"):
        grpo_dataset(str(data_dir), None, start=100_000)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rates = success_rates(model, tokenizer, train, tables, 4, 1.0, 16, batch_questions=4, seed=1)
    assert len(rates) == 6 and all(r in (0, 0.25, 0.5, 0.75, 1) for r in rates)
    assert success_rates(model, tokenizer, train, tables, 4, 1.0, 16, batch_questions=4, seed=1) == rates

    args = TextsqlTrainingArguments(output_dir=str(tmp_path), stage="grpo", learnable_only=True, num_generations=4)
    (tmp_path / LEARNABLE_FILE).write_text(json.dumps({"samples": 4, "rates": [0, 0.25, 1, 0.5, 0, 0.75]}))
    kept, statistics = learnable_questions(model, tokenizer, train, tables, args, tmp_path)
    assert list(kept["target"]) == [train["target"][i] for i in (1, 3, 5)]
    assert statistics["kept"] == 3 and statistics["questions"] == 6 and statistics["share_at_0"] == pytest.approx(1 / 3)
    assert statistics["share_at_1"] == pytest.approx(1 / 6) and statistics["distribution"]["0/4"] == 2
    # rates measured now (the recorded ones were for 2 samples): the untrained tiny model has no learnable question
    (tmp_path / LEARNABLE_FILE).write_text(json.dumps({"samples": 2, "rates": [0.5] * 6}))
    if not any(0 < r < 1 for r in rates):
        with pytest.raises(TextsqlError, match="--learnable_only True kept no question"):
            learnable_questions(model, tokenizer, train, tables, args, tmp_path)
        assert json.loads((tmp_path / LEARNABLE_FILE).read_text())["samples"] == 4  # written before refusing
