"""Loading WikiSQL: rendering like the Hugging Face loader, the release folder and archive, the shipped sample by name,
hub-format folders, and errors."""

import hashlib
import json
import shutil
import tarfile

import pytest
from conftest import REAL_FILES

from textsql.errors import TextsqlError
from textsql.paths import WIKISQL_SAMPLE_DIR
from textsql.wikisql import release
from textsql.wikisql.format import render_sql
from textsql.wikisql.release import SAMPLE_SOURCE, load_wikisql, sample_checksums

SAMPLE_FILES = ["test.jsonl", "test.tables.jsonl", "train.jsonl", "train.tables.jsonl"]

HEADER = ["Player", "No.", "Total W–L", "Doubles W–L", "Years in Toronto"]


def test_render_matches_the_hugging_face_loader():
    assert (
        render_sql({"sel": 2, "agg": 3, "conds": [[3, 0, "11–11"]]}, HEADER)
        == "SELECT COUNT Total W–L FROM table WHERE Doubles W–L = 11–11"
    )
    # agg 0 renders as an empty string and the double space collapses; no conditions, no WHERE.
    assert render_sql({"sel": 0, "agg": 0, "conds": []}, HEADER) == "SELECT Player FROM table"
    assert render_sql({"sel": 1, "agg": 5, "conds": [[1, 1, 3.5], [0, 0, "Art  Long"]]}, HEADER) == (
        "SELECT AVG No. FROM table WHERE No. > 3.5 AND Player = Art Long"
    )
    assert render_sql({"sel": 1, "agg": 0, "conds": []}, None) == "SELECT col1 FROM table"


def test_release_folder_maps_dev_to_validation_and_keeps_tables(raw_wikisql):
    data = load_wikisql(str(raw_wikisql))
    assert set(data.splits) == {"train", "validation", "test"}
    example = data.splits["validation"][0]
    table = data.tables[example.table_id]
    assert example.target == render_sql(example.sql, table["header"])
    assert example.target.startswith("SELECT ")
    lines = (raw_wikisql / "dev.jsonl").read_text().splitlines()
    assert len(data.splits["validation"]) == len(lines)


def test_release_archive_loads_like_the_folder(raw_wikisql, tmp_path):
    archive = tmp_path / "data.tar.bz2"
    with tarfile.open(archive, "w:bz2") as tar:
        for path in raw_wikisql.glob("*.jsonl"):
            tar.add(path, arcname=f"data/{path.name}")
    from_archive, from_folder = load_wikisql(str(archive)), load_wikisql(str(raw_wikisql))
    assert [e.target for e in from_archive.splits["train"]] == [e.target for e in from_folder.splits["train"]]
    assert from_archive.source == str(archive)


def test_hub_format_folder_with_the_loader_features(raw_wikisql, tmp_path):
    """A parquet copy in the HF wikisql feature layout (conds as a dict of lists) loads with its tables."""
    from datasets import Dataset

    data = load_wikisql(str(raw_wikisql))
    rows = []
    for e in data.splits["train"][:20]:
        table = data.tables[e.table_id]
        conds = {
            "column_index": [c[0] for c in e.sql["conds"]],
            "operator_index": [c[1] for c in e.sql["conds"]],
            "condition": [str(c[2]) for c in e.sql["conds"]],
        }
        rows.append(
            {
                "phase": 1,
                "question": e.question,
                "table": {
                    "id": table["id"],
                    "header": table["header"],
                    "types": table["types"],
                    "rows": [[str(c) for c in r] for r in table["rows"]],
                },
                "sql": {"human_readable": e.target, "sel": e.sql["sel"], "agg": e.sql["agg"], "conds": conds},
            }
        )
    folder = tmp_path / "hub-copy"
    (folder / "data").mkdir(parents=True)
    Dataset.from_list(rows).to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    loaded = load_wikisql(str(folder))
    assert [e.target for e in loaded.splits["train"]] == [e.target for e in data.splits["train"][:20]]
    assert loaded.splits["train"][0].sql["conds"][0][0] == data.splits["train"][0].sql["conds"][0][0]
    assert data.splits["train"][0].table_id in loaded.tables


