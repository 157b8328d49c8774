"""Constrained decoding's grammar: the WikiSQL queries over one question's table, as a byte automaton, walked jointly
with a tokenizer's vocabulary to find the tokens that keep a generated prefix on the way to a query that parses."""

from __future__ import annotations

import json
import re
import weakref
from bisect import bisect_left
from dataclasses import dataclass

from textsql.errors import TextsqlError
from textsql.wikisql.format import AGG_OPS
from textsql.wikisql.sql import SUPPORTED_COND_OPS, SQLExecutionError, normalized_name, wikisql_number

# WikiSQL's queries have at most 4 conditions; a cap also keeps an untrained model from chaining ANDs until its token
# budget runs out mid-query.
MAX_CONDITIONS = 4
# Characters a question word may be wrapped in ("1995?", '"Smith"'); the n-grams come with and without them.
_WRAPPING = "?!.,;:\"'()[]"
NUMBER_WORDS = 3
_AND_WORD = re.compile(r"(?:^|\s)and(?:\s|$)", re.IGNORECASE)


class _Node:
    """A node of a byte trie: its children by byte, whether a string ends here (`label`: True or a column index), and
    the fewest bytes from here to an end (`dist`; for condition columns it includes the cheapest value after them)."""

    __slots__ = ("children", "label", "dist")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.label = None
        self.dist = 0


def _trie(strings: dict[str, object]) -> _Node:
    """A trie of `strings` (text -> label), with each node's fewest bytes to an end."""
    root = _Node()
    for text, label in strings.items():
        node = root
        for byte in text.encode("utf-8"):
            node = node.children.setdefault(byte, _Node())
        if node.label is None:
            node.label = label
    _set_dist(root, lambda label: 0)
    return root


def _set_dist(root: _Node, extra) -> None:
    """dist of every node: the fewest bytes to an end of a string plus `extra(label)` there (iterative post-order)."""
    stack, order = [root], []
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    for node in reversed(order):
        best = extra(node.label) if node.label is not None else float("inf")
        for child in node.children.values():
            best = min(best, child.dist + 1)
        node.dist = best


# The phases of a query: each reads one trie; at a string's end the next phase starts.
START, AGG, SEL_COLUMN, FROM, WHERE, COND_COLUMN, OPERATOR, VALUE, AND, ACCEPT = range(10)
_FROM_TABLE = " FROM table"


def _item(phase: int, node: _Node | None, column: int = -1, conditions: int = 0) -> tuple:
    """One way the prefix read so far can go on: (phase, the node reached in its trie, the condition's column, how
    many conditions are complete). A plain tuple, hashed with its node's identity: equal items merge in a state."""
    return (phase, node, column, conditions)


def _word_ngrams(question: str) -> set[str]:
    """The question's word n-grams as written, and each without the punctuation around it."""
    words = question.split()
    found = set()
    for start in range(len(words)):
        for end in range(start + 1, len(words) + 1):
            text = " ".join(words[start:end])
            found.add(text)
            found.add(text.strip(_WRAPPING))
    found.discard("")
    return found


def _is_number(text: str) -> bool:
    try:
        wikisql_number(text)
    except SQLExecutionError:
        return False
    return True


def _number_like(text: str) -> bool:
    """A question n-gram a "real" column may take: up to NUMBER_WORDS words holding a digit ("1995", "1,234", "12 km"),
    which WikiSQL reads as a number (a longer n-gram would too, by its first number, but is no answer)."""
    return len(text.split()) <= NUMBER_WORDS and any(char.isdigit() for char in text) and _is_number(text)


def _cell_forms(cell: object) -> set[str]:
    """A cell as render_sql would write it as a value (whitespace collapsed), and lower-cased; an integral float also
    as an integer ("3.0" and "3")."""
    text = " ".join(str(cell).split())
    forms = {text, text.lower()}
    if isinstance(cell, float) and cell.is_integer():
        forms.add(str(int(cell)))
    forms.discard("")
    return forms


# The cells' tries of the tables seen last (a table's questions come together): built once per table, never changed.
_CELL_TRIES: dict[tuple, tuple[dict, list[_Node]]] = {}
_CELL_TRIES_KEPT = 64


