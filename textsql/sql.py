"""Read generated SQL back into WikiSQL queries, execute them the way WikiSQL does, and score predictions."""

from __future__ import annotations

import re
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

from textsql.errors import TextsqlError
from textsql.wikisql_ops import AGG_OPS, COND_OPS

# "OP" is in WikiSQL's operator list but never occurs in its data, so it is neither parsed nor executed.
SUPPORTED_COND_OPS = ("=", ">", "<")
AGG_NAMES = ("none",) + tuple(AGG_OPS[1:])
CONDITION_BUCKETS = ("0", "1", "2", "3", "4+")


class SQLParseError(ValueError):
    """Generated SQL that cannot be read back into a query over the table's header (counted as wrong)."""


class SQLExecutionError(ValueError):
    """A structured query or table that cannot be executed (bad column index, unknown operator, malformed rows)."""


# --------------------------------------------------------------------------- parse


@dataclass(frozen=True)
class _Syntax:
    """The keyword patterns of one spacing mode: strict (single spaces, as rendered) or lenient (spaces optional)."""

    select: re.Pattern
    agg: re.Pattern
    from_table: re.Pattern
    where: re.Pattern
    op: re.Pattern
    and_: re.Pattern
    lenient: bool


def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.IGNORECASE)


_AGG_WORDS = "|".join(op.lower() for op in AGG_OPS[1:])
_STRICT = _Syntax(
    select=_compile(r"select "),
    agg=_compile(rf"({_AGG_WORDS}) "),
    from_table=_compile(r" from table"),
    where=_compile(r" where(?: |$)"),
    op=_compile(r" ([=<>])(?: |$)"),
    and_=_compile(r" and "),
    lenient=False,
)
_LENIENT = _Syntax(
    select=_compile(r"\s*select\s*"),
    agg=_compile(rf"({_AGG_WORDS})\s*"),
    from_table=_compile(r"\s*from\s*table"),
    where=_compile(r"\s*where\s*"),
    op=_compile(r"\s*([=<>])\s*"),
    and_=_compile(r"\s+and\s*"),
    lenient=True,
)


def parse_sql(text: str, header: list[str]) -> dict:
    """The structured query {"sel", "agg", "conds": [[col, op, value], ...]} of a string rendered like `render_sql`.

    Column names are matched longest first, case-insensitively; a string that only parses with different spacing
    (for example `Year=1995`) is read in a second, lenient pass. Values are returned as written (strings).
    Raises SQLParseError with a short reason when the text is not a query over this header.
    """
    collapsed = " ".join(str(text or "").split())
    if not collapsed:
        raise SQLParseError("empty output")
    names = tuple(str(name) for name in header)
    failures = []
    for syntax in (_STRICT, _LENIENT):
        parser = _Parser(collapsed, _header_patterns(names, syntax.lenient), syntax)
        query = parser.parse()
        if query is not None:
            return query
        failures.append(parser.failure)
    position, reason = max(failures, key=lambda failure: failure[0])
    raise SQLParseError(f"{reason} at {_snippet(collapsed, position)}")


def _snippet(text: str, position: int) -> str:
    rest = text[position:]
    return repr(rest[:40] + ("..." if len(rest) > 40 else "")) if rest else "the end"


@lru_cache(maxsize=4096)
def _header_patterns(header: tuple[str, ...], lenient: bool) -> tuple[tuple[int, re.Pattern], ...]:
    """(column index, pattern) per distinct column name, longest name first; a repeated name maps to its first column."""
    patterns, seen = [], set()
    for index, name in enumerate(header):
        words = name.split()
        key = " ".join(words).lower()
        if not words or key in seen:
            continue  # an empty name cannot be told apart from no name
        seen.add(key)
        if lenient:
            pattern = r"\s*".join(re.escape(char) for char in "".join(words))
        else:
            pattern = " ".join(re.escape(word) for word in words)
        patterns.append((len("".join(words)), index, _compile(pattern)))
    patterns.sort(key=lambda item: -item[0])  # stable: equal lengths keep header order
    return tuple((index, pattern) for _, index, pattern in patterns)


