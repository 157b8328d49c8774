"""`textsql plan`: predict GPU and host memory per pod for every strategy, and recommend the fastest that fits."""

from __future__ import annotations

import json
import sys
import warnings

from textsql.arguments.plan import PlanArguments
from textsql.cli.parsing import parse_arguments
from textsql.errors import TextsqlError
from textsql.planner.display import format_plan
from textsql.planner.recommend import plan_memory
from textsql.strategy.dsconfig import DsConfigWarning


def plan_cli(argv) -> int:
    """Body of `textsql plan ...`: print the table (or --json), 0 when a strategy fits, 2 with a message otherwise."""
    try:
        args = parse_arguments(PlanArguments, "plan", argv)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DsConfigWarning)
            plan = plan_memory(args)
    except TextsqlError as error:
        print(f"textsql plan: {error}", file=sys.stderr)
        return 2
    for warning in caught:
        if issubclass(warning.category, DsConfigWarning):
            print(f"textsql plan: warning: {args.deepspeed}: {warning.message}", file=sys.stderr)
    print(
        json.dumps(_public(plan), indent=2)
        if args.json
        else format_plan(plan, with_problem=False, with_assumptions=args.assumptions)
    )
    if plan["recommendation"] is None:
        print(f"textsql plan: {plan['problem']}", file=sys.stderr)
        return 2
    return 0


def _public(plan: dict) -> dict:
    return json.loads(json.dumps(plan, default=str))