def _cell_tries(table: dict, types: list[str], rows: list, producible: frozenset[int] | None) -> list[_Node]:
    """Per column, a trie of its cells' forms (those the tokenizer can write; a "real" column's holding a number)."""
    key = (str(table.get("id")), id(table), producible)
    cached = _CELL_TRIES.get(key)
    if cached is not None and cached[0] is table:
        return cached[1]
    tries = []
    for index, kind in enumerate(types):
        cells = set()
        for row in rows:
            if index < len(row):
                cells |= _cell_forms(row[index])
        usable = {
            v
            for v in cells
            if (producible is None or all(byte in producible for byte in v.encode("utf-8")))
            and (kind != "real" or _is_number(v))
        }
        tries.append(_trie(dict.fromkeys(usable, True)))
    _CELL_TRIES[key] = (table, tries)
    while len(_CELL_TRIES) > _CELL_TRIES_KEPT:
        _CELL_TRIES.pop(next(iter(_CELL_TRIES)))
    return tries


class QueryGrammar:
    """The queries `render_sql` writes over one table for one question, as tries of bytes: `SELECT [AGG] column FROM
    table [WHERE column op value [AND ...]]` (up to MAX_CONDITIONS conditions), with the table's column names as
    render_sql writes them (and NFKC-normalized, as parse_sql reads them), the aggregations, the operators = > <, and
    for each column the values that occur in the question (word n-grams, as written or without surrounding punctuation)
    or in its cells (as written or lower-cased); a "real" column only takes cells that hold a number (else the query
    could not execute) and question n-grams of up to NUMBER_WORDS words that hold a digit. A question n-gram holding
    the word "and" is left out unless it is a cell of that column: parse_sql would read it as two conditions or as
    output cut off. Only characters `producible` (when given) are used, so no alternative leads the decoder where its
    vocabulary cannot go."""

    def __init__(self, table: dict, question: str, producible: frozenset[int] | None = None):
        header = [" ".join(str(name).split()) for name in table["header"]]
        types = [str(kind).lower() for kind in table.get("types") or ["text"] * len(header)]
        rows = table.get("rows") or []

        def usable(text: str) -> bool:
            return producible is None or all(byte in producible for byte in text.encode("utf-8"))

        names: dict[str, int] = {}
        raw_keys = {name.lower() for name in header}
        for index, name in enumerate(header):
            forms = [name]
            normalized = normalized_name(name)
            if normalized.lower() != name.lower() and normalized.lower() not in raw_keys:
                forms.append(normalized)
            for form in forms:
                if form and usable(form):
                    names.setdefault(form, index)
        if not names:
            raise TextsqlError(
                f"Constrained decoding found no column name of table {table.get('id')!r} that the tokenizer can write."
            )
        ngrams = _word_ngrams(question)
        text_values = {v for v in ngrams if not _AND_WORD.search(v) and usable(v)}
        number_values = {v for v in text_values if _number_like(v)}
        # Each column's values: its cells' trie and the question's (text or number) trie, which columns share.
        question_tries = {
            "text": _trie(dict.fromkeys(text_values, True)),
            "real": _trie(dict.fromkeys(number_values, True)),
        }
        self.values: list[tuple[_Node, ...]] = []
        value_lengths: list[float] = []
        cell_tries = _cell_tries(table, types, rows, producible)
        for index, kind in enumerate(types):
            roots = (cell_tries[index], question_tries["real" if kind == "real" else "text"])
            self.values.append(tuple(root for root in roots if root.children))
            value_lengths.append(min((root.dist for root in self.values[-1]), default=float("inf")))
        self.value_lengths = value_lengths
        self.select_columns = _trie(names)
        # A condition column must have a value it can take; its dist counts " op " and its cheapest value.
        cond_names = {name: index for name, index in names.items() if self.values[index]}
        self.cond_columns = _trie(cond_names)
        _set_dist(self.cond_columns, lambda index: 3 + value_lengths[index])
        self.start = _trie({"SELECT ": True, " SELECT ": True})
        self.aggregations = _trie({f"{name} ": True for name in AGG_OPS[1:]})
        self.from_table = _trie({_FROM_TABLE: True})
        self.where = _trie({" WHERE ": True}) if cond_names else None
        self.operators = _trie({f" {op} ": True for op in SUPPORTED_COND_OPS if usable(op)})
        self.and_ = _trie({" AND ": True})
        cheapest_condition = self.cond_columns.dist
        self.after = {
            START: self.select_columns.dist + len(_FROM_TABLE),
            AGG: self.select_columns.dist + len(_FROM_TABLE),
            SEL_COLUMN: len(_FROM_TABLE),
            FROM: 0,
            WHERE: cheapest_condition,
            AND: cheapest_condition,
            COND_COLUMN: 0,  # its dist counts the operator and the cheapest value
        }
        self.initial = self._closure([_item(START, self.start)])
        self._allowed: dict[frozenset, tuple[list[int], list[int], bool]] = {}

    # ------------------------------------------------------------------ the automaton

    def _enter(self, phase: int, column: int = -1, conditions: int = 0) -> list[_item]:
        if phase == AGG:
            return [_item(AGG, self.aggregations)]
        if phase == SEL_COLUMN:
            return [_item(SEL_COLUMN, self.select_columns)]
        if phase == FROM:
            return [_item(FROM, self.from_table)]
        if phase == WHERE:
            return [_item(ACCEPT, None)] + ([_item(WHERE, self.where)] if self.where is not None else [])
        if phase == COND_COLUMN:
            return [_item(COND_COLUMN, self.cond_columns, conditions=conditions)]
        if phase == OPERATOR:
            return [_item(OPERATOR, self.operators, column, conditions)]
        if phase == VALUE:
            return [_item(VALUE, root, column, conditions) for root in self.values[column]]
        if phase == AND:
            return [_item(AND, self.and_, conditions=conditions)]
        raise ValueError(phase)

    def _next(self, item: tuple) -> list[tuple]:
        """The items a completed string of `item`'s phase leads to."""
        phase, node, column, conditions = item
        if phase == START:
            return self._enter(AGG) + self._enter(SEL_COLUMN)
        if phase == AGG:
            return self._enter(SEL_COLUMN)
        if phase == SEL_COLUMN:
            return self._enter(FROM)
        if phase == FROM:
            return self._enter(WHERE)
        if phase in (WHERE, AND):
            return self._enter(COND_COLUMN, conditions=conditions)
        if phase == COND_COLUMN:
            return self._enter(OPERATOR, node.label, conditions)
        if phase == OPERATOR:
            return self._enter(VALUE, column, conditions)
        if phase == VALUE:
            done = conditions + 1
            return [_item(ACCEPT, None)] + (self._enter(AND, conditions=done) if done < MAX_CONDITIONS else [])
        raise ValueError(phase)

    def _closure(self, items: list[tuple]) -> frozenset:
        """The items and, for each at the end of a string, the phases after it."""
        found, pending = set(), list(items)
        while pending:
            item = pending.pop()
            if item in found:
                continue
            found.add(item)
            if item[1] is not None and item[1].label is not None:
                pending.extend(self._next(item))
        return frozenset(found)

    def advance(self, state: frozenset, data: bytes) -> frozenset:
        """The state after `data` (an empty state: the prefix is no longer a query's)."""
        for byte in data:
            moved = []
            for phase, node, column, conditions in state:
                if node is not None:
                    child = node.children.get(byte)
                    if child is not None:
                        moved.append((phase, child, column, conditions))
            if not moved:
                return frozenset()
            state = self._closure(moved)
        return state

    def accepting(self, state: frozenset) -> bool:
        return any(item[0] == ACCEPT for item in state)

    def remaining(self, state: frozenset) -> float:
        """The fewest bytes that complete a query from `state` (inf for an empty state)."""
        return min((self._remaining(item) for item in state), default=float("inf"))

    def _remaining(self, item: tuple) -> float:
        phase, node, column, _ = item
        if phase == ACCEPT:
            return 0
        if phase == OPERATOR:
            return node.dist + self.value_lengths[column]
        if phase == VALUE:
            return node.dist
        return node.dist + self.after[phase]

    def allowed(self, state: frozenset, vocabulary: Vocabulary) -> tuple[list[int], list[float], bool]:
        """(token ids, for each the fewest bytes that complete a query after it, whether EOS may end here): every token
        whose bytes keep the prefix a query's, found by walking the vocabulary's sorted byte strings jointly with the
        automaton and leaving a whole range out as soon as a byte is refused. Cached per state."""
        cached = self._allowed.get(state)
        if cached is None:
            ids: list[int] = []
            needs: list[float] = []
            self._walk(state, b"", 0, len(vocabulary.keys), vocabulary, ids, needs)
            cached = self._allowed[state] = (ids, needs, self.accepting(state))
        return cached

    def _walk(self, state, prefix: bytes, lo: int, hi: int, vocabulary: Vocabulary, ids: list, needs: list) -> None:
        """The tokens among keys[lo:hi] (all starting with `prefix`, which brought the automaton to `state`)."""
        keys = vocabulary.keys
        following = sorted({byte for _, node, _, _ in state if node is not None for byte in node.children})
        for byte in following:
            extended = prefix + bytes((byte,))
            start = bisect_left(keys, extended, lo, hi)
            if start == hi or not keys[start].startswith(extended):
                continue
            if byte < 255:
                end = bisect_left(keys, prefix + bytes((byte + 1,)), start, hi)
            else:  # no byte string sorts right after every one starting with 0xff: scan
                end = start
                while end < hi and keys[end].startswith(extended):
                    end += 1
            moved = self.advance(state, bytes((byte,)))
            if not moved:
                continue
            if keys[start] == extended:
                need = self.remaining(moved)
                ids.extend(vocabulary.ids[start])
                needs.extend([need] * len(vocabulary.ids[start]))
                start += 1
            if start < end:
                self._walk(moved, extended, start, end, vocabulary, ids, needs)


