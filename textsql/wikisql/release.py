"""Load WikiSQL from the original release files (a folder or the .tar.bz2), the release lines shipped with textsql
(by name), or a hub parquet copy."""

from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.hub import download_command, hub_offline
from textsql.paths import WIKISQL_SAMPLE_CHECKSUMS_FILE, WIKISQL_SAMPLE_DIR
from textsql.wikisql.format import Example, WikiSQLData, render_sql

# The release calls the validation split "dev"; textsql uses the Hugging Face names.
RELEASE_SPLIT_FILES = {"train": "train", "validation": "dev", "test": "test"}
SCRIPT_DATASETS = {"wikisql", "salesforce/wikisql"}
# `--source` names the real release lines shipped with textsql (textsql.paths.WIKISQL_SAMPLE_DIR): 1,000 train
# questions and the first 1,062 test questions, with their tables; no dev split (prep holds a tenth of train out).
SAMPLE_SOURCE = "wikisql-sample"


def load_wikisql(source: str) -> WikiSQLData:
    """Load from a folder or `.tar.bz2` of the original release, the shipped sample by its name (SAMPLE_SOURCE), or a
    hub dataset name (or local hub-format folder)."""
    if source == SAMPLE_SOURCE:
        data = load_release_folder(verified_sample())
        data.source = SAMPLE_SOURCE  # the name, not the installed folder: the prepared metadata reads alike anywhere
        return data
    path = Path(source).expanduser()
    if path.is_file() and source.endswith((".tar.bz2", ".tar.gz", ".tar")):
        return _load_release_archive(path)
    if path.is_dir() and _release_folder(path) is not None:
        return load_release_folder(path)
    if path.is_dir():
        return load_hub_dataset(str(path))
    if _looks_like_path(source):
        raise TextsqlError(
            f"Dataset folder or file '{source}' does not exist. Pass a folder holding the WikiSQL release files "
            "(train.jsonl, train.tables.jsonl, dev.jsonl, ..., from github.com/salesforce/WikiSQL data.tar.bz2), "
            f"the .tar.bz2 itself, a hub dataset name, --source {SAMPLE_SOURCE} for the real lines shipped with textsql, "
            "or --source generate for generated data."
        )
    return load_hub_dataset(source)


def sample_checksums() -> dict[str, str]:
    """{file name: sha256} of the shipped sample's files, as its SHA256SUMS records them."""
    lines = (WIKISQL_SAMPLE_DIR / WIKISQL_SAMPLE_CHECKSUMS_FILE).read_text(encoding="utf-8").splitlines()
    return {name.removeprefix("./"): digest for digest, name in (line.split() for line in lines if line.strip())}


def verified_sample() -> Path:
    """The shipped sample's folder, once each file in it has the sha256 recorded for it (an edited copy would otherwise
    be read, and scored, without a word)."""
    for name, digest in sample_checksums().items():
        path = WIKISQL_SAMPLE_DIR / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise TextsqlError(
                f"'{path}' is {'missing' if not path.is_file() else 'not the file textsql shipped (its sha256 differs)'}"
                ". Restore it (`git checkout -- textsql/wikisql/sample` in a checkout, else reinstall textsql), or copy "
                "the files you changed to a folder of your own and pass --source path/to/that/folder."
            )
    return WIKISQL_SAMPLE_DIR


def _looks_like_path(source: str) -> bool:
    """Hub names are `name` or `owner/name`; anything else that does not exist is a missing local path."""
    return (
        source.startswith((".", "/", "~")) or source.count("/") > 1 or source.endswith((".tar.bz2", ".jsonl", ".tar"))
    )


def _release_folder(path: Path) -> Path | None:
    """The folder with train.jsonl inside `path` (the archive unpacks into `data/`)."""
    for candidate in (path, path / "data"):
        if (candidate / "train.jsonl").is_file() or (candidate / "dev.jsonl").is_file():
            return candidate
    return None


def _load_release_archive(archive: Path) -> WikiSQLData:
    with tempfile.TemporaryDirectory(prefix="textsql-wikisql-") as tmp:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jsonl")]
            tar.extractall(tmp, members=members, filter="data")
        found = [p.parent for p in Path(tmp).rglob("train.jsonl")] + [p.parent for p in Path(tmp).rglob("dev.jsonl")]
        if not found:
            raise TextsqlError(f"'{archive}' holds no train.jsonl or dev.jsonl: it is not a WikiSQL release archive.")
        data = load_release_folder(found[0])
    data.source = str(archive)
    return data


