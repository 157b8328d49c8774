"""`textsql check-config FILE...`: check DeepSpeed and FSDP JSON files the way the Trainer, accelerate and DeepSpeed
read them."""

from __future__ import annotations

import argparse
import sys
import warnings

from textsql.errors import TextsqlError
from textsql.paths import DSCONFIG_DIR, FSDPCONFIG_DIR
from textsql.strategy.dsconfig import (
    DsConfigWarning,
    describe_config,
    load_dsconfig,
    resolve_dsconfig_path,
    shipped_configs,
)
from textsql.strategy.fsdpconfig import (
    FsdpConfigWarning,
    describe_fsdp_config,
    is_fsdp_config_name,
    load_fsdpconfig,
    resolve_fsdpconfig_path,
    shipped_fsdp_configs,
)


def check_config_cli(argv) -> int:
    """Body of `textsql check-config FILE [FILE ...]`: report each file as OK (with its warnings) or its problems.

    Returns 0 when every file is accepted and 2 otherwise; argument errors exit 2 through argparse.
    """
    parser = argparse.ArgumentParser(
        prog="textsql check-config",
        description="Check DeepSpeed and FSDP JSON configs the way the Trainer, accelerate and DeepSpeed read them: "
        "what one of them would stop on (or silently ignore, for FSDP) is refused with its reason, what runs but looks "
        "like a mistake is a warning.",
    )
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help=f"a DeepSpeed or FSDP JSON file, or a shipped strategy name (DeepSpeed: "
        f"{', '.join(shipped_configs())}, in {DSCONFIG_DIR}; FSDP: "
        f"{', '.join(shipped_fsdp_configs())}, in {FSDPCONFIG_DIR})",
    )
    args = parser.parse_args(list(argv))
    status = 0
    for name in args.files:
        fsdp = is_fsdp_config_name(name)
        category = FsdpConfigWarning if fsdp else DsConfigWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", category)
            try:
                if fsdp:
                    described = describe_fsdp_config(
                        load_fsdpconfig(resolve_fsdpconfig_path(name, flag="textsql check-config:"))
                    )
                else:
                    described = describe_config(
                        load_dsconfig(resolve_dsconfig_path(name, flag="textsql check-config:"))
                    )
            except TextsqlError as exc:
                print(exc, file=sys.stderr)
                status = 2
                continue
        print(f"{name}: OK ({described})")
        for warning in caught:
            if issubclass(warning.category, category):
                print(f"{name}: warning: {warning.message}")
    return status