def test_instruction_style_hub_copy(tmp_path):
    from datasets import Dataset

    folder = tmp_path / "plain"
    (folder / "data").mkdir(parents=True)
    Dataset.from_list(
        [{"instruction": "x", "input": "How many wins?", "output": "SELECT COUNT  Wins FROM table"}]
    ).to_parquet(str(folder / "data" / "train.parquet"))
    (example,) = load_wikisql(str(folder)).splits["train"]
    assert (example.question, example.target, example.sql) == ("How many wins?", "SELECT COUNT Wins FROM table", None)


def test_script_based_wikisql_is_refused_with_the_reason():
    with pytest.raises(TextsqlError, match="script-based.*parquet copy"):
        load_wikisql("wikisql")


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(TextsqlError, match="does not exist"):
        load_wikisql(str(tmp_path / "nowhere" / "data"))


def test_offline_unknown_hub_dataset_says_what_to_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        TextsqlError,
        match="HF_HUB_OFFLINE is set.*`hf download someone/wikisql-copy --repo-type dataset --local-dir data/wikisql-copy`",
    ):
        load_wikisql("someone/wikisql-copy")


def test_question_pointing_at_a_missing_table(tmp_path):
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"phase": 1, "table_id": "t9", "question": "q", "sql": {"sel": 0, "agg": 0, "conds": []}}) + "\n"
    )
    (tmp_path / "train.tables.jsonl").write_text(
        json.dumps({"id": "t1", "header": ["a"], "types": ["text"], "rows": [["x"]]}) + "\n"
    )
    with pytest.raises(TextsqlError, match="line 1: table id 't9'"):
        load_wikisql(str(tmp_path))


def test_the_shipped_sample_has_its_recorded_sha256_and_loads_by_name():
    """Issue 59: the real lines shipped in the package have the sha256 their SHA256SUMS records, beside WikiSQL's
    licence and a README, and load by name: 1,000 train and 1,062 test questions on their 256 and 302 tables."""
    recorded = sample_checksums()
    assert sorted(recorded) == SAMPLE_FILES
    for name, digest in recorded.items():
        assert hashlib.sha256((WIKISQL_SAMPLE_DIR / name).read_bytes()).hexdigest() == digest, name
    assert sorted(p.name for p in WIKISQL_SAMPLE_DIR.iterdir()) == sorted(
        [*SAMPLE_FILES, "LICENSE", "README.md", "SHA256SUMS"]
    )
    licence = (WIKISQL_SAMPLE_DIR / "LICENSE").read_text()
    assert (
        licence.startswith("BSD 3-Clause License\n\nCopyright (c) 2017, Salesforce Research\n")
        and "NEGLIGENCE" in licence
    )
    data = load_wikisql(SAMPLE_SOURCE)
    assert data.source == SAMPLE_SOURCE  # the name, not the installed folder
    assert {split: len(examples) for split, examples in data.splits.items()} == {"train": 1000, "test": 1062}
    assert len(data.tables) == 256 + 302


def test_the_shipped_sample_is_byte_for_byte_the_shared_real_copy():
    """The shipped files are ../shared/real/wikisql's, whose README says where they come from."""
    sums = REAL_FILES / "SHA256SUMS"
    if not sums.is_file():
        pytest.skip(
            f"{sums.resolve()} is absent (only a checkout beside ../shared has it); the shipped files' own SHA256SUMS "
            "is checked by the test before this one"
        )
    shared = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if name.startswith("./wikisql/") and name.count("/") == 2:  # not wikisql/questions_full/
            shared[name.removeprefix("./wikisql/")] = digest
    assert sample_checksums() == shared


def test_an_edited_copy_of_the_sample_is_refused_with_the_fix(tmp_path, monkeypatch):
    copy = tmp_path / "sample"
    shutil.copytree(WIKISQL_SAMPLE_DIR, copy)
    lines = (copy / "test.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (copy / "test.jsonl").write_text("".join(lines[1:]), encoding="utf-8")
    monkeypatch.setattr(release, "WIKISQL_SAMPLE_DIR", copy)  # the package's folder, as if it had been edited
    with pytest.raises(
        TextsqlError, match=r"test.jsonl' is not the file textsql shipped .*--source path/to/that/folder"
    ):
        load_wikisql(SAMPLE_SOURCE)
    assert len(load_wikisql(str(copy)).splits["test"]) == 1061  # as a folder of the user's own, it reads
