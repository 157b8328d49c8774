"""`textsql prep`: tokenized without fixed padding, labels padded with -100 per batch, lengths reported, nothing truncated silently."""

import json
import subprocess
import sys

import pytest

from textsql.arguments.prep import PrepArguments
from textsql.errors import TextsqlError
from textsql.prep import prepare_dataset
from textsql.prepared import load_prepared
from textsql.wikisql.format import VALUES_FORMAT
from textsql.wikisql.release import SAMPLE_SOURCE

NOTHING_LOST = {"examples": 0, "characters": {}, "column_names_recovered": {"examples": 0, "characters": {}}}


def test_prepared_dataset_is_unpadded_with_masks_and_metadata(assets):
    data_dir, model_dir = assets
    dataset, meta = load_prepared(data_dir)
    assert set(dataset) == {"train", "validation", "test"}
    train = dataset["train"]
    assert {"input_ids", "attention_mask", "labels", "question", "target", "table_id", "sql"} <= set(train.column_names)
    lengths = [len(ids) for ids in train["input_ids"]]
    assert len(set(lengths)) > 3, "every example has the same length: fixed padding?"
    for ids, mask, labels in zip(train["input_ids"][:200], train["attention_mask"][:200], train["labels"][:200]):
        assert len(mask) == len(ids) and set(mask) == {1}
        assert -100 not in labels and labels[-1] == 1  # ends with </s>, padded only later by the collator
    assert meta["source_prefix"] == "translate English to SQL: "
    assert meta["tokenizer"] == str(model_dir) and len(meta["tokenizer_fingerprint"]) == 16
    assert meta["examples"] == {name: len(split) for name, split in dataset.items()}
    report = meta["lengths"]["train"]
    assert (
        report["source_percentiles"]["p50"]
        <= report["source_percentiles"]["p99"]
        <= report["source_percentiles"]["p100"]
        == max(lengths)
    )
    assert report["source_over_max"] == 0 and report["target_over_max"] == 0
    assert meta["targets_lost_in_tokenization"] == NOTHING_LOST
    assert meta["source_format"] == "question" and meta["added_characters"] == {} and meta["tokenizer_dir"] is None


def test_targets_the_tokenizer_cannot_produce_are_counted(assets):
    from transformers import AutoTokenizer

    from textsql.prep import characters_lost_in_targets, tokenize_splits
    from textsql.wikisql.format import Example

    tokenizer = AutoTokenizer.from_pretrained(assets[1])
    splits = {
        "train": [Example("q", "SELECT Year FROM table WHERE Points ☃ 3"), Example("q", "SELECT Year FROM table")]
    }
    lost = characters_lost_in_targets(tokenize_splits(splits, {"train": ["p: q", "p: q"]}, tokenizer), tokenizer)
    assert lost == {"examples": 1, "characters": {"☃": 1}, "column_names_recovered": {"examples": 0, "characters": {}}}


