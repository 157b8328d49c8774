"""On genuine pieces of WikiSQL (the lines shipped in the package) and of Google's T5 tokenizer (../shared/real): prep with
either tokenizer file, the characters it adds, lengths, scoring every real gold query, and inference with the real
vocabulary. The tests that need a real tokenizer skip where ../shared/real is absent."""

import json
import shutil
import unicodedata

import pytest

from textsql.arguments.prep import PrepArguments
from textsql.prep import prepare_dataset
from textsql.prepared import load_prepared
from textsql.wikisql.format import render_sql
from textsql.wikisql.release import SAMPLE_SOURCE, load_wikisql
from textsql.wikisql.sql import execute_query, parse_sql, same_logical_form, score_prediction

T5_FILES = ("spiece.model", "tokenizer.json")  # the two ways a user has T5's tokenizer: SentencePiece, HF's fast file


@pytest.fixture(scope="module")
def real_wikisql():
    return load_wikisql(SAMPLE_SOURCE)


def examples(data):
    return [(example, data.tables[example.table_id]) for split in data.splits.values() for example in split]


def t5_folder(real_files, tokenizer_file: str, folder):
    """A model folder as a user has it: t5-base's config.json and one tokenizer file (copies, in a temporary folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(real_files / "t5" / tokenizer_file, folder / tokenizer_file)
    shutil.copy(real_files / "t5" / "t5-base" / "config.json", folder / "config.json")
    return folder


@pytest.fixture(scope="module")
def real_prepared(real_files, tmp_path_factory):
    """{tokenizer file: prepared folder}: the real release files as question+header sources, prepared with each file."""
    root = tmp_path_factory.mktemp("real-prep")
    prepared = {}
    for name in T5_FILES:
        model_dir = t5_folder(real_files, name, root / f"t5-{name}")
        arguments = PrepArguments(
            source=SAMPLE_SOURCE,
            model_id=str(model_dir),
            output_dir=str(root / f"data-{name}"),
            source_format="question+header",
        )
        prepared[name] = prepare_dataset(arguments)
    return prepared


# --------------------------------------------------------------------------- scoring


def test_every_real_gold_query_reads_back_as_itself_and_scores_right(real_wikisql):
    pairs = examples(real_wikisql)
    assert len(pairs) == 2062
    for example, table in pairs:
        text = render_sql(example.sql, table["header"])
        assert text == example.target
        # The parser itself reads it right (not only the exact-text rule of score_prediction) ...
        assert same_logical_form(parse_sql(text, table["header"], table["rows"]), example.sql), text
        # ... and it scores exact, logical form and execution right, with the gold query given or parsed from the text.
        for gold in (example.sql, None):
            scored = score_prediction(text, text, gold, table)
            assert scored["exact_match"] and scored["logical_form_match"] and scored["execution_match"], (text, scored)


def test_real_gold_targets_as_t5_gives_them_back_keep_their_columns(real_wikisql):
    """T5's normalizer rewrites ², ³ and ½ (NFKC): column names are still read; a value so rewritten is another one."""
    rewritten_columns = rewritten_values = 0
    for example, table in examples(real_wikisql):
        written = unicodedata.normalize("NFKC", example.target)
        if written == example.target:
            continue
        query = parse_sql(written, table["header"], table["rows"])
        values_rewritten = any(unicodedata.normalize("NFKC", str(v)) != str(v) for _, _, v in example.sql["conds"])
        scored = score_prediction(written, example.target, example.sql, table)
        if values_rewritten:
            rewritten_values += 1
            assert not scored["logical_form_match"] and not scored["execution_match"]
        else:
            rewritten_columns += 1
            assert same_logical_form(query, example.sql) and scored["logical_form_match"] and scored["execution_match"]
    assert (rewritten_columns, rewritten_values) == (9, 2)