# ---------------------------------------------------------------------- tokenizers


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token uses for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(part) -> set[str]:
    if not isinstance(part, dict):
        return set()
    kinds = {str(part.get("type"))}
    if part.get("type") == "Replace" and (part.get("pattern") or {}).get("String") == "▁":
        kinds.add("Metaspace")
    for child in part.get("decoders") or []:
        kinds |= _decoder_kinds(child)
    return kinds


@dataclass
class Vocabulary:
    """A tokenizer's tokens as the bytes each writes, sorted for prefix search: `keys` (distinct byte strings) and
    `ids` (the token ids writing each); `token_bytes` per id (None: special, or a piece that writes nothing)."""

    keys: list[bytes]
    ids: list[tuple[int, ...]]
    token_bytes: list[bytes | None]
    kind: str

    def text(self, token_ids) -> str:
        """The text tokens write, whitespace collapsed as generate_sql collapses it; special tokens write nothing."""
        data = b"".join(self.token_bytes[t] or b"" for t in token_ids if 0 <= t < len(self.token_bytes))
        return " ".join(data.decode("utf-8", errors="replace").split())

    def producible(self) -> frozenset[int]:
        """The bytes some token writes alone or inside others (every byte for byte-level BPE)."""
        return frozenset(byte for key in self.keys for byte in key)


