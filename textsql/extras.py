"""The optional `notebooks` extra (plots, notebooks, JupyterLab): a clear error naming it when a part of it is missing."""

from __future__ import annotations

import importlib

from textsql.errors import TextsqlError

NOTEBOOKS_EXTRA = "textsql[notebooks]"


def require_notebooks_extra(module: str, purpose: str) -> None:
    """Import `module` (one of the extra's packages), or raise TextsqlError saying what needs it and how to install it."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise TextsqlError(
            f"{purpose} needs {module}, which is part of the optional notebooks extra: install it with "
            f"`pip install '{NOTEBOOKS_EXTRA}'` (from a checkout: `pip install '.[notebooks]'`; "
            f"`bash scripts/bootstrap.sh setup` installs everything). ({error})") from error
