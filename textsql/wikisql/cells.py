"""The table's cells a question mentions: exact and fuzzy n-gram matches, best first, bounded per column and in all."""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher

# What the question and the cells are compared as: lower-cased word and punctuation tokens, so that "terrence ross'"
# holds the cell "Terrence Ross" and "butler cc (ks)?" the cell "Butler CC (KS)".
_TOKEN = re.compile(r"\w+|[^\w\s]")
# A fuzzy match (a misspelt name, "toranto" for "Toronto") needs this difflib ratio at least; 0.85 lets one wrong or
# missing letter in a six-letter word through and keeps "ohio" from matching "iowa" (ratio 0.5).
FUZZY_RATIO = 0.85
# Shortest text (in characters) that may match fuzzily: shorter words differ by a letter from too many others.
FUZZY_MIN_CHARACTERS = 5
# Longest cell, in tokens, that is looked for in the question (longer ones are sentences, not values).
MAX_NGRAM_TOKENS = 24
# Words that say nothing about a cell: a cell or n-gram made only of these (and punctuation) matches nothing. Not
# "no": WikiSQL's yes/no columns ("when starter is no") hold it as a value.
STOP_WORDS = frozenset(
    """a an the of in on at to for from by with and or not is are was were be been has have had do does did what
    which who whom whose when where why how many much name names list tell give show me i it its this that these those
    there their they he she his her as than then if into out over under up down all any each per s""".split()
)


@dataclass(frozen=True)
class CellMatch:
    """A cell of column `column` (its index) that the question mentions: exactly (score 1) or fuzzily (the ratio)."""

    column: int
    cell: str
    score: float


def cell_text(cell) -> str:
    """A cell as the table writes it: a whole float without its `.0` (a real column's 1998.0 is the question's 1998)."""
    if isinstance(cell, float) and cell.is_integer():
        return str(int(cell))
    return " ".join(str(cell).split())


def _tokens(text: str) -> tuple[str, ...]:
    return tuple(_TOKEN.findall(text.lower()))


def _says_something(tokens: tuple[str, ...]) -> bool:
    """Not only stop words and punctuation: a number, or a word that is not a stop word."""
    return any(t.isalnum() and t not in STOP_WORDS for t in tokens)


# How many cells a question+header+values source lists at most, of one column and in all (prep's --values_per_column
# and --max_values; data prepared before they were recorded was listed with these).
DEFAULT_VALUES_PER_COLUMN, DEFAULT_MAX_VALUES = 2, 10


def cell_matches(
    question: str, table: dict, per_column: int = DEFAULT_VALUES_PER_COLUMN, total: int = DEFAULT_MAX_VALUES
) -> list[CellMatch]:
    """The cells of `table` (release format: header, rows) that `question` mentions, best first (score, then the share
    of the column's name the question has, then the longer cell, then the table's order), at most `per_column` of each
    column and `total` in all.

    Exact: a cell whose tokens (lower-cased, whitespace and punctuation split) occur in a row in the question's.
    Fuzzy: a cell with letters whose text has a difflib ratio of at least FUZZY_RATIO with a question n-gram of about
    its length (one token more or fewer); numbers match only exactly. A cell made of stop words only ('the', 'of') or
    of punctuation matches nothing. Each distinct cell text of a column is listed once."""
    words = _tokens(question)
    ngrams: dict[int, set[tuple[str, ...]]] = {}
    for n in range(1, min(len(words), MAX_NGRAM_TOKENS) + 1):
        ngrams[n] = {words[i : i + n] for i in range(len(words) - n + 1)}
    texts = {n: [" ".join(g) for g in grams if _says_something(g)] for n, grams in ngrams.items()}
    best: dict[tuple[int, str], CellMatch] = {}
    order: dict[tuple[int, str], int] = {}  # each distinct cell of a column, where it first occurs: looked at once
    width = len(table.get("header", []))
    for row_number, row in enumerate(table.get("rows", [])):
        for column, cell in enumerate(row[:width]):
            text = cell_text(cell)
            key = (column, text.lower())
            if key in order:
                continue
            order[key] = row_number * width + column
            tokens = _tokens(text)
            if not tokens or len(tokens) > MAX_NGRAM_TOKENS or not _says_something(tokens):
                continue
            if tokens in ngrams.get(len(tokens), ()):
                best[key] = CellMatch(column, text, 1.0)
                continue
            score = _fuzzy_score(" ".join(tokens), len(tokens), texts)
            if score:
                best[key] = CellMatch(column, text, score)
    # At equal score a column the question names comes first ("... with u15 6th iv being bgs": of the ten columns
    # holding "BGS", U15 6th IV), then the longer cell.
    named = [_share_named(name, set(words)) for name in table.get("header", [])]
    ranked = sorted(
        best.items(), key=lambda item: (-item[1].score, -named[item[1].column], -len(item[1].cell), order[item[0]])
    )
    kept, per = [], {}
    for _, match in ranked:
        if per.get(match.column, 0) < per_column and len(kept) < total:
            per[match.column] = per.get(match.column, 0) + 1
            kept.append(match)
    return kept


def _share_named(column: str, words: set[str]) -> float:
    """The share of a column name's telling words (not stop words) that the question has."""
    telling = [t for t in _tokens(column) if t.isalnum() and t not in STOP_WORDS]
    return sum(t in words for t in telling) / len(telling) if telling else 0.0


def _fuzzy_score(cell: str, size: int, texts: dict[int, list[str]]) -> float:
    """The best ratio at least FUZZY_RATIO between `cell` (joined tokens, `size` of them) and a question n-gram of
    size-1..size+1 tokens, or 0. Only texts with letters and of FUZZY_MIN_CHARACTERS or more take part."""
    if len(cell) < FUZZY_MIN_CHARACTERS or not any(c.isalpha() for c in cell):
        return 0.0
    matcher = SequenceMatcher(None, autojunk=False)
    matcher.set_seq2(cell)
    best = 0.0
    for n in (size - 1, size, size + 1):
        for text in texts.get(n, ()):
            # ratio <= 2*min/(len a + len b): lengths too far apart cannot reach the threshold
            if len(text) < FUZZY_MIN_CHARACTERS or 2 * min(len(text), len(cell)) < FUZZY_RATIO * (
                len(text) + len(cell)
            ):
                continue
            matcher.set_seq1(text)
            if matcher.real_quick_ratio() >= FUZZY_RATIO and matcher.quick_ratio() >= FUZZY_RATIO:
                ratio = matcher.ratio()
                if ratio >= FUZZY_RATIO and ratio > best:
                    best = ratio
    return best
