"""The run spec: every `textsql train` flag, its default and its check, in one folder (LLaMA-Factory's hparams/
idea), with the run folder's naming beside them; the planner, training, tune and the CLI read it here."""

from dataclasses import MISSING, field, fields


def same_flag(arguments, name: str, help: str | None = None):
    """The field `name` of a spec dataclass for another command's arguments (`textsql plan`'s): the
    same flag with the same default, so a default lives in the spec alone; `help` where that command uses it otherwise."""
    spec = next(f for f in fields(arguments) if f.name == name)
    default = {"default": spec.default} if spec.default is not MISSING else {"default_factory": spec.default_factory}
    return field(**default, metadata={**spec.metadata, **({"help": help} if help else {})})