_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary_of(tokenizer) -> Vocabulary:
    """The tokenizer's Vocabulary, built once per tokenizer object: byte-level BPE (GPT-2, Qwen2, Llama 3, SmolLM2:
    token characters mapped back to bytes) and SentencePiece (T5's Unigram, Llama 2's BPE: '▁' is a space, <0xNN>
    byte pieces). Special tokens write nothing and are never allowed (EOS is allowed apart). Other tokenizers (WordPiece,
    a slow tokenizer) are refused with a TextsqlError."""
    try:
        return _vocabularies[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TextsqlError(
            f"Constrained decoding reads a fast (tokenizers) tokenizer's vocabulary; {type(tokenizer).__name__} is not "
            "one. Load the model's tokenizer.json (AutoTokenizer does by default) or decode without --decoding "
            "constrained."
        )
    kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
    if "ByteLevel" in kinds:
        kind = "byte-level"
    elif "Metaspace" in kinds:
        kind = "sentencepiece"
    else:
        raise TextsqlError(
            f"Constrained decoding drives byte-level BPE and SentencePiece tokenizers; this one decodes with "
            f"{', '.join(sorted(kinds)) or 'no decoder'}. Decode without --decoding constrained."
        )
    byte_of = _bytes_to_unicode()
    special = set(tokenizer.all_special_ids)
    added = {index: token for index, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    size = max(len(tokenizer), max(added, default=-1) + 1)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    token_bytes: list[bytes | None] = []
    for index, piece in enumerate(pieces):
        data = None
        if piece is not None and index not in special:
            if index in added:
                data = None if added[index].special else str(added[index].content).encode("utf-8")
            elif kind == "byte-level":
                if all(char in byte_of for char in piece):
                    data = bytes(byte_of[char] for char in piece)
            else:
                fallback = _BYTE_FALLBACK.fullmatch(piece)
                data = bytes((int(fallback.group(1), 16),)) if fallback else piece.replace("▁", " ").encode("utf-8")
        token_bytes.append(data or None)
    grouped: dict[bytes, list[int]] = {}
    for index, data in enumerate(token_bytes):
        if data is not None:
            grouped.setdefault(data, []).append(index)
    keys = sorted(grouped)
    # Tuples (of ints) the garbage collector stops tracking: a 150k-token vocabulary of lists slowed every collection.
    vocabulary = Vocabulary(keys=keys, ids=[tuple(grouped[key]) for key in keys], token_bytes=token_bytes, kind=kind)
    try:
        _vocabularies[tokenizer] = vocabulary
    except TypeError:
        pass
    return vocabulary
