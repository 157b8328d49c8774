"""Folder names textsql makes stay short and unique (issue 32, item 7): a LoRA run on a run-folder base does not repeat
the base's name, merging and quantizing do not append without bound, and every setting is still told apart."""

from __future__ import annotations

import itertools

from textsql.arguments.merge import MergeArguments
from textsql.arguments.run_name import run_folder_name, run_name_settings
from textsql.arguments.training import ModelArguments, TextsqlTrainingArguments
from textsql.merge import merged_dir
from textsql.paths import MODEL_NAME_LIMIT, NAME_LIMIT, short_name
from textsql.train.run import run_dir

DEMO_SETTINGS = ["lr0.002", "ep8", "seed0", "warmup50", "constant_with_warmup"]


def test_short_names_are_kept_as_they_are():
    assert run_folder_name("t5-small", "zero2", 32, 1) == "t5-small-zero2-ws1-bs32"
    assert run_folder_name("runs/x/", "none", 16, 2, ["lr0.001"], "-lora-r8") == "x-none-lora-r8-ws2-bs16-lr0.001"
    assert short_name("run", "merged") == "run-merged"
    long_hub = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert run_folder_name(long_hub, "zero3_offload", 8, 16, ["lr0.0001", "ep5"], "-lora-r16") == (
        "Qwen2.5-Coder-1.5B-Instruct-zero3_offload-lora-r16-ws16-bs8-lr0.0001-ep5"
    )


def test_a_lora_run_on_a_run_folder_base_does_not_repeat_the_base():
    base = run_folder_name("textsql-demo/tiny-t5", "zero2", 16, 1, DEMO_SETTINGS)
    lora = run_folder_name(f"runs/{base}", "none", 16, 1, ["lr0.003", "steps120"], "-lora-r16")
    model_part = lora.split("-none-lora-r16-")[0]
    assert len(model_part) <= MODEL_NAME_LIMIT and model_part.startswith("tiny-t5-zero2-ws1-"), lora
    assert lora.endswith("-none-lora-r16-ws1-bs16-lr0.003-steps120") and len(lora) <= NAME_LIMIT, lora
    # Another base of the same beginning is another model part: the hash tells them apart.
    other = run_folder_name(f"runs/{base.replace('lr0.002', 'lr0.004')}", "none", 16, 1, ["lr0.003"], "-lora-r16")
    assert other.split("-none-")[0] != model_part


def test_merging_and_quantizing_again_and_again_stay_within_the_limit():
    name = run_folder_name(
        "runs/" + "-".join(["tiny-t5-zero2-ws1-bs16", *DEMO_SETTINGS]), "none", 16, 1, [], "-lora-r16"
    )
    seen = {name}
    for suffix in ["merged", "torchao-int8", "checkpoint-120-merged", "bnb-nf4", "dynamic-int8"]:
        name = short_name(name, suffix)
        assert len(name) <= NAME_LIMIT and name.endswith(suffix) and name not in seen, name
        assert all(part for part in name.split("-")), name  # whole parts, no dangling dash
        seen.add(name)


def test_cut_names_stay_unique_over_every_setting():
    """Every combination of a long tail of settings gets its own folder, as before the names were cut."""
    choices = {
        "learning_rate": [3e-4, 1e-3],
        "num_train_epochs": [3, 8],
        "seed": [42, 0],
        "warmup_steps": [0, 50],
        "lr_scheduler_type": ["linear", "constant_with_warmup"],
        "weight_decay": [0.0, 0.01],
        "max_grad_norm": [1.0, 0.5],
    }
    names = set()
    for values in itertools.product(*choices.values()):
        training = TextsqlTrainingArguments(**dict(zip(choices, values)), runs_root="runs")
        name = run_dir(ModelArguments(model_id="textsql-demo/tiny-t5"), training, 1, "zero3_offload").name
        assert len(name) <= NAME_LIMIT, name
        names.add(name)
    assert len(names) == 2 ** len(choices)
    longest = TextsqlTrainingArguments(**{k: v[1] for k, v in choices.items()}, runs_root="runs")
    assert len("-".join(run_name_settings(longest))) > NAME_LIMIT - len("tiny-t5-zero3_offload-ws1-bs32")  # was cut


def test_merged_folder_names(tmp_path):
    run = tmp_path / ("x" * 70 + "-lora-r8-ws1-bs16")
    merged = merged_dir(MergeArguments(adapter=str(run)))
    assert merged.parent == tmp_path and merged.name.endswith("-merged") and len(merged.name) <= NAME_LIMIT
    assert merged_dir(MergeArguments(adapter=str(tmp_path / "run"))) == tmp_path / "run-merged"


def test_a_stage_s_own_schedule_is_not_named():
    """--lr_scheduler_type auto is each stage's own schedule (linear for sft, constant after warm-up for GRPO): the
    run folder names a schedule only where it differs from its stage's, as before auto existed."""
    assert run_name_settings(TextsqlTrainingArguments(runs_root="runs")) == []
    assert run_name_settings(TextsqlTrainingArguments(runs_root="runs", lr_scheduler_type="linear")) == []
    other = TextsqlTrainingArguments(runs_root="runs", lr_scheduler_type="constant_with_warmup")
    assert run_name_settings(other) == ["constant_with_warmup"]