def variants(query: dict, table: dict) -> list[dict]:
    """Near misses of a gold query: another aggregation, operator, column, value (its case, another cell's)."""
    out = [dict(query, agg=(query["agg"] + 3) % 6), dict(query, sel=(query["sel"] + 1) % len(table["header"]))]
    for i, (column, op, value) in enumerate(query["conds"]):
        other_cell = table["rows"][-1][column]
        for changed in ([column, (op + 1) % 3, value], [column, op, str(value).upper()], [column, op, other_cell]):
            out.append(dict(query, conds=query["conds"][:i] + [changed] + query["conds"][i + 1 :]))
        out.append(dict(query, conds=query["conds"][:i] + query["conds"][i + 1 :]))
    return out


def structured_score(predicted: dict, gold: dict, table: dict) -> tuple[bool, bool]:
    """WikiSQL's verdict on a structured prediction (Query.__eq__ and DBEngine, as textsql.wikisql.sql implements them)."""
    try:
        executes = execute_query(predicted, table) == execute_query(gold, table)
    except ValueError:
        executes = False
    return same_logical_form(predicted, gold), executes


def test_rendered_near_misses_of_real_gold_queries_score_as_their_structured_queries(real_wikisql):
    """The text path (render, parse against the table, score) gives the verdict the structured query gets, on every
    real table; WikiSQL's own evaluate.py gives the same on these (docs/sql-quality.md says how that was checked)."""
    checked = 0
    for example, table in examples(real_wikisql):
        for variant in variants(example.sql, table):
            scored = score_prediction(render_sql(variant, table["header"]), example.target, example.sql, table)
            verdict = (scored["logical_form_match"], scored["execution_match"])
            assert verdict == structured_score(variant, example.sql, table), variant
            checked += 1
    assert checked > 10_000


# --------------------------------------------------------------------------- prep with the real tokenizer


def test_prep_with_either_t5_file_adds_the_characters_t5_lacks(real_prepared):
    metas = {name: load_prepared(folder)[1] for name, folder in real_prepared.items()}
    datasets = {name: load_prepared(folder)[0] for name, folder in real_prepared.items()}
    spiece, fast = (metas[name] for name in T5_FILES)
    for key in (
        "added_characters",
        "characters_changed_by_normalizer",
        "targets_lost_in_tokenization",
        "lengths",
        "examples",
    ):
        assert spiece[key] == fast[key], key
    assert spiece["tokenizer_fingerprint"] == fast["tokenizer_fingerprint"]  # the same vocabulary either way
    for split in ("train", "test"):
        assert datasets["spiece.model"][split]["input_ids"] == datasets["tokenizer.json"][split]["input_ids"]
    meta = spiece
    # No dev split in the shipped lines: 10% of train's tables are held out as validation, whole tables at a time.
    assert meta["examples"] == {"train": 898, "validation": 102, "test": 1062}
    added = meta["added_characters"]
    # T5 maps these to <unk>: '<' (4 less-than queries), '^', '~', accented letters, CJK, and '⁄' (NFKC makes ½ 1⁄2).
    assert {"<", "^", "~", "⁄", "ā", "š", "大"} <= set(added) and len(added) == 51
    assert set(meta["characters_changed_by_normalizer"]) == {"²", "³", "½"}
    assert meta["targets_lost_in_tokenization"] == {
        "examples": 2,
        "characters": {"½": 2},  # two values (Ranma ½): WikiSQL compares values as written
        "column_names_recovered": {"examples": 9, "characters": {"²": 8, "³": 1}},
    }


def test_real_lengths_and_every_less_than_target_round_trips(real_files, real_prepared):
    from transformers import AutoTokenizer

    data_dir = real_prepared["tokenizer.json"]
    dataset, meta = load_prepared(data_dir)
    tokenizer = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    for split, report in meta["lengths"].items():
        sources = [len(ids) for ids in dataset[split]["input_ids"]]
        targets = [len(ids) for ids in dataset[split]["labels"]]
        source, target = report["source_percentiles"], report["target_percentiles"]
        assert source["p100"] == max(sources) and target["p100"] == max(targets)
        assert 30 < source["p50"] < 60 and 12 < target["p50"] < 30  # t5's tokens for WikiSQL's questions and SQL
    less_than = [row for split in dataset.values() for row in split if " < " in row["target"]]
    assert len(less_than) == 4  # the real files' '<' conditions: 2 in test, 2 in train
    base = AutoTokenizer.from_pretrained(t5_folder(real_files, "tokenizer.json", data_dir.parent / "plain-t5"))
    for row in less_than:
        assert tokenizer.decode(row["labels"], skip_special_tokens=True) == row["target"]
        assert base.unk_token_id in base(row["target"])["input_ids"]  # stock T5 could never write it


