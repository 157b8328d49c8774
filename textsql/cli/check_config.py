"""`textsql check-config FILE...`: check DeepSpeed JSON files the way the Trainer, accelerate and DeepSpeed read them."""

from __future__ import annotations

import argparse
import sys
import warnings

from textsql.errors import TextsqlError
from textsql.paths import DSCONFIG_DIR
from textsql.strategy.dsconfig import (
    DsConfigWarning,
    describe_config,
    load_dsconfig,
    resolve_dsconfig_path,
    shipped_configs,
)


def check_config_cli(argv) -> int:
    """Body of `textsql check-config FILE [FILE ...]`: report each file as OK (with its warnings) or its problems.

    Returns 0 when every file is accepted and 2 otherwise; argument errors exit 2 through argparse.
    """
    parser = argparse.ArgumentParser(
        prog="textsql check-config",
        description="Check DeepSpeed JSON configs the way the Trainer, accelerate and DeepSpeed read them: what one of "
        "them would stop on is refused with its reason, what runs but looks like a mistake is a warning.")
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help=f"a DeepSpeed JSON file, or a shipped strategy name ({', '.join(shipped_configs())}; "
                             f"the files are in {DSCONFIG_DIR})")
    args = parser.parse_args(list(argv))
    status = 0
    for name in args.files:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DsConfigWarning)
            try:
                cfg = load_dsconfig(resolve_dsconfig_path(name, flag="textsql check-config:"))
            except TextsqlError as exc:
                print(exc, file=sys.stderr)
                status = 2
                continue
        print(f"{name}: OK ({describe_config(cfg)})")
        for warning in caught:
            if issubclass(warning.category, DsConfigWarning):
                print(f"{name}: warning: {warning.message}")
    return status
