"""The training objectives' layout: one module per --stage, each with a build and a trainer class at module level, and
no function in the package longer than about a screen (a run, a tune, a plan read top to bottom)."""

import ast
import inspect
from importlib import import_module
from pathlib import Path

from textsql.arguments.grpo import STAGES
from textsql.train.run import OBJECTIVES

PACKAGE = Path(__file__).resolve().parents[2] / "textsql"
LONGEST = 100  # lines a function in textsql may take
# Classes a function may define, each for its reason: the planner's ZeRO-3 trace hooks close over one trace's state
# and need torch, which a cached `textsql plan` never imports. (Trainer callbacks live in train/callbacks, which only a
# training imports.)
INNER_CLASSES = {"planner/zero3_trace.py record_module_trace"}
# Functions still over the limit, each with where it is split: prep's in phases with the prompt/source module (#55, 3)
LONG_FOR_NOW = {"prep.py prepare_dataset"}


def test_every_stage_has_its_objective_module_with_a_build():
    assert sorted(OBJECTIVES) == sorted(STAGES)
    for name in OBJECTIVES.values():
        module = import_module(name)
        assert callable(module.build), name
        assert list(inspect.signature(module.build).parameters) == ["inputs"], name


def test_each_objective_s_trainer_takes_what_it_scores_with_and_answers_the_run():
    from textsql.train.grpo import TextsqlGrpoTrainer
    from textsql.train.sft import TRAINER_CLASSES

    for trainer in (TextsqlGrpoTrainer, *TRAINER_CLASSES.values()):
        assert "sql_scoring" in inspect.signature(trainer.__init__).parameters, trainer
        for method in ("final_evaluation", "tokens_read", "summary_figures"):
            assert callable(getattr(trainer, method)), (trainer, method)


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_class_is_defined_inside_a_function_and_no_function_is_longer_than_a_screen():
    inner_classes, long = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for function in functions(path):
            where = f"{name}:{function.lineno} {function.name}"
            inner = any(isinstance(node, ast.ClassDef) for node in ast.walk(function))
            if inner and f"{name} {function.name}" not in INNER_CLASSES:
                inner_classes.append(where)
            if function.end_lineno - function.lineno + 1 > LONGEST and f"{name} {function.name}" not in LONG_FOR_NOW:
                long.append(f"{where} ({function.end_lineno - function.lineno + 1} lines)")
    assert inner_classes == [] and long == [], (inner_classes, long)