class _Parser:
    """Backtracking reader of one collapsed string; remembers the furthest point it failed at, and why."""

    def __init__(self, text: str, columns: tuple[tuple[int, re.Pattern], ...], syntax: _Syntax):
        self.text = text
        self.columns = columns
        self.syntax = syntax
        self.failure = (-1, "not a query")
        self.conditions_memo: dict[int, list | None] = {}

    def fail(self, position: int, reason: str) -> None:
        if position > self.failure[0]:
            self.failure = (position, reason)

    def at_end(self, position: int) -> bool:
        return not self.text[position:].strip()

    def columns_at(self, position: int) -> list[tuple[int, int]]:
        """(column index, end position) of every column name that starts at `position`, longest first."""
        found = []
        for index, pattern in self.columns:
            match = pattern.match(self.text, position)
            if match:
                found.append((index, match.end()))
        return found

    def parse(self) -> dict | None:
        select = self.syntax.select.match(self.text)
        if not select:
            self.fail(0, "does not start with SELECT")
            return None
        for agg, sel, end in self.select_candidates(select.end()):
            conds = self.after_select(end)
            if conds is not None:
                return {"sel": sel, "agg": agg, "conds": conds}
        return None

    def select_candidates(self, position: int) -> list[tuple[int, int, int]]:
        """(agg, sel, end) for each way to read an optional aggregation and a column, longest column name first."""
        starts = [(0, position)]
        agg = self.syntax.agg.match(self.text, position)
        if agg:
            starts.append((AGG_OPS.index(agg.group(1).upper()), agg.end()))
        candidates = [(end - start, agg_index != 0, agg_index, sel, end) for agg_index, start in starts for sel, end in self.columns_at(start)]
        if not candidates:
            self.fail(position, "no column of the table after SELECT")
        candidates.sort(key=lambda item: (-item[0], item[1]))  # ties: a column named like "Max" before MAX + nothing
        return [(agg_index, sel, end) for _, _, agg_index, sel, end in candidates]

    def after_select(self, position: int) -> list | None:
        from_table = self.syntax.from_table.match(self.text, position)
        if not from_table:
            self.fail(position, "expected 'FROM table' after the selected column")
            return None
        position = from_table.end()
        if self.at_end(position):
            return []
        where = self.syntax.where.match(self.text, position)
        if not where:
            self.fail(position, "expected WHERE or the end after 'FROM table'")
            return None
        return self.conditions(where.end())

    def conditions(self, position: int) -> list | None:
        """The conditions from `position` to the end of the text, or None; memoized because values backtrack."""
        if position not in self.conditions_memo:
            self.conditions_memo[position] = self._conditions(position)
        return self.conditions_memo[position]

    def _conditions(self, position: int) -> list | None:
        columns = self.columns_at(position)
        if not columns:
            self.fail(position, "no column of the table in the WHERE condition")
        for column, column_end in columns:
            op = self.syntax.op.match(self.text, column_end)
            if not op:
                self.fail(column_end, "expected an operator (=, >, <) after the condition column")
                continue
            found = self.condition_from(column, COND_OPS.index(op.group(1)), op.end())
            if found is not None:
                return found
        return None

    def condition_from(self, column: int, op: int, value_start: int) -> list | None:
        """This condition and the ones after it: the value runs to the first AND after which the rest parses, else to the end."""
        if self.at_end(value_start):
            self.fail(value_start, "missing condition value")
            return None
        for separator in self.and_separators(value_start + 1):
            rest = self.conditions(separator.end())
            if rest is not None:
                return [[column, op, self.text[value_start : separator.start()].strip()]] + rest
        value = self.text[value_start:].strip()
        if self.truncated_value(value):
            self.fail(value_start, "truncated WHERE clause (dangling AND)")
            return None
        return [[column, op, value]]

    def and_separators(self, position: int):
        """Every AND separator from `position`, overlapping ones included ("x AND AND y" has two)."""
        while separator := self.syntax.and_.search(self.text, position):
            yield separator
            position = separator.start() + 1

    def truncated_value(self, value: str) -> bool:
        """A last value that ends in AND, or in AND plus a column name (and operator): output cut off mid-condition."""
        words = value.split()
        if len(words) > 1 and words[-1].lower() == "and":
            return True
        tail = re.split(r"\s+and\s+", value, flags=re.IGNORECASE)
        if len(tail) < 2:
            return False
        last = tail[-1]
        for _, column_end in self.columns_at_text(last):
            rest = last[column_end:].strip()
            if not rest or rest in SUPPORTED_COND_OPS:
                return True
        return False

    def columns_at_text(self, text: str) -> list[tuple[int, int]]:
        return [(index, match.end()) for index, pattern in self.columns if (match := pattern.match(text))]


