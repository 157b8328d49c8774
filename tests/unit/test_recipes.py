"""Every shipped recipe (recipes/*.yaml) is what `textsql train recipe.yaml` reads: it parses with no unknown key, its
DeepSpeed config passes the checks, and the run it describes is set up on an A100 pod (facts fed, nothing started); a
recipe's `textsql prep` line parses too and writes the dataset the recipe trains on (the real model's: from the
WikiSQL lines shipped with textsql)."""

import re
import shlex
from pathlib import Path

import pytest

from textsql.arguments.prep import PrepArguments
from textsql.arguments.training import parse_arguments
from textsql.cli.parsing import parse_arguments as parse_command
from textsql.families import LORA_PRESETS
from textsql.strategy.devices import A100_40GB, NodeDevices
from textsql.train.run import set_up_run
from textsql.wikisql.release import SAMPLE_SOURCE

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    assert {p.name for p in RECIPES} >= {
        "t5-small-zero2.yaml",
        "t5-large-zero3-offload.yaml",
        "qwen2.5-0.5b-lora.yaml",  # a 0.5B-class causal LM with LoRA
        "qwen2.5-7b-lora-zero3-offload.yaml",  # a 7B-class one on one A100-40GB
        "smollm2-135m-full.yaml",  # the real model textsql measures on: the runs behind the published figures
        "smollm2-135m-lora.yaml",
        "smollm2-135m-qlora.yaml",
        "smollm2-135m-full-question-header.yaml",  # the earlier prompt without the cells: the history's figure
        "smollm2-135m-demo.yaml",  # what `textsql demo` trains
    }


# Recipes for a model `textsql import` writes into the project (models/NAME): their comments say how to get it.
IMPORTED = "models/"
# Small enough for one GPU whole: neither sharded nor on a quantized base.
ONE_GPU_WHOLE = {
    "smollm2-135m-full.yaml",
    "smollm2-135m-lora.yaml",
    "smollm2-135m-full-question-header.yaml",
    "smollm2-135m-demo.yaml",
}
# Recipes of a published figure name their run folder (the folder docs/real-model.md's next command reads).
NAMED_RUN = {
    f"smollm2-135m-{name}.yaml": f"runs/smollm2-135m-{name}"
    for name in ("full", "lora", "qlora", "full-question-header")
} | {"smollm2-135m-demo.yaml": "textsql-demo/runs/smollm2-135m-demo"}  # where `textsql demo` leaves it
FULL_FINE_TUNING = {"smollm2-135m-full.yaml", "smollm2-135m-full-question-header.yaml", "smollm2-135m-demo.yaml"}
# Every recipe trains on the best measured prompts (the table's cells listed) but the one kept as the history.
PROMPT_FORMAT = {"smollm2-135m-full-question-header.yaml": "question+header"}


@pytest.mark.parametrize("recipe", [p for p in RECIPES if not p.name.startswith("t5-")], ids=lambda p: p.name)
def test_causal_recipes_train_on_data_their_prep_line_writes(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, data, training = parse_arguments([str(recipe)])
    assert model.model_id.startswith(("Qwen/", IMPORTED))
    assert training.lora != (recipe.name in FULL_FINE_TUNING) and training.lora_targets in LORA_PRESETS
    (prep_line,) = re.findall(r"^#\s+(textsql prep .*)$", recipe.read_text(), re.M)
    prep = parse_command(PrepArguments, "prep", shlex.split(prep_line)[2:])
    assert prep.model_id == model.model_id
    assert prep.source_format == PROMPT_FORMAT.get(recipe.name, "question+header+values")
    assert Path(prep.output_dir) == Path(data.dataset_dir)
    if recipe.name in NAMED_RUN:  # the real model's recipes: the real WikiSQL lines shipped with textsql
        assert prep.source == SAMPLE_SOURCE
    if model.model_id.startswith(IMPORTED):  # the import line writes the folder the prep line and the recipe read
        (import_line,) = re.findall(r"^#\s+(textsql import .*)$", recipe.read_text(), re.M)
        assert shlex.split(import_line)[3] == model.model_id


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_sets_up_a_run(recipe, tmp_path, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # set_up_run decides it; monkeypatch restores it afterwards
    model, data, training = parse_arguments([str(recipe)])
    assert model.model_id.startswith(("t5-", "Qwen/", IMPORTED))
    # sharded, or one GPU holds a quantized base, or the model is small enough for one GPU whole
    assert training.deepspeed or training.quantize_base != "none" or recipe.name in ONE_GPU_WHOLE
    training.runs_root = str(tmp_path / "runs")
    setup = set_up_run(model, training, devices=NodeDevices((A100_40GB,), 16))
    assert setup.precision.name == "bf16" and (setup.dsconfig is not None) == bool(training.deepspeed)
    if recipe.name in NAMED_RUN:
        assert training.output_dir == NAMED_RUN[recipe.name] and setup.output_dir == Path(training.output_dir)
    else:
        assert training.output_dir is None and setup.output_dir.parent == tmp_path / "runs"
        assert ("-qlora-nf4-r16-" in setup.output_dir.name) == (
            training.quantize_base == "nf4"
        )  # the run's name says it


def test_flags_after_a_recipe_override_its_keys_and_an_unknown_key_is_named(tmp_path, monkeypatch):
    from textsql.errors import TextsqlError

    monkeypatch.chdir(tmp_path)
    recipe = next(p for p in RECIPES if p.name == "t5-small-zero2.yaml")
    _, _, plain = parse_arguments([str(recipe)])
    model, _, training = parse_arguments([str(recipe), "--max_steps", "40", "--learning_rate", "1e-4"])
    assert (training.max_steps, training.learning_rate) == (40, 1e-4) != (plain.max_steps, plain.learning_rate)
    assert training.deepspeed == plain.deepspeed and model.model_id == "t5-small"  # the rest from the recipe
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("model_id: t5-small\nlernrate: 3\n")
    with pytest.raises(TextsqlError, match="does not know: lernrate"):
        parse_arguments([str(misspelt), "--max_steps", "4"])
