"""Tests for constrained decoding: the grammar automaton (textsql.wikisql.constrained), tokenizers walked jointly with it,
and generation under it on the tiny models of both families and real tokenizers."""

import json
import random

import pytest

from textsql.errors import TextsqlError
from textsql.paths import WIKISQL_SAMPLE_DIR
from textsql.wikisql.constrained import MAX_CONDITIONS, QueryGrammar, vocabulary_of
from textsql.wikisql.format import render_sql
from textsql.wikisql.sql import execute_query, parse_sql

TABLE = {
    "id": "1-test",
    "header": ["Team", "Team name", "Points", "Year (est.)", "Area (km²)", "A AND B", "Max"],
    "types": ["text", "text", "real", "real", "real", "text", "text"],
    "rows": [
        ["St. Louis Blues", "Blues", 12, 1995, 3.0, "x and y", "top"],
        ["Boston", "Bruins (B's)", "1,234", 2001, 4.5, "z", "low"],
    ],
}
QUESTION = 'How many points did "Rangers" score in 1995?'


def walk(grammar: QueryGrammar, text: str):
    return grammar.advance(grammar.initial, text.encode("utf-8"))


@pytest.fixture(scope="module")
def grammar() -> QueryGrammar:
    return QueryGrammar(TABLE, QUESTION)


@pytest.mark.parametrize(
    "text",
    [
        "SELECT Team FROM table",
        "SELECT Team name FROM table",  # a column whose name extends another's
        " SELECT MAX Points FROM table",  # SentencePiece's first token writes a space first
        "SELECT COUNT Team FROM table WHERE Year (est.) > 1995",  # a number from the question, a name with punctuation
        "SELECT Team FROM table WHERE Team = St. Louis Blues",  # a cell with spaces and punctuation
        "SELECT Team FROM table WHERE Team = st. louis blues",  # ... lower-cased
        "SELECT Team FROM table WHERE Team name = Bruins (B's)",
        "SELECT Team FROM table WHERE Team = Rangers",  # a question word without its quotes
        'SELECT Team FROM table WHERE Team = "Rangers" score',  # an n-gram as written
        "SELECT Points FROM table WHERE Points = 1,234 AND Area (km2) < 3",  # a cell; the NFKC name parse_sql reads
        "SELECT Team FROM table WHERE A AND B = x and y AND Max = top",  # names and cells holding AND
        "SELECT Max FROM table",
    ],
)
def test_complete_queries_are_accepted_and_parse_and_execute(grammar, text):
    state = walk(grammar, text)
    assert grammar.accepting(state), text
    query = parse_sql(text, TABLE["header"], TABLE["rows"])
    execute_query(query, TABLE)


@pytest.mark.parametrize(
    "text",
    [
        "SELECT Teams",  # no such column
        "SELECT Team FROM tables",
        "select Team",  # keywords as render_sql writes them
        "SELECT  Team",  # one space, as whitespace is collapsed
        "SELECT Team FROM table WHERE Team = Chicago",  # neither in the question nor in the cells
        "SELECT Team FROM table WHERE Points = Rangers",  # a real column takes numbers only
        "SELECT Team FROM table WHERE Team = points did and",  # an n-gram holding AND that is no cell
        "SELECT Team FROM table WHERE Team == Rangers",
        "SELECT Team FROM table WHERE Team >= 1995",
        "SELECT AVG MAX Points",
    ],
)
def test_refused_prefixes(grammar, text):
    assert not walk(grammar, text)


@pytest.mark.parametrize(
    "text", ["SELECT Tea", "SELECT Team", "SELECT Team FROM table WHERE", "SELECT Team FROM table WHERE Team = St. Lo"]
)
def test_prefixes_that_are_not_queries_yet(grammar, text):
    state = walk(grammar, text)
    assert state and not grammar.accepting(state) and grammar.remaining(state) > 0
    assert grammar.accepting(walk(grammar, "SELECT Team FROM table"))  # "SELECT Team" goes on to one


def test_conditions_are_capped_and_remaining_counts_bytes(grammar):
    condition = " AND Team = Boston"
    text = "SELECT Team FROM table WHERE Team = Boston" + condition * (MAX_CONDITIONS - 1)
    assert grammar.accepting(walk(grammar, text)) and not walk(grammar, text + " AND")
    assert grammar.remaining(grammar.initial) == len("SELECT Max FROM table")  # the shortest query there is
    assert grammar.remaining(walk(grammar, "SELECT Team FROM table WHERE Max = ")) == len("in")  # a question word


