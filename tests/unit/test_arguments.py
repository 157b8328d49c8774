"""Every command's arguments in textsql/arguments/: a flag several commands share is declared once (the others take it
with `same_flag`, its default and checks with it), and every command's typo is answered before its module loads."""

import ast
from pathlib import Path

import pytest

from textsql.cli import COMMANDS
from textsql.cli.flags import ARGUMENT_SOURCES, command_flags, dataclass_fields

ARGUMENTS = Path(__file__).resolve().parents[2] / "textsql" / "arguments"
# The same name and default in two commands that mean each command's own thing (what it writes, what it reads)
OWN_TO_EACH_COMMAND = {
    "output_dir": "where each command writes (a run, predictions, a merged, quantized or imported model)",
    "overwrite": "whether each command replaces what it wrote before",
    "seed": "demo's generated data and training, prep's split of train",
    "source": "import's GGUF file or packaged model, prep's WikiSQL source",
    "dtype": "infer's loading dtype, import's saved dtype",
    "batch_size": "demo's training batch, merge's scoring batch",
}
# The Trainer's own flags textsql plan restates beside textsql train's default for them (plan imports no transformers)
TRAINER_FLAGS_PLAN_RESTATES = ("per_device_train_batch_size", "per_device_eval_batch_size")


def declarations(paths=None) -> dict[tuple[str, str], list[str]]:
    """(flag, its default as written) -> the classes declaring it with a field of their own (not same_flag)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in paths or sorted(ARGUMENTS.glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Call)):
                    continue
                call, name = item.value, item.target.id
                if getattr(call.func, "id", "") == "same_flag":
                    continue
                if getattr(call.func, "id", "") == "_textsql_default":  # a Trainer flag with textsql's default
                    default = ast.unparse(call.args[1])
                else:
                    default = next(
                        (ast.unparse(k.value) for k in call.keywords if k.arg in ("default", "default_factory")),
                        "required",
                    )
                found.setdefault((name, default), []).append(f"{path.stem}.{node.name}")
    return found


def twins(paths=None) -> dict:
    return {
        key: classes
        for key, classes in declarations(paths).items()
        if len(classes) > 1 and key[0] not in OWN_TO_EACH_COMMAND and key[0] not in TRAINER_FLAGS_PLAN_RESTATES
    }


def test_no_flag_is_declared_twice():
    twice = twins()
    assert twice == {}, f"declare each once and take it with textsql.arguments.same_flag elsewhere: {twice}"
    for name in TRAINER_FLAGS_PLAN_RESTATES:  # the same default in both, or plan predicts another run than train's
        defaults = {default for (flag, default) in declarations() if flag == name}
        assert len(defaults) == 1, (name, defaults)


def test_the_rule_catches_a_twin(tmp_path):
    """A flag restated with its default (tune's --model_id before same_flag) is found."""
    twin = tmp_path / "twin.py"
    twin.write_text("@dataclass\nclass Twin:\n    model_id: str = field(default='t5-small')\n")
    assert list(twins([twin, ARGUMENTS / "data.py"])) == [("model_id", "'t5-small'")]


def test_tune_and_plan_take_textsql_train_s_names_and_defaults():
    from textsql.arguments.data import DataArguments, ModelArguments
    from textsql.arguments.devices import DeviceArguments
    from textsql.arguments.lora import LoraArguments
    from textsql.arguments.plan import PlanArguments
    from textsql.arguments.tune import TuneArguments

    tune, plan = TuneArguments(), PlanArguments()
    for shared, names in (
        (ModelArguments(), ("model_id",)),
        (DataArguments(), ("dataset_dir",)),
        (DeviceArguments(), ("num_gpus", "accelerator")),
        (LoraArguments(), ("lora", "quantize_base")),
    ):
        for name in names:
            assert getattr(tune, name) == getattr(shared, name), name
    assert (plan.model_id, plan.dataset_dir) == (tune.model_id, tune.dataset_dir)
    assert plan.execution_accuracy_num_beams == DataArguments().execution_accuracy_num_beams
    assert {"model_id", "deepspeed", "activation_checkpointing", "execution_accuracy_num_beams"} <= command_flags(
        "plan"
    )


@pytest.mark.parametrize("command", sorted(ARGUMENT_SOURCES))
def test_every_dataclass_command_has_its_early_typo_check(command):
    """Each command parsed into a dataclass names its class in cli/flags.ARGUMENT_SOURCES, read there without importing."""
    module, name = ARGUMENT_SOURCES[command]
    assert command in COMMANDS
    assert dataclass_fields("textsql", f"arguments/{module}.py", (name,)), (command, module, name)
