"""The prepared dataset folder, written and read: the tokenized splits (datasets' own layout), what was prepared
(textsql_data.json), the tables the splits use (tables.jsonl) and the tokenizer with the characters it lacked."""

from __future__ import annotations

import json
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.families import family_named
from textsql.hub import load_tokenizer
from textsql.paths import METADATA_FILE, TABLES_FILE
from textsql.vocabulary import tokenizer_fingerprint
from textsql.wikisql.format import Example, WikiSQLData


def save_prepared(
    output_dir: Path, dataset, data: WikiSQLData, splits: dict[str, list[Example]], metadata: dict
) -> Path:
    """Write the folder prep built: the splits, the tables the kept questions use, and the metadata last (its file is
    what marks the folder prepared: check_prepared); returns the folder."""
    output_dir.mkdir(parents=True, exist_ok=True)
    dataset.save_to_disk(str(output_dir))
    _save_tables(output_dir, data, splits)
    (output_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    return output_dir


def _save_tables(output_dir: Path, data: WikiSQLData, splits: dict[str, list[Example]]) -> None:
    """The tables the kept questions refer to, for executing queries later."""
    used = {e.table_id for examples in splits.values() for e in examples}
    with open(output_dir / TABLES_FILE, "w", encoding="utf-8") as f:
        for table_id in sorted(used & data.tables.keys()):
            f.write(json.dumps(data.tables[table_id]) + "\n")


def check_prepared(path: str | Path) -> Path:
    """The folder, when it holds a prepared dataset (cheap: nothing is loaded); else a clear error naming the absolute
    path looked at and how to make it."""
    path = Path(path)
    if not (path / METADATA_FILE).is_file():
        where = "does not exist" if not path.exists() else f"has no {METADATA_FILE}"
        raise TextsqlError(
            f"'{path}' is not a prepared textsql dataset: {path.absolute()} {where}. Run `textsql prep --source ... "
            f"--output_dir {path}` first (or the prep_dataset notebook), or pass the folder prep wrote."
        )
    return path


def load_prepared(path: str | Path):
    """The saved DatasetDict and its metadata, or a clear error saying how to make it."""
    from datasets import load_from_disk

    path = check_prepared(path)
    return load_from_disk(str(path)), json.loads((path / METADATA_FILE).read_text())


def prepared_family(metadata: dict):
    """The model family a prepared dataset was tokenized for (data of an older textsql names none: T5's)."""
    return family_named(metadata.get("model_family", "t5"))


def load_tables(path: str | Path) -> dict[str, dict]:
    tables_file = Path(path) / TABLES_FILE
    if not tables_file.is_file():
        return {}
    with open(tables_file, encoding="utf-8") as f:
        return {t["id"]: t for t in map(json.loads, f)}


def tokenizer_for_training(model_tokenizer, dataset_dir: str | Path, metadata: dict):
    """The tokenizer to train with: the model's own, or the prepared data's copy of it with the characters it lacked.

    Refuses data tokenized with another tokenizer.
    """

    have = tokenizer_fingerprint(model_tokenizer)
    if have == metadata.get("tokenizer_fingerprint") or "tokenizer_fingerprint" not in metadata:
        return model_tokenizer
    if metadata.get("tokenizer_dir") and have == metadata.get("base_tokenizer_fingerprint"):
        return load_tokenizer(str(Path(dataset_dir) / metadata["tokenizer_dir"]))
    raise TextsqlError(
        f"'{dataset_dir}' was tokenized with '{metadata.get('tokenizer')}', whose vocabulary differs from this model's "
        "tokenizer. Run `textsql prep` again with --model_id set to the model you train."
    )