def random_query(grammar: QueryGrammar, rng: random.Random, longest: int = 160) -> str:
    """A random string of the grammar: random bytes among those the automaton allows, heading for the end (the fewest
    bytes left) once past `longest`, stopping at an accepting state now and then."""
    state, data = grammar.initial, b""
    while True:
        if grammar.accepting(state) and (rng.random() < 0.3 or len(data) > longest):
            return data.decode("utf-8")
        following = sorted({byte for _, node, _, _ in state if node is not None for byte in node.children})
        moves = [(byte, grammar.advance(state, bytes((byte,)))) for byte in following]
        moves = [(byte, moved) for byte, moved in moves if moved and grammar.remaining(moved) < float("inf")]
        if not moves:  # the automaton never leads where nothing can follow but a complete query
            assert grammar.accepting(state), data
            return data.decode("utf-8")
        if len(data) > longest:
            byte, state = min(moves, key=lambda move: grammar.remaining(move[1]))
        else:
            byte, state = rng.choice(moves)
        data += bytes((byte,))


def test_every_string_of_the_grammar_parses_and_executes(grammar):
    rng = random.Random(0)
    for _ in range(300):
        text = random_query(grammar, rng)
        query = parse_sql(text, TABLE["header"], TABLE["rows"])
        execute_query(query, TABLE)
        assert query["sel"] < len(TABLE["header"]) and all(c < len(TABLE["header"]) for c, _, _ in query["conds"])


def real_lines(count):
    """(question, table, structured query) of the first `count` real test questions (the lines shipped in the package)."""
    tables = {}
    for line in open(WIKISQL_SAMPLE_DIR / "test.tables.jsonl", encoding="utf-8"):
        table = json.loads(line)
        tables[table["id"]] = table
    lines = [
        json.loads(line) for line, _ in zip(open(WIKISQL_SAMPLE_DIR / "test.jsonl", encoding="utf-8"), range(count))
    ]
    return [(line["question"], tables[line["table_id"]], line["sql"]) for line in lines]


def test_real_grammars_parse_and_execute():
    rng = random.Random(1)
    for question, table, _ in real_lines(40):
        grammar = QueryGrammar(table, question)
        for _ in range(10):
            text = random_query(grammar, rng)
            execute_query(parse_sql(text, table["header"], table.get("rows")), table)


def unreachable(tokenizer, lines) -> list[tuple[str, str]]:
    """(gold SQL, the prefix refused) for each gold query whose own tokenization the constraint does not allow."""
    vocabulary = vocabulary_of(tokenizer)
    producible = vocabulary.producible()
    refused = []
    for question, table, sql in lines:
        gold = render_sql(sql, table["header"])
        grammar = QueryGrammar(table, question, producible)
        state, ids = grammar.initial, tokenizer(gold, add_special_tokens=False).input_ids
        for n, token in enumerate(ids):
            if token not in grammar.allowed(state, vocabulary)[0]:
                refused.append((gold, vocabulary.text(ids[: n + 1])))
                break
            state = grammar.advance(state, vocabulary.token_bytes[token])
        else:
            if not grammar.accepting(state):
                refused.append((gold, "the end"))
    return refused