def load_release_folder(path: Path) -> WikiSQLData:
    """Read `{split}.jsonl` and `{split}.tables.jsonl` of the original release; missing splits are skipped."""
    folder = _release_folder(Path(path))
    if folder is None:
        raise TextsqlError(f"'{path}' has no train.jsonl or dev.jsonl: it is not a WikiSQL release folder.")
    splits: dict[str, list[Example]] = {}
    tables: dict[str, dict] = {}
    for split, stem in RELEASE_SPLIT_FILES.items():
        questions_file, tables_file = folder / f"{stem}.jsonl", folder / f"{stem}.tables.jsonl"
        if not questions_file.is_file():
            continue
        if not tables_file.is_file():
            raise TextsqlError(f"'{questions_file}' has no tables file beside it: expected '{tables_file}'.")
        split_tables = {t["id"]: t for t in read_jsonl(tables_file)}
        tables.update(split_tables)
        splits[split] = [
            _release_example(row, split_tables, questions_file, n)
            for n, row in enumerate(read_jsonl(questions_file), 1)
        ]
    return WikiSQLData(source=str(folder), splits=splits, tables=tables)


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a bad line is an error naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise TextsqlError(
                    f"'{path}' line {line_number} is not valid JSON ({error.msg}, column {error.colno})."
                ) from None
    return rows


def _release_example(row: dict, tables: dict[str, dict], path: Path, line_number: int) -> Example:
    table = tables.get(row.get("table_id"))
    if table is None:
        raise TextsqlError(
            f"'{path}' line {line_number}: table id {row.get('table_id')!r} is not in the tables file beside it."
        )
    sql = {"sel": row["sql"]["sel"], "agg": row["sql"]["agg"], "conds": [list(c) for c in row["sql"]["conds"]]}
    return Example(question=row["question"], target=render_sql(sql, table["header"]), table_id=row["table_id"], sql=sql)


def load_hub_dataset(name: str) -> WikiSQLData:
    """A hub dataset (or a local folder in hub format): the HF wikisql features, or instruction/input/output columns."""
    import datasets

    if name.lower() in SCRIPT_DATASETS:
        raise TextsqlError(
            f"'{name}' is a script-based dataset, which datasets >= 4 refuses to load (trust_remote_code is ignored). "
            "Use a parquet copy (for example --source htriedman/wikisql), the original release files "
            "(--source path/to/data or path/to/data.tar.bz2 from github.com/salesforce/WikiSQL), or --source generate."
        )
    try:
        loaded = datasets.load_dataset(name)
    except Exception as error:  # datasets raises many types; all mean the same to the user
        raise TextsqlError(_dataset_load_message(name, error)) from None
    splits = {_split_name(split): [_hub_example(row, name) for row in rows] for split, rows in loaded.items()}
    return WikiSQLData(source=name, splits=splits, tables=_hub_tables(loaded))


def _dataset_load_message(name: str, error: Exception) -> str:
    text = str(error)
    if "scripts are no longer supported" in text.lower():
        return f"'{name}' is a script-based dataset, which datasets >= 4 refuses to load. Use a parquet copy or the original release files."

    local = f"data/{name.split('/')[-1]}"
    hint = (
        f"HF_HUB_OFFLINE is set and '{name}' is not in the local cache. On a machine with internet access run "
        f"`{download_command(name, repo_type='dataset', local_dir=local)}`, copy that folder "
        f"into the project and pass --source {local}; or copy the WikiSQL release files (data.tar.bz2) and pass their path."
        if hub_offline()
        else "No local folder of that name exists either. Check the name and your network, or pass a local folder "
        "of the WikiSQL release files instead."
    )
    return f"Could not load dataset '{name}': {text.splitlines()[0] if text else type(error).__name__}. {hint}"


def _split_name(split: str) -> str:
    return {"dev": "validation", "valid": "validation", "val": "validation"}.get(split, split)


def _hub_example(row: dict, name: str) -> Example:
    if isinstance(row.get("sql"), dict) and "human_readable" in row["sql"]:
        sql = row["sql"]
        conds = sql["conds"]
        if isinstance(conds, dict):  # a Sequence of dicts arrives as a dict of lists
            conds = [list(c) for c in zip(conds["column_index"], conds["operator_index"], conds["condition"])]
        else:
            conds = [[c["column_index"], c["operator_index"], c["condition"]] for c in conds]
        table = row.get("table") or {}
        return Example(
            question=row["question"],
            target=sql["human_readable"],
            table_id=table.get("id", ""),
            sql={"sel": sql["sel"], "agg": sql["agg"], "conds": conds},
        )
    question = row.get("question") or row.get("input")
    target = row.get("output") or row.get("answer") or row.get("query")
    if question is None or target is None:
        raise TextsqlError(
            f"Dataset '{name}' has columns {sorted(row)}; textsql needs the Hugging Face wikisql features "
            "(question, table, sql.human_readable) or question/input plus output/answer/query columns."
        )
    return Example(question=str(question), target=" ".join(str(target).split()))


def _hub_tables(loaded) -> dict[str, dict]:
    tables = {}
    for rows in loaded.values():
        if "table" not in rows.column_names:
            return {}
        for table in rows["table"]:
            tables.setdefault(table["id"], {k: table[k] for k in ("id", "header", "types", "rows")})
    return tables