def test_questions_start_with_the_task_prefix(assets):
    from transformers import AutoTokenizer

    data_dir, model_dir = assets
    dataset, _ = load_prepared(data_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    row = dataset["validation"][0]
    assert (
        tokenizer.decode(row["input_ids"], skip_special_tokens=True) == "translate English to SQL: " + row["question"]
    )
    assert tokenizer.decode(row["labels"], skip_special_tokens=True) == row["target"]


def test_collator_pads_per_batch_with_minus_100_labels(assets):
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq

    data_dir, model_dir = assets
    dataset, _ = load_prepared(data_dir)
    rows = dataset["train"].select_columns(["input_ids", "attention_mask", "labels"]).select(range(8))
    batch = DataCollatorForSeq2Seq(AutoTokenizer.from_pretrained(model_dir), label_pad_token_id=-100)(list(rows))
    longest_source = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == (8, longest_source)
    assert batch["attention_mask"].sum().item() == sum(len(r["input_ids"]) for r in rows)
    assert (batch["labels"] == -100).sum().item() == sum(batch["labels"].shape[1] - len(r["labels"]) for r in rows)
    assert (batch["labels"] == 0).sum().item() == 0  # pad id never appears as a label


@pytest.mark.parametrize("policy", ["error", "truncate", "drop"])
def test_overlong_examples_are_never_truncated_silently(assets, raw_wikisql, tmp_path, policy, caplog):
    _, model_dir = assets
    args = PrepArguments(
        source=str(raw_wikisql),
        model_id=str(model_dir),
        output_dir=str(tmp_path / policy),
        max_source_length=12,
        max_target_length=12,
        overlong=policy,
        source_format="question",  # the shortest sources: some fit in 12 tokens (with the columns none does)
    )
    if policy == "error":
        with pytest.raises(TextsqlError, match=r"train: \d+ questions over 12 tokens.*--overlong truncate"):
            prepare_dataset(args)
        return
    prepare_dataset(args)
    dataset, meta = load_prepared(tmp_path / policy)
    assert meta["lengths"]["train"]["source_over_max"] > 0  # the report keeps the counts before the policy
    assert ("Truncating" if policy == "truncate" else "Dropping") in caplog.text
    assert max(len(ids) for ids in dataset["train"]["input_ids"]) <= 12
    if policy == "truncate":
        assert len(dataset["train"]) == meta["lengths"]["train"]["examples"]
        assert all(ids[-1] == 1 for ids in dataset["train"]["labels"])
    else:
        assert len(dataset["train"]) < meta["lengths"]["train"]["examples"]


def test_existing_dataset_needs_overwrite(assets, raw_wikisql):
    data_dir, model_dir = assets
    # the command's flag, and the parameter of the notebooks that prepare (a notebook's prep cell meets it on a re-run)
    with pytest.raises(
        TextsqlError, match=r"already holds a prepared dataset.*--overwrite \(overwrite=True in a notebook"
    ):
        prepare_dataset(PrepArguments(source=str(raw_wikisql), model_id=str(model_dir), output_dir=str(data_dir)))


def test_bad_arguments_are_refused():
    with pytest.raises(TextsqlError, match="--overlong must be one of"):
        PrepArguments(source="generate", overlong="sometimes")


def test_prep_command_end_to_end_and_its_errors(assets, raw_wikisql, tmp_path, cpu_env):
    _, model_dir = assets
    out = tmp_path / "prepared"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "textsql.cli",
            "prep",
            "--source",
            str(raw_wikisql),
            "--model_id",
            str(model_dir),
            "--output_dir",
            str(out),
            "--max_examples_per_split",
            "50",
        ],
        capture_output=True,
        text=True,
        env=cpu_env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "p50/p95/p99/max" in done.stdout and "saved 150 examples" in done.stdout
    assert json.loads((out / "textsql_data.json").read_text())["examples"] == {
        "train": 50,
        "validation": 50,
        "test": 50,
    }

    for argv, message in [
        (["--source", str(tmp_path / "missing" / "wikisql"), "--model_id", str(model_dir)], "does not exist"),
        (
            ["--source", "generate", "--model_id", "nobody-knows/t5-none", "--output_dir", str(tmp_path / "x")],
            "HF_HUB_OFFLINE is set",
        ),
    ]:
        failed = subprocess.run(
            [sys.executable, "-m", "textsql.cli", "prep", *argv],
            capture_output=True,
            text=True,
            env=cpu_env,
            timeout=300,
            cwd=tmp_path,
        )
        assert failed.returncode == 2
        assert message in failed.stderr and "Traceback" not in failed.stderr


def test_characters_the_tokenizer_lacks_are_added_so_every_target_survives(header_assets):
    """A tokenizer trained without '<' (as real T5 vocabularies are): prep adds it, and every target round-trips."""
    from transformers import AutoTokenizer

    data_dir, model_dir = header_assets
    base = AutoTokenizer.from_pretrained(model_dir)
    assert base.unk_token_id in base("a < b")["input_ids"]
    dataset, meta = load_prepared(data_dir)
    assert list(meta["added_characters"]) == ["<"] and meta["tokenizer_dir"] == "tokenizer"  # "|" was known already
    assert meta["targets_lost_in_tokenization"] == NOTHING_LOST
    assert meta["base_tokenizer_fingerprint"] != meta["tokenizer_fingerprint"]
    extended = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    less_than = [row for row in dataset["train"] if " < " in row["target"]]
    assert less_than, "the generator makes less-than conditions"
    for row in less_than[:20]:
        assert extended.decode(row["labels"], skip_special_tokens=True) == row["target"]