@pytest.mark.parametrize("name", ["qwen2", "t5", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_real_gold_queries_are_reachable_token_by_token(request, name):
    """The real tokenizers' own tokenization of the gold SQL is allowed at every step for >= 95% of real test questions
    (T5's vocabulary lacks `~`, `^` and `☉`, which a few column names hold)."""
    from transformers import AutoTokenizer

    if name == "smollm2":
        folder = request.getfixturevalue("real_model")
    else:  # the real tokenizers in ../shared/real
        folder = request.getfixturevalue("real_files") / name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lines = real_lines(200)
    refused = unreachable(tokenizer, lines)
    assert len(refused) <= 0.05 * len(lines), refused


def test_tokenizers_it_cannot_drive_are_refused(assets):
    """T5's and byte-level BPE tokenizers are driven (one vocabulary per tokenizer object); a WordPiece tokenizer (BERT's
    kind: '##' continuations) and an object without a fast tokenizer's backend are refused, saying so."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(assets[1])
    assert vocabulary_of(tokenizer).kind == "sentencepiece" and vocabulary_of(tokenizer) is vocabulary_of(tokenizer)
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "select": 1, "##s": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    with pytest.raises(TextsqlError, match="WordPiece"):
        vocabulary_of(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]"))
    with pytest.raises(TextsqlError, match="fast"):
        vocabulary_of(object())


def constrained_records(data_dir, model_dir, decoding, num_beams, **kwargs):
    from textsql.evaluate import decode_and_score, load_scoring_set
    from textsql.hub import load_tokenizer
    from textsql.loading import load_for_inference

    model, tokenizer = load_for_inference(str(model_dir), "cpu")
    tokenizer = load_tokenizer(str(model_dir)) if tokenizer is None else tokenizer
    scoring = load_scoring_set(str(data_dir), "test", 6)
    return scoring, decode_and_score(
        model, tokenizer, scoring, decoding=decoding, num_beams=num_beams, progress=False, batch_size=6, **kwargs
    )


@pytest.mark.parametrize("family", ["t5", "causal"])
@pytest.mark.parametrize("decoding,num_beams", [("constrained", 1), ("constrained+execution_guided", 3)])
def test_untrained_tiny_models_write_only_queries_over_their_table(assets, causal_assets, family, decoding, num_beams):
    """Untrained tiny models write garbage; under the constraint every answer (greedy, and every beam) parses against
    its own table, names only its columns and executes, within a budget of new tokens the answers must fit in."""
    data_dir, model_dir = assets if family == "t5" else causal_assets
    scoring, (records, metrics) = constrained_records(
        data_dir, model_dir, decoding, num_beams, compare_to_greedy=True, max_new_tokens=24
    )
    assert metrics["parse_errors"] == 0 and metrics["decoding"]["unconstrained_questions"] == 0
    for record in records:
        table = scoring.tables[record["table_id"]]
        assert record["parse_error"] is None, record
        assert not (record["execution_error"] or "").startswith("predicted"), record
        query = record["parsed"]
        assert all(column < len(table["header"]) for column in [query["sel"]] + [c for c, _, _ in query["conds"]])
    decoding_block = metrics["decoding"]
    against = decoding_block["against_greedy"]
    assert against["net"] == against["fixed"] - against["broken"]
    assert decoding_block["greedy_execution_accuracy"] * len(records) + against["net"] == pytest.approx(
        metrics["execution_accuracy"] * len(records)
    )
    top, choice = decoding_block["top_candidate_against_greedy"], decoding_block["choice_against_top_candidate"]
    assert top["net"] + choice["net"] == against["net"]


@pytest.mark.slow
def test_real_model_writes_queries_that_parse_under_the_constraint(real_model):
    """SmolLM2-135M-Instruct, not fine-tuned for SQL, prompted as textsql prompts a causal LM: greedy decoding under the
    constraint parses and executes on 8 real test questions of 8."""
    from textsql.evaluate import ScoringSet, decode_and_score
    from textsql.loading import load_for_inference
    from textsql.prompts import source_text

    model, tokenizer = load_for_inference(str(real_model), "cpu")
    lines = real_lines(8)
    tables = {table["id"]: table for _, table, _ in lines}
    scoring = ScoringSet(
        sources=[source_text(q, t["header"], "", "question+header", layout="causal") for q, t, _ in lines],
        questions=[q for q, _, _ in lines],
        table_ids=[t["id"] for _, t, _ in lines],
        gold_texts=[render_sql(sql, t["header"]) for _, t, sql in lines],
        gold_queries=[sql for _, _, sql in lines],
        tables=tables,
    )
    records, metrics = decode_and_score(
        model, tokenizer, scoring, decoding="constrained", batch_size=8, max_new_tokens=64, progress=False
    )
    assert metrics["parse_errors"] == 0, [r["predicted_sql"] for r in records]
    assert not any((r["execution_error"] or "").startswith("predicted") for r in records)


def test_greedy_predictions_must_answer_the_same_questions(tmp_path):
    """infer --greedy_predictions: a greedy run's predictions.jsonl stands in for the greedy pass only where it answers
    the same questions in the same order."""
    from textsql.infer import read_greedy_predictions

    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps({"question": q, "predicted_sql": f"SELECT {q}"}) + "\n" for q in "ab"))
    assert read_greedy_predictions(str(path), ["a", "b"]) == ["SELECT a", "SELECT b"]
    assert read_greedy_predictions(None, ["a"]) is None
    with pytest.raises(TextsqlError, match="other questions"):
        read_greedy_predictions(str(path), ["b", "a"])
    with pytest.raises(TextsqlError, match="cannot be read"):
        read_greedy_predictions(str(tmp_path / "missing.jsonl"), ["a"])
