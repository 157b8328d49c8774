"""Model shapes the planner built, kept in the user's cache: building a model on the meta device and recording its
ZeRO-3 trace needs torch and transformers (about 10 s of imports on a busy 2-core machine), so `textsql plan` pays
that once per model, library release and textsql source, and answers in about a second afterwards."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from textsql.paths import PLANNER_SHAPES_DIR, user_cache_dir
from textsql.sharedfiles import replace_file

RECORD_VERSION = 1
TEXTSQL_SOURCE = Path(__file__).resolve().parents[1]
# The libraries a shape is built with: the file each one's import starts from, which an upgrade rewrites (read by
# path, size and time: importlib.metadata alone takes a tenth of a second to import).
BUILT_WITH = ("torch", "transformers")
# Records kept (the newest written; up to about 160 kB each): every edit of textsql's source makes new keys.
KEPT_RECORDS = 256


def shape_key(identity) -> str:
    """The cache key of a model's shape: `identity` (JSON: what names the model, such as a built-in table row or its
    config.json's digest), the torch and transformers installed, and textsql's own source, so that a change of the
    planner's code or of a library builds the shape again instead of reading an old one."""
    digest = hashlib.sha256(json.dumps([RECORD_VERSION, identity, _libraries()]).encode())
    for path in sorted(TEXTSQL_SOURCE.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:40]


def _libraries() -> list:
    found = []
    for name in BUILT_WITH:
        spec = importlib.util.find_spec(name)
        info = os.stat(spec.origin) if spec and spec.origin else None
        found.append([name, spec.origin if info else None, info and info.st_size, info and info.st_mtime_ns])
    return found


def read_record(key: str) -> dict | None:
    """The record cached under `key` (JSON lists as tuples), or None when there is none or it cannot be read."""
    try:
        record = json.loads((user_cache_dir() / PLANNER_SHAPES_DIR / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _tuples(record) if isinstance(record, dict) else None


def write_record(key: str, record: dict) -> dict:
    """Cache `record` under `key` (atomically; the oldest records beyond KEPT_RECORDS removed) and return it as
    read_record will (lists as tuples). A cache that cannot be written (a read-only home) is left alone: the next plan
    builds the shape again."""
    text = json.dumps(record)
    folder = user_cache_dir() / PLANNER_SHAPES_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        replace_file(folder / f"{key}.json", text + "\n")
        by_age = sorted(((path.stat().st_mtime_ns, path) for path in folder.glob("*.json")), reverse=True)
        for _, path in by_age[KEPT_RECORDS:]:
            path.unlink(missing_ok=True)
    except OSError:  # also a record another plan removed while this one listed them
        pass
    return _tuples(json.loads(text))


def _tuples(value):
    """JSON's lists back as the tuples the planner hashes; objects stay dicts."""
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    return value