def test_the_vocabulary_check_reads_the_sources_and_trains_answers_never_the_held_out_answers(
    header_assets, raw_wikisql, tmp_path
):
    """'<' in test and validation answers only (train's less-than questions left out): the tokenizer that lacks it is
    not extended (the answers scored are not read); the same '<' in a test question (an input) is added."""
    import json
    import shutil

    from textsql.wikisql.release import read_jsonl

    _, model_dir, raw = *header_assets, raw_wikisql
    for name, question_lt in (("answers", False), ("question", True)):
        release = tmp_path / name
        release.mkdir()
        for path in raw.glob("*.tables.jsonl"):
            shutil.copy(path, release / path.name)
        rows = [r for r in read_jsonl(raw / "train.jsonl") if all(op != 2 for _, op, _ in r["sql"]["conds"])]
        (release / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for split in ("dev", "test"):
            rows = read_jsonl(raw / f"{split}.jsonl")
            assert any(op == 2 for r in rows for _, op, _ in r["sql"]["conds"]), "held-out answers hold '<'"
            if question_lt and split == "test":
                rows[0]["question"] += " (a < b)"
            (release / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        meta = load_prepared(
            prepare_dataset(
                PrepArguments(source=str(release), model_id=str(model_dir), output_dir=str(tmp_path / f"data-{name}"))
            )
        )[1]
        assert ("<" in meta["added_characters"]) == question_lt, (name, meta["added_characters"])


def test_the_default_source_format_is_the_best_measured_where_the_source_has_tables(assets, raw_wikisql, tmp_path):
    """auto: the table's values for release files (and generated data); the question alone for a hub-format copy of
    questions and SQL without tables (the values need them), which it says."""
    import csv

    from textsql.arguments.decoding import DECODINGS
    from textsql.families import FAMILIES, VALUES_FORMAT, best_settings
    from textsql.wikisql.format import SOURCE_FORMATS

    assert all(best_settings(f)["source_format"] in SOURCE_FORMATS for f in FAMILIES)
    assert all(best_settings(f)["decoding"] in DECODINGS for f in FAMILIES)
    _, model_dir = assets
    release = load_prepared(
        prepare_dataset(PrepArguments(source=str(raw_wikisql), model_id=str(model_dir), output_dir=str(tmp_path / "r")))
    )[1]
    assert release["source_format"] == VALUES_FORMAT and release["arguments"]["source_format"] == VALUES_FORMAT
    assert release["values_listed"]["train"]["prompts_with_values"] > 0
    hub = tmp_path / "hub-copy"  # the instruction/input/output layout of parquet copies such as htriedman/wikisql
    hub.mkdir()
    for split in ("train", "test"):
        with open(hub / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["input", "output"])
            for row in load_prepared(assets[0])[0]["train" if split == "train" else "test"].select(range(20)):
                writer.writerow([row["question"], row["target"]])
    copy = load_prepared(
        prepare_dataset(
            PrepArguments(
                source=str(hub), model_id=str(model_dir), output_dir=str(tmp_path / "h"), validation_from_train=0
            )
        )
    )[1]
    assert copy["source_format"] == "question" and not copy["has_tables"]


def test_question_plus_header_sources_name_every_column(assets, header_assets):
    from transformers import AutoTokenizer

    from textsql.prepared import load_tables

    data_dir, _ = header_assets
    dataset, meta = load_prepared(data_dir)
    tables, tokenizer = load_tables(data_dir), AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    for row in dataset["validation"].select(range(5)):
        header = tables[row["table_id"]]["header"]
        assert tokenizer.decode(row["input_ids"], skip_special_tokens=True) == (
            "translate English to SQL: "
            + row["question"]
            + " columns: "
            + " | ".join(" ".join(h.split()) for h in header)
        )
    plain = load_prepared(assets[0])[1]
    assert meta["source_format"] == "question+header"
    assert (
        meta["lengths"]["train"]["source_percentiles"]["p50"] > plain["lengths"]["train"]["source_percentiles"]["p50"]
    )
    with pytest.raises(TextsqlError, match="source_format"):
        PrepArguments(source="generate", source_format="question+types")


def release_without_dev(raw_wikisql, folder):
    """The generated release files without dev.jsonl and its tables (shared/real's layout, and any user's subset)."""
    import shutil

    release = folder / "release-without-dev"
    release.mkdir()
    for name in ("train.jsonl", "train.tables.jsonl", "test.jsonl", "test.tables.jsonl"):
        shutil.copy(raw_wikisql / name, release / name)
    return release


def test_a_release_without_a_dev_split_gets_a_tenth_of_train_tables_as_validation_by_default(
    assets, raw_wikisql, tmp_path, caplog
):
    """Issue 41, item 4: a source without a dev split gets whole train tables held out as validation (none of them
    left in train), said in one line, so that a default training can evaluate; 0 asks for none, and says how to train."""
    _, model_dir = assets
    release = release_without_dev(raw_wikisql, tmp_path)

    def prep(folder, **more):
        args = PrepArguments(source=str(folder), model_id=str(model_dir), output_dir=str(tmp_path / "out"), **more)
        return load_prepared(prepare_dataset(args))

    with caplog.at_level("WARNING", logger="textsql.prep"):
        dataset, meta = prep(release)
    train_tables, held_out = set(dataset["train"]["table_id"]), set(dataset["validation"]["table_id"])
    total = len(dataset["train"]) + len(dataset["validation"])
    assert (
        held_out and not train_tables & held_out and total == meta["examples"]["train"] + meta["examples"]["validation"]
    )
    assert 0.1 * total <= len(dataset["validation"]) < 0.2 * total
    assert f"{len(dataset['validation'])} questions on {len(held_out)} of train's" in caplog.text
    assert "(--validation_from_train 0.1)" in caplog.text and len(caplog.records) == 1

    caplog.clear()
    with caplog.at_level("WARNING", logger="textsql.prep"):
        dataset, _ = prep(release, validation_from_train=0, overwrite=True)
    assert set(dataset) == {"train", "test"}
    assert "no validation (dev) split" in caplog.text and "--eval_strategy no" in caplog.text

    with pytest.raises(TextsqlError, match="has its own validation .dev. split"):
        prep(raw_wikisql, validation_from_train=0.1, overwrite=True)
    with pytest.raises(TextsqlError, match="from 0 to below 0.5"):
        PrepArguments(source="generate", validation_from_train=0.7)


@pytest.mark.slow
def test_a_default_training_on_a_release_without_a_dev_split_ends_with_a_validation_score(
    assets, raw_wikisql, tmp_path, textsql_in_process
):
    """Issue 41, item 4: prep of such a release, then `textsql train` with its defaults (a few steps): the run evaluates
    on the held-out tables and scores its SQL there at the end, instead of stopping at its first evaluation."""
    from textsql.evaluate import sql_token_budget
    from textsql.run_summary import read_summary

    _, model_dir = assets
    data_dir = tmp_path / "data"
    status, _, err = textsql_in_process(
        ["prep", "--source", str(release_without_dev(raw_wikisql, tmp_path)), "--model_id", str(model_dir)]
        + ["--output_dir", str(data_dir)]
    )
    assert status == 0, err[-3000:]
    dataset, meta = load_prepared(data_dir)
    validation = len(dataset["validation"])
    # the SQL scored gets room for the split's longest gold query, and not much more (a rambling model stops there)
    longest = meta["lengths"]["validation"]["target_percentiles"]["p100"]
    assert longest < sql_token_budget(meta) < 2 * longest and sql_token_budget({}) == 128
    argv = [
        "train",
        "--model_id",
        str(model_dir),
        "--dataset_dir",
        str(data_dir),
        "--runs_root",
        str(tmp_path / "runs"),
    ]
    status, out, err = textsql_in_process([*argv, "--max_steps", "2", "--per_device_train_batch_size", "8"])
    assert status == 0, err[-3000:]
    summary = read_summary(out.split("textsql-run-summary: ", 1)[1].split()[0])
    assert summary.eval_loss is not None and 0.0 <= summary.execution_accuracy <= 1.0
    assert summary.execution_accuracy_questions == min(validation, 200)
    assert f"on the first {min(validation, 200)} validation questions, end of training" in out


def test_prep_reads_the_shipped_wikisql_lines_by_name(assets, tmp_path, textsql_in_process):
    """Issue 59: `textsql prep --source wikisql-sample` reads the real lines shipped in the package (no ../shared
    needed): all 1,062 test questions, their sources listing the table's cells, and a tenth of train's tables held out
    as validation (the lines have no dev split), none of them left in train."""
    _, model_dir = assets
    data_dir = tmp_path / "data"
    status, out, err = textsql_in_process(
        ["prep", "--source", SAMPLE_SOURCE, "--model_id", str(model_dir), "--output_dir", str(data_dir)]
        + ["--source_format", VALUES_FORMAT]
    )
    assert status == 0, err[-3000:]
    dataset, meta = load_prepared(data_dir)
    assert meta["source"] == SAMPLE_SOURCE and meta["source_format"] == VALUES_FORMAT and meta["has_tables"]
    assert meta["examples"]["test"] == len(dataset["test"]) == 1062
    assert meta["values_listed"]["test"]["prompts_with_values"] > 900  # nearly every real question names a cell
    train, validation = set(dataset["train"]["table_id"]), set(dataset["validation"]["table_id"])
    assert validation and not train & validation and len(dataset["train"]) + len(dataset["validation"]) == 1000
    assert 100 <= len(dataset["validation"]) < 200