# --------------------------------------------------------------------------- execute

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_NUMBER_IN_TEXT = re.compile(r"[-+]?\d*\.\d+|\d+")  # WikiSQL's num_re: the fallback when a value is not a plain number
_CONNECTION_CACHE_SIZE = 512


@dataclass
class _TableDatabase:
    """One table loaded into its own in-memory SQLite database, as table `t` with columns col0..colN."""

    table: dict
    connection: sqlite3.Connection


_databases: OrderedDict[str, _TableDatabase] = OrderedDict()
_databases_lock = threading.Lock()


def execute_query(query: dict, table: dict) -> list:
    """Run a structured query against a WikiSQL table with WikiSQL's semantics; returns the sorted result values.

    Text cells and text condition values are lower-cased (so results of text columns come back lower-cased);
    real columns compare numbers parsed from cells and values ("1,234" is 1234, "12" equals 12.0). Floats are
    rounded to 10 significant digits. COUNT over no rows is [0]; MAX/MIN/SUM/AVG over no rows are [None].
    Raises SQLExecutionError for an index out of range, an unknown operator or a malformed table.
    """
    header, types, rows = _checked_table(table)
    sel, agg, conds = _checked_query(query, len(header))
    column = f"col{sel}"
    select = f"{AGG_OPS[agg]}({column})" if agg else column
    where = " AND ".join(f"col{col} {COND_OPS[op]} ?" for col, op, _ in conds)
    statement = f"SELECT {select} FROM t" + (f" WHERE {where}" if where else "")
    # Positional parameters: WikiSQL binds by column name, so two conditions on one column shared the last value.
    parameters = [_condition_parameter(value, types[col]) for col, _, value in conds]
    with _databases_lock:
        database = _database_for(table, header, types, rows)
        try:
            results = database.connection.execute(statement, parameters).fetchall()
        except sqlite3.Error as error:
            raise SQLExecutionError(f"SQLite could not run {statement!r}: {error}") from None
    return sorted((_result_value(row[0]) for row in results), key=_result_sort_key)


def _checked_table(table: dict) -> tuple[list[str], list[str], list[list]]:
    try:
        header, rows = list(table["header"]), list(table["rows"])
    except (KeyError, TypeError):
        raise SQLExecutionError("a table needs 'header' and 'rows' (WikiSQL's tables.jsonl format)") from None
    types = [str(kind).lower() for kind in table.get("types") or ["text"] * len(header)]
    if len(types) != len(header):
        raise SQLExecutionError(f"table {table.get('id')!r} has {len(header)} header names but {len(types)} types")
    for number, row in enumerate(rows):
        if len(row) != len(header):
            raise SQLExecutionError(f"table {table.get('id')!r} row {number} has {len(row)} cells for {len(header)} columns")
    return header, types, rows


def _checked_query(query: dict, num_columns: int) -> tuple[int, int, list]:
    try:
        sel, agg, conds = query["sel"], query["agg"], list(query["conds"])
    except (KeyError, TypeError):
        raise SQLExecutionError("a query needs 'sel', 'agg' and 'conds'") from None
    _check_index(sel, num_columns, "selected column")
    _check_index(agg, len(AGG_OPS), "aggregation")
    for cond in conds:
        if not isinstance(cond, (list, tuple)) or len(cond) != 3:
            raise SQLExecutionError(f"condition {cond!r} is not [column, operator, value]")
        _check_index(cond[0], num_columns, "condition column")
        _check_index(cond[1], len(SUPPORTED_COND_OPS), "condition operator")
    return sel, agg, conds