# --------------------------------------------------------------------------- inference with the real vocabulary


def test_infer_on_a_model_with_the_real_vocabulary(real_prepared, textsql_in_process, tmp_path):
    """A tiny T5 (random weights) with the real 32k vocabulary plus prep's characters: generation, parsing against
    real headers and scoring run end to end, and every output is scored (none crashes the parser)."""
    from transformers import AutoTokenizer

    from textsql.tiny import build_tiny_t5

    data_dir = real_prepared["spiece.model"]
    tokenizer = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    model = build_tiny_t5(tokenizer, d_model=32, num_layers=1, num_heads=2, d_ff=64, seed=0)
    assert model.config.vocab_size == len(tokenizer) > 32100
    model_dir = tmp_path / "real-vocab-t5"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    status, out, err = textsql_in_process(
        [
            "infer",
            "--model_dir",
            str(model_dir),
            "--dataset_dir",
            str(data_dir),
            "--split",
            "test",
            "--max_examples",
            "12",
            "--batch_size",
            "12",
            "--max_new_tokens",
            "12",
            "--show_examples",
            "1",
            "--output_dir",
            str(tmp_path / "scored"),
        ]
    )
    assert status == 0, err
    metrics = json.loads((tmp_path / "scored" / "eval_metrics.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "scored" / "predictions.jsonl").read_text().splitlines()]
    assert metrics["examples"] == len(records) == 12 and metrics["source_format"] == "question+header"
    assert all(isinstance(r["predicted_sql"], str) and (r["parsed"] is not None or r["parse_error"]) for r in records)
    assert "Model Prediction:" in out


def test_a_t5_reading_cell_values_gets_the_same_source_for_a_typed_question(real_files, textsql_in_process, tmp_path):
    """question+header+values for T5 with the real vocabulary: prep keeps each source as fitted, model_source builds
    it again from the table, and `textsql infer --question --table_id` gives the model that source (so its SQL)."""
    from transformers import AutoTokenizer

    from textsql.prepared import load_tables
    from textsql.prompts import model_source
    from textsql.tiny import build_tiny_t5

    t5 = t5_folder(real_files, "tokenizer.json", tmp_path / "t5")
    data_dir = prepare_dataset(
        PrepArguments(
            source=SAMPLE_SOURCE,
            model_id=str(t5),
            output_dir=str(tmp_path / "data"),
            source_format="question+header+values",
            max_examples_per_split=24,
        )
    )
    dataset, meta = load_prepared(data_dir)
    tokenizer = AutoTokenizer.from_pretrained(data_dir / meta["tokenizer_dir"] if meta["tokenizer_dir"] else t5)
    tables = load_tables(data_dir)
    rows = dataset["test"]
    assert sum(" values: " in source for source in rows["source"]) >= 20  # most real questions name a cell
    for row in rows:
        assert row["source"] == model_source(row["question"], tables[row["table_id"]], meta, tokenizer)
        assert tokenizer.decode(row["input_ids"], skip_special_tokens=True) == " ".join(row["source"].split())
    model_dir = tmp_path / "values-t5"
    build_tiny_t5(tokenizer, d_model=32, num_layers=1, num_heads=2, d_ff=64, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    common = ["infer", "--model_dir", str(model_dir), "--dataset_dir", str(data_dir), "--max_new_tokens", "8"]
    status, _, err = textsql_in_process(
        [*common, "--max_examples", "2", "--batch_size", "1", "--output_dir", str(tmp_path / "scored")]
    )
    assert status == 0, err
    record = json.loads((tmp_path / "scored" / "predictions.jsonl").read_text().splitlines()[0])
    status, out, err = textsql_in_process([*common, "--question", record["question"], "--table_id", record["table_id"]])
    assert status == 0, err
    assert f"Model Prediction: {record['predicted_sql']}" in out


# --------------------------------------------------------------------------- benchmark shapes


def test_benchmark_t5_shapes_are_the_real_checkpoints(real_files, tmp_path):
    """bench/shapes.py: t5-base and t5-large from their real config.json, t5-small from the known shape, all equal to
    textsql.planner.shape.T5_SHAPES (the planner's), with the checkpoints' parameter counts (random weights, meta device)."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    from textsql.planner.shape import T5_SHAPES

    path = Path(__file__).resolve().parents[2] / "bench" / "shapes.py"
    spec = importlib.util.spec_from_file_location("bench_shapes", path)
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    tokenizer = AutoTokenizer.from_pretrained(t5_folder(real_files, "tokenizer.json", tmp_path / "t5"))
    parameters = {"t5-small": 60_506_624, "t5-base": 222_903_552, "t5-large": 737_668_096}  # the checkpoints' counts
    for name in shapes.T5_NAMES:
        config, source = shapes.t5_config(name, tokenizer, real_files / "t5")
        real_config = real_files / "t5" / name / "config.json"
        assert source == (str(real_config) if name != "t5-small" else "textsql.planner.shape.T5_SHAPES")
        assert {key: getattr(config, key) for key in shapes.SHAPE_KEYS} == T5_SHAPES[name]
        assert config.vocab_size == 32128 and config.num_decoder_layers == config.num_layers
        model = shapes.build_t5(config, seed=0, device="meta")
        assert sum(p.numel() for p in model.parameters()) == parameters[name], name
    extended = type("Extended", (), {"__len__": lambda self: 32201, "pad_token_id": 0, "eos_token_id": 1})()
    grown, _ = shapes.t5_config("t5-small", extended)
    assert grown.vocab_size == 32201  # prep's added characters beyond the checkpoint's 28 spare rows


# --------------------------------------------------------------------------- causal LMs: the real Qwen2 and GPT-2 tokenizers

CAUSAL_TOKENIZERS = ("qwen2", "gpt2")  # ../shared/real/<name>: Qwen2's EOS is its pad token, GPT-2 has no pad token


@pytest.fixture(scope="module")
def real_causal_prepared(real_files, tmp_path_factory):
    """{name: (model folder, prepared folder)}: every real question as question+header prompts for a tiny random model
    with each real causal tokenizer."""
    from conftest import real_causal_folder

    root = tmp_path_factory.mktemp("real-causal")
    prepared = {}
    for name in CAUSAL_TOKENIZERS:
        folder = real_causal_folder(real_files, name, root / name)
        arguments = PrepArguments(
            source=SAMPLE_SOURCE,
            model_id=str(folder),
            output_dir=str(root / f"data-{name}"),
            source_format="question+header",
        )
        prepared[name] = folder, prepare_dataset(arguments)
    return prepared


def real_texts(data) -> list[str]:
    """Real WikiSQL text a causal tokenizer meets: questions, gold SQL, column lists and the tables' first rows."""
    texts = [text for example, _ in examples(data) for text in (example.question, example.target)]
    for table in data.tables.values():
        texts.append(" | ".join(table["header"]))
        texts.extend(" ".join(str(cell) for cell in row) for row in table["rows"][:3])
    return texts


def test_real_causal_tokenizers_lay_out_every_real_question_and_report_its_lengths(real_causal_prepared):
    """Each real question: the plain prompt with the table's whole column list, then the SQL and EOS, labels -100
    exactly on the prompt; the prompt and SQL decode back whole; the length report is that of these sequences."""
    from textsql.hub import load_tokenizer
    from textsql.prepared import load_tables
    from textsql.prompts import model_source

    for name, (folder, data_dir) in real_causal_prepared.items():
        dataset, meta = load_prepared(data_dir)
        tokenizer = load_tokenizer(str(folder))
        tables = load_tables(data_dir)
        assert meta["examples"] == {"train": 898, "validation": 102, "test": 1062}, name  # nothing dropped
        assert meta["byte_level"] and meta["added_characters"] == {}, name
        assert meta["targets_lost_in_tokenization"]["examples"] == 0, name  # '<', '½', accents, CJK: all written
        assert all(fitted["columns_cut"] == 0 for fitted in meta["prompts_fitted"].values()), name
        for split, rows in dataset.items():
            prompts, answers = [], []
            for row in rows:
                n = row["labels"].count(-100)
                assert row["labels"] == [-100] * n + row["input_ids"][n:], (name, row["question"])
                assert row["input_ids"][-1] == tokenizer.eos_token_id
                assert row["prompt"] == model_source(row["question"], tables[row["table_id"]], meta, tokenizer)
                assert tokenizer.decode(row["input_ids"][:n]) == row["prompt"]
                assert tokenizer.decode(row["input_ids"][n:-1]) == row["target"]
                prompts.append(n)
                answers.append(len(row["input_ids"]) - n)
            report = meta["lengths"][split]
            assert report["source_percentiles"]["p100"] == max(prompts) and report["examples"] == len(rows)
            assert report["target_percentiles"]["p100"] == max(answers)
            longest = max(p + a for p, a in zip(prompts, answers))
            assert report["sequence_percentiles"]["p100"] == longest <= max(prompts) + max(answers)
            assert report["mean_tokens_per_example"] == pytest.approx((sum(prompts) + sum(answers)) / len(rows))
            # a real question with its columns: tens of tokens; the SQL and EOS: about ten to thirty
            assert 20 < report["source_percentiles"]["p50"] < 120 and 8 < report["target_percentiles"]["p50"] < 40


def test_a_byte_level_tokenizer_trained_here_reads_real_wikisql_as_before_it_was_saved(
    real_wikisql, real_files, tmp_path
):
    """The pitfall: AutoTokenizer on a folder whose config says qwen2 returns Qwen2Tokenizer, which rebuilds the
    pre-tokenizer in code. The tokenizer textsql trains on generated text (the demo's, the tests') must give, once saved
    and loaded back from disk, the in-memory tokenizer's ids on real WikiSQL text it never saw, and the real Qwen2
    tokenizer file the ids its own pre-tokenizer gives."""
    from tokenizers import Tokenizer

    from textsql.demo.tiny import release_records
    from textsql.hub import load_tokenizer
    from textsql.tiny import corpus_for_tokenizer, make_tiny_causal_model, train_byte_level_tokenizer
    from textsql.wikisql.synthetic import generate_wikisql

    raw = generate_wikisql(tmp_path / "generated", train_tables=20, dev_tables=4, test_tables=4, questions_per_table=5)
    in_memory = train_byte_level_tokenizer(corpus_for_tokenizer(*release_records(raw), prefix=""), vocab_size=1000)
    folder = make_tiny_causal_model(tmp_path / "tiny-qwen2", [], tokenizer=in_memory, hidden_size=16, num_layers=1)
    reloaded = load_tokenizer(str(folder))
    assert type(reloaded).__name__ == "Qwen2Tokenizer"  # rebuilt in code, not the file's pre-tokenizer
    texts = real_texts(real_wikisql)
    assert len(texts) > 5000
    differ = [text for text in texts if reloaded(text)["input_ids"] != in_memory(text)["input_ids"]]
    assert not differ, f"{len(differ)} of {len(texts)} real texts get other ids once reloaded, e.g. {differ[:3]}"
    assert all(reloaded.decode(reloaded(text)["input_ids"]) == text for text in texts if text == text.strip())
    from_file = Tokenizer.from_file(str(real_files / "qwen2" / "tokenizer.json"))
    auto = load_tokenizer(str(real_files / "qwen2"))
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert [auto(text)["input_ids"] for text in texts] == [from_file.encode(text).ids for text in texts]