def _check_index(index: object, size: int, what: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
        raise SQLExecutionError(f"{what} index {index!r} is out of range 0..{size - 1}")


def _database_for(table: dict, header: list[str], types: list[str], rows: list[list]) -> _TableDatabase:
    """The cached database of this table (by id), rebuilt when a different table arrives under the same id."""
    key = str(table.get("id", ""))
    cached = _databases.get(key) if key else None
    if cached is not None and (cached.table is table or _same_table(cached.table, table)):
        _databases.move_to_end(key)
        return cached
    database = _TableDatabase(table=table, connection=_load_table(header, types, rows))
    if key:
        if cached is not None:
            cached.connection.close()
        _databases[key] = database
        while len(_databases) > _CONNECTION_CACHE_SIZE:
            _databases.popitem(last=False)[1].connection.close()
    return database


def _same_table(a: dict, b: dict) -> bool:
    return all(a.get(field) == b.get(field) for field in ("header", "types", "rows"))


def _load_table(header: list[str], types: list[str], rows: list[list]) -> sqlite3.Connection:
    connection = sqlite3.connect(":memory:", check_same_thread=False)
    columns = ", ".join(f"col{i} {'REAL' if kind == 'real' else 'TEXT'}" for i, kind in enumerate(types))
    connection.execute(f"CREATE TABLE t ({columns})")
    if rows:
        placeholders = ", ".join("?" for _ in header)
        cells = [[_stored_cell(cell, kind) for cell, kind in zip(row, types)] for row in rows]
        connection.executemany(f"INSERT INTO t VALUES ({placeholders})", cells)
    return connection


def _stored_cell(cell: object, kind: str) -> object:
    """Text lower-cased (WikiSQL stores it so); real cells as numbers where one can be read, else the lower-cased text."""
    if cell is None:
        return None
    if kind == "real":
        number = number_from(cell)
        if number is not None:
            return number
    return str(cell).lower()


def _condition_parameter(value: object, kind: str) -> object:
    """WikiSQL's treatment of a condition value: lower-cased; for a real column, the number in it."""
    if kind == "real":
        number = number_from(value)
        if number is not None:
            return number
        # WikiSQL crashes here; comparing as text keeps a gold query like this executable (it matches no number).
    return str(value).lower()


def number_from(value: object) -> float | None:
    """The number a cell or value stands for, as WikiSQL reads it: "1,234" -> 1234.0, "12 km" -> 12.0, "n/a" -> None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    plain = text.replace(",", "")  # babel's parse_decimal drops grouping commas
    if _NUMBER.fullmatch(plain):
        return float(plain)
    found = _NUMBER_IN_TEXT.findall(text)
    return float(found[0]) if found else None


def _result_value(value: object) -> object:
    if isinstance(value, float):
        return float(f"{value:.10g}")  # equal results computed along different paths compare equal
    return value


def _result_sort_key(value: object) -> tuple:
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, (int, float)):
        return (1, float(value), "")
    return (2, 0.0, str(value))


# --------------------------------------------------------------------------- score


def exact_match(predicted_text: str, gold_text: str) -> bool:
    """The strings are equal once runs of whitespace are collapsed (case-sensitive)."""
    return " ".join(str(predicted_text or "").split()) == " ".join(str(gold_text or "").split())


def same_logical_form(predicted: dict, gold: dict) -> bool:
    """Same sel and agg and the same set of conditions: order-insensitive, values case-insensitive, numbers as numbers."""
    return (
        predicted["sel"] == gold["sel"]
        and predicted["agg"] == gold["agg"]
        and {_condition_key(c) for c in predicted["conds"]} == {_condition_key(c) for c in gold["conds"]}
    )


def _condition_key(cond: list) -> tuple:
    column, op, value = cond
    return (column, op, _value_key(value))


def _value_key(value: object) -> object:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = " ".join(str(value).split()).lower()
    return float(text) if _NUMBER.fullmatch(text) else text


def score_prediction(predicted_text: str, gold_text: str, gold_query: dict | None, table: dict) -> dict:
    """Exact, logical-form and execution match of one prediction; a prediction that does not parse or run is wrong.

    Returns {"exact_match", "logical_form_match", "execution_match", "parsed", "parse_error", "execution_error"}.
    Without `gold_query` the gold string is parsed against the table's header.
    """
    if table is None:
        raise TextsqlError(
            "Scoring by logical form and execution needs the question's table. Prepare the data from the WikiSQL "
            "release files or a hub copy with a 'table' column (both keep tables.jsonl), or score by exact match only."
        )
    gold = gold_query if gold_query is not None else _gold_query_from_text(gold_text, table)
    scored = {
        "exact_match": exact_match(predicted_text, gold_text),
        "logical_form_match": False,
        "execution_match": False,
        "parsed": None,
        "parse_error": None,
        "execution_error": None,
    }
    try:
        scored["parsed"] = parse_sql(predicted_text, table["header"])
    except SQLParseError as error:
        scored["parse_error"] = str(error)
        return scored
    scored["logical_form_match"] = same_logical_form(scored["parsed"], gold)
    scored["execution_match"], scored["execution_error"] = _execution_match(scored["parsed"], gold, table)
    return scored


def _gold_query_from_text(gold_text: str, table: dict) -> dict:
    try:
        return parse_sql(gold_text, table["header"])
    except SQLParseError as error:
        raise TextsqlError(
            f"The gold SQL {gold_text!r} does not parse against its table {table.get('id')!r} ({error}): "
            "the examples and tables.jsonl do not belong together. Prepare the dataset again."
        ) from None


def _execution_match(predicted: dict, gold: dict, table: dict) -> tuple[bool, str | None]:
    try:
        gold_result = execute_query(gold, table)
    except SQLExecutionError as error:
        return False, f"gold query: {error}"
    try:
        return execute_query(predicted, table) == gold_result, None
    except SQLExecutionError as error:
        return False, f"predicted query: {error}"


def aggregate_metrics(scored: list[dict], gold_queries: list[dict]) -> dict:
    """Overall accuracies and their breakdown by the gold query's aggregation and number of conditions.

    Breakdowns list only groups that occur, in a fixed order: by_aggregation "none", "MAX", "MIN", "COUNT", "SUM",
    "AVG"; by_num_conditions "0", "1", "2", "3", "4+". Each group holds count and the three accuracies.
    """
    if len(scored) != len(gold_queries):
        raise ValueError(f"{len(scored)} scored predictions but {len(gold_queries)} gold queries")
    by_aggregation: dict[str, list[dict]] = {name: [] for name in AGG_NAMES}
    by_num_conditions: dict[str, list[dict]] = {bucket: [] for bucket in CONDITION_BUCKETS}
    for score, gold in zip(scored, gold_queries):
        by_aggregation[AGG_NAMES[gold["agg"]]].append(score)
        by_num_conditions[CONDITION_BUCKETS[min(len(gold["conds"]), 4)]].append(score)
    overall = _accuracies(scored)
    return {
        "examples": len(scored),
        "exact_match": overall["exact_match"],
        "logical_form_accuracy": overall["logical_form_accuracy"],
        "execution_accuracy": overall["execution_accuracy"],
        "parse_errors": sum(score["parse_error"] is not None for score in scored),
        "by_aggregation": {name: _accuracies(group) for name, group in by_aggregation.items() if group},
        "by_num_conditions": {bucket: _accuracies(group) for bucket, group in by_num_conditions.items() if group},
    }


def _accuracies(scored: list[dict]) -> dict:
    count = len(scored)

    def share(key: str) -> float:
        return sum(bool(score[key]) for score in scored) / count if count else 0.0

    return {
        "count": count,
        "exact_match": share("exact_match"),
        "logical_form_accuracy": share("logical_form_match"),
        "execution_accuracy": share("execution_match"),
    }
