"""Read generated SQL back into WikiSQL queries, execute and score them exactly as WikiSQL's evaluate.py does."""

from __future__ import annotations

import decimal
import re
import sqlite3
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

from textsql.errors import TextsqlError
from textsql.wikisql.format import AGG_OPS, COND_OPS

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


def parse_sql(text: str, header: list[str], rows: list[list] | None = None) -> dict:
    """The structured query {"sel", "agg", "conds": [[col, op, value], ...]} of a string rendered like `render_sql`.

    Column names are matched longest first, case-insensitively, as written or NFKC-normalized (T5's tokenizer writes
    `Area (km²)` as `Area (km2)`); a string that only parses with different spacing (for example `Year=1995`) is read in
    a second, lenient pass. Values are returned as written (strings). A value may hold AND, so a WHERE clause can have
    several complete readings: with the table's `rows`, the one with the most values found in their columns' cells
    wins, else the one that splits at the earliest AND. A last value that ends in AND, or in AND plus a column name
    (and operator), reads as output cut off mid-condition unless its column's cells hold it.
    Raises SQLParseError with a short reason when the text is not a query over this header.
    """
    collapsed = " ".join(str(text or "").split())
    if not collapsed:
        raise SQLParseError("empty output")
    names = tuple(str(name) for name in header)
    cells = _CellEvidence(rows)
    failures = []
    for syntax in (_STRICT, _LENIENT):
        parser = _Parser(collapsed, _header_patterns(names, syntax.lenient), syntax, cells)
        query = parser.parse()
        if query is not None:
            return query
        failures.append(parser.failure)
    position, reason = max(failures, key=lambda failure: failure[0])
    raise SQLParseError(f"{reason} at {_snippet(collapsed, position)}")


def _snippet(text: str, position: int) -> str:
    rest = text[position:]
    return repr(rest[:40] + ("..." if len(rest) > 40 else "")) if rest else "the end"


def normalized_name(name: str) -> str:
    """A column name as T5's tokenizer gives it back: NFKC-normalized (`²` -> `2`, `½` -> `1⁄2`), spaces collapsed."""
    return " ".join(unicodedata.normalize("NFKC", str(name)).split())


@lru_cache(maxsize=4096)
def _header_patterns(header: tuple[str, ...], lenient: bool) -> tuple[tuple[int, re.Pattern], ...]:
    """(column index, pattern) per distinct column name, longest name first; a repeated name maps to its first column.

    A name that NFKC rewrites also matches in its normalized form, unless that form is another column's own name."""
    patterns, seen = [], set()
    raw_keys = {" ".join(name.split()).lower() for name in header}
    for index, name in enumerate(header):
        words = name.split()
        key = " ".join(words).lower()
        if not words or key in seen:
            continue  # an empty name cannot be told apart from no name
        seen.add(key)
        forms = [words]
        normalized = normalized_name(name)
        if normalized.lower() != key and normalized.lower() not in raw_keys:
            forms.append(normalized.split())
        alternatives = []
        for form in forms:
            if lenient:
                alternatives.append(r"\s*".join(re.escape(char) for char in "".join(form)))
            else:
                alternatives.append(" ".join(re.escape(word) for word in form))
        patterns.append((len("".join(words)), index, _compile("|".join(f"(?:{a})" for a in alternatives))))
    patterns.sort(key=lambda item: -item[0])  # stable: equal lengths keep header order
    return tuple((index, pattern) for _, index, pattern in patterns)


class _CellEvidence:
    """Whether a condition value is one of its column's cells (case, spacing and NFKC forms aside; numbers by value):
    what decides between readings of a WHERE clause. Each column's cells are read once, when first asked."""

    def __init__(self, rows: list[list] | None):
        self.rows = rows
        self.columns: dict[int, tuple[set[str], set[float]]] = {}

    def __bool__(self) -> bool:
        return bool(self.rows)

    def holds(self, column: int, value: str) -> bool:
        if not self.rows:
            return False
        if column not in self.columns:
            texts, numbers = set(), set()
            for row in self.rows:
                if column < len(row):
                    texts.add(_cell_key(row[column]))
                    number = _plain_number(row[column])
                    if number is not None:
                        numbers.add(number)
            self.columns[column] = (texts, numbers)
        texts, numbers = self.columns[column]
        return _cell_key(value) in texts or _plain_number(value) in numbers


def _cell_key(value: object) -> str:
    return " ".join(unicodedata.normalize("NFKC", str(value)).split()).lower()


def _plain_number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        return None


# How many readings of a WHERE clause are kept per position: a degenerate output repeating "AND col = v" has
# exponentially many, and the first ones (earliest splits) are the likely ones.
MAX_READINGS = 32


class _Parser:
    """Backtracking reader of one collapsed string; remembers the furthest point it failed at, and why."""

    def __init__(self, text: str, columns: tuple[tuple[int, re.Pattern], ...], syntax: _Syntax, cells: _CellEvidence):
        self.text = text
        self.columns = columns
        self.syntax = syntax
        self.cells = cells
        self.failure = (-1, "not a query")
        self.readings_memo: dict[int, list[list]] = {}

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
        candidates = [
            (end - start, agg_index != 0, agg_index, sel, end)
            for agg_index, start in starts
            for sel, end in self.columns_at(start)
        ]
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
        return self.best_reading(where.end())

    def best_reading(self, position: int) -> list | None:
        """The conditions from `position` to the end: of the complete readings (no last value cut off), the one with
        the most values in their columns' cells; ties (and tables without rows) go to the earliest-split reading."""
        complete = [reading for reading in self.readings(position) if not self.cut_off(reading[-1])]
        if not complete:
            return None
        if len(complete) == 1 or not self.cells:
            return complete[0]
        return max(complete, key=lambda reading: sum(self.cells.holds(column, value) for column, _, value in reading))

    def cut_off(self, condition: list) -> bool:
        column, _, value = condition
        if not self.truncated_value(value) or self.cells.holds(column, value):
            return False
        self.fail(len(self.text) - len(value), "truncated WHERE clause (dangling AND)")  # the last value ends the text
        return True

    def readings(self, position: int) -> list[list]:
        """Every way (up to MAX_READINGS) to read the text from `position` to the end as conditions, in order of
        preference: longest column first, then the value that ends at the earliest AND; memoized (values backtrack)."""
        if position not in self.readings_memo:
            self.readings_memo[position] = self._readings(position)
        return self.readings_memo[position]

    def _readings(self, position: int) -> list[list]:
        columns = self.columns_at(position)
        if not columns:
            self.fail(position, "no column of the table in the WHERE condition")
        found: list[list] = []
        for column, column_end in columns:
            op = self.syntax.op.match(self.text, column_end)
            if not op:
                self.fail(column_end, "expected an operator (=, >, <) after the condition column")
                continue
            found.extend(self.readings_from(column, COND_OPS.index(op.group(1)), op.end()))
            if len(found) >= MAX_READINGS:
                break
        return found[:MAX_READINGS]

    def readings_from(self, column: int, op: int, value_start: int) -> list[list]:
        """This condition and the ones after it: its value runs to an AND after which the rest reads, or to the end."""
        if self.at_end(value_start):
            self.fail(value_start, "missing condition value")
            return []
        found = []
        for separator in self.and_separators(value_start + 1):
            value = [column, op, self.text[value_start : separator.start()].strip()]
            for rest in self.readings(separator.end()):
                found.append([value] + rest)
                if len(found) >= MAX_READINGS:
                    return found
        found.append([[column, op, self.text[value_start:].strip()]])
        return found

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
#
# WikiSQL's evaluate.py, with lib/dbengine.py, lib/query.py and lib/table.py of github.com/salesforce/WikiSQL, rule by
# rule (DESIGN.md section 3): one SQLite table per WikiSQL table, columns col0..colN declared with the table's types
# ("text"/"real"), rows inserted as given with every str cell lower-cased; conditions bound by column name; results
# compared as lists in SQLite's order. SQLite then applies its own affinity rules: a "real" column keeps a cell such as
# "1,234" as TEXT, and any TEXT compares greater than any number.

WIKISQL_NUMBER = re.compile(
    r"[-+]?\d*\.\d+|\d+"
)  # lib/dbengine.py num_re: the fallback when a value is not a plain number
COLUMN_TYPES = ("text", "real")
_CONNECTION_CACHE_SIZE = 512
# A WikiSQL query runs on one small table in well under a millisecond; this bound only keeps a pathological table or
# query (a generated one, a reward's) from holding up scoring or training: past it SQLite is interrupted and the query
# raises as one that cannot run.
QUERY_TIME_LIMIT_S = 5.0


@dataclass
class _TableDatabase:
    """One table loaded into its own in-memory SQLite database, as table `t` with columns col0..colN."""

    table: dict
    connection: sqlite3.Connection


_databases: OrderedDict[str, _TableDatabase] = OrderedDict()
_databases_lock = threading.Lock()


def execute_query(query: dict, table: dict) -> list:
    """The result of a structured query on a WikiSQL table, as WikiSQL's DBEngine.execute returns it.

    `SELECT {agg}(col{sel}) AS result FROM t WHERE col{c} {op} :col{c} AND ...`: text cells and str condition values
    are lower-cased; a value for a "real" column that is not already a number is read with `wikisql_number`; two
    conditions on one column share the last one's value (bound by name). Rows come back in SQLite's order.
    Raises SQLExecutionError where WikiSQL's engine raises (a value with no number for a real column, an operator
    SQLite cannot run) and for indices out of range or a malformed table.
    """
    header, types, rows = _checked_table(table)
    sel, agg, conds = _checked_query(query, len(header))
    select = f"{AGG_OPS[agg]}(col{sel})" if agg else f"col{sel}"
    where = " AND ".join(f"col{col} {COND_OPS[op]} :col{col}" for col, op, _ in conds)
    statement = f"SELECT {select} AS result FROM t" + (f" WHERE {where}" if where else "")
    parameters = {f"col{col}": condition_value(value, types[col]) for col, _, value in conds}
    with _databases_lock:
        database = _database_for(table, header, types, rows)
        deadline = time.monotonic() + QUERY_TIME_LIMIT_S
        database.connection.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
        try:
            return [row[0] for row in database.connection.execute(statement, parameters)]
        except sqlite3.Error as error:
            raise SQLExecutionError(f"SQLite could not run {statement!r}: {error}") from None
        finally:
            database.connection.set_progress_handler(None, 0)


def condition_value(value: object, column_type: str) -> object:
    """A condition value as WikiSQL binds it: a str lower-cased; for a real column, a number (see wikisql_number)."""
    if isinstance(value, str):
        value = value.lower()
    if column_type == "real" and not isinstance(value, (int, float)):
        return wikisql_number(value)
    return value


def wikisql_number(text: object) -> float:
    """`float(babel.numbers.parse_decimal(text))` in the en_US locale, else the first number in the text (WikiSQL's
    fallback); raises SQLExecutionError when there is none, where WikiSQL raises IndexError.

    parse_decimal (non-strict) drops the group symbol "," and hands the rest to decimal.Decimal, which also takes
    surrounding spaces, underscores between digits, exponents, "nan" and "infinity".
    """
    text = str(text)
    try:
        return float(decimal.Decimal(text.replace(",", "")))
    except decimal.InvalidOperation:
        pass
    except ValueError as error:  # a signalling NaN converts to no float; WikiSQL raises here too
        raise SQLExecutionError(f"condition value {text!r} is not a number: {error}") from None
    found = WIKISQL_NUMBER.findall(text)
    if not found:
        raise SQLExecutionError(f"condition value {text!r} on a real column holds no number")
    return float(found[0])


def _checked_table(table: dict) -> tuple[list[str], list[str], list[list]]:
    try:
        header, rows = list(table["header"]), list(table["rows"])
    except (KeyError, TypeError):
        raise SQLExecutionError("a table needs 'header' and 'rows' (WikiSQL's tables.jsonl format)") from None
    types = [str(kind).lower() for kind in table.get("types") or ["text"] * len(header)]
    if len(types) != len(header):
        raise SQLExecutionError(f"table {table.get('id')!r} has {len(header)} header names but {len(types)} types")
    unknown = sorted(set(types) - set(COLUMN_TYPES))
    if unknown:
        raise SQLExecutionError(
            f"table {table.get('id')!r} has column types {unknown}; WikiSQL's are 'text' and 'real'"
        )
    for number, row in enumerate(rows):
        if len(row) != len(header):
            raise SQLExecutionError(
                f"table {table.get('id')!r} row {number} has {len(row)} cells for {len(header)} columns"
            )
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
        _check_index(cond[1], len(COND_OPS), "condition operator")
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
    """lib/table.py Table.create_table(lower=True): declared types as given, str cells lower-cased, the rest as they are."""
    connection = sqlite3.connect(":memory:", check_same_thread=False)
    connection.execute(f"CREATE TABLE t ({', '.join(f'col{i} {kind}' for i, kind in enumerate(types))})")
    if rows:
        placeholders = ", ".join("?" for _ in header)
        cells = [[cell.lower() if isinstance(cell, str) else cell for cell in row] for row in rows]
        connection.executemany(f"INSERT INTO t VALUES ({placeholders})", cells)
    return connection


# --------------------------------------------------------------------------- score

# The query's parts, as WikiSQL papers break accuracy down (SQLNet, SQLova: sc, sa, wn, wc, wo, wv).
COMPONENTS = ("select_column", "aggregation", "where_number", "where_column", "where_operator", "where_value")


def exact_match(predicted_text: str, gold_text: str) -> bool:
    """The strings are equal once runs of whitespace are collapsed (case-sensitive)."""
    return " ".join(str(predicted_text or "").split()) == " ".join(str(gold_text or "").split())


def same_logical_form(predicted: dict, gold: dict) -> bool:
    """lib/query.py Query.__eq__ (unordered): same sel and agg, and equal sets of (column, operator, str(value).lower()).

    Values are compared as text: 2003 and "2003" are equal, 2003 and 2003.0 are not.
    """
    return (
        predicted["sel"] == gold["sel"]
        and predicted["agg"] == gold["agg"]
        and {_condition_key(c) for c in predicted["conds"]} == {_condition_key(c) for c in gold["conds"]}
    )


def _condition_key(cond: list) -> tuple:
    column, op, value = cond
    return (column, op, str(value).lower())


def component_matches(predicted: dict | None, gold: dict) -> dict[str, bool]:
    """Which parts of the query are right, as SQLova's get_cnt_* count them: select column, aggregation, number of
    conditions, and, for equal numbers, the condition columns, operators and values compared in column order (values
    as in the logical form). An unparsed prediction gets every part wrong."""
    if predicted is None:
        return dict.fromkeys(COMPONENTS, False)
    pred, real = _by_column(predicted["conds"]), _by_column(gold["conds"])
    same_number = len(pred) == len(real)
    return {
        "select_column": predicted["sel"] == gold["sel"],
        "aggregation": predicted["agg"] == gold["agg"],
        "where_number": same_number,
        "where_column": same_number and [c[0] for c in pred] == [c[0] for c in real],
        "where_operator": same_number and [c[1] for c in pred] == [c[1] for c in real],
        "where_value": same_number and [c[2] for c in pred] == [c[2] for c in real],
    }


def _by_column(conds: list) -> list[tuple]:
    return sorted(_condition_key(c) for c in conds)


def score_prediction(predicted_text: str, gold_text: str, gold_query: dict | None, table: dict) -> dict:
    """Exact, logical-form and execution match of one prediction, and which parts of it are wrong.

    Returns {"exact_match", "logical_form_match", "execution_match", "parsed", "parse_error", "execution_error",
    "components", "wrong_parts"}. A prediction that does not parse or raises on execution is wrong, as in WikiSQL.
    Without `gold_query` the gold string is parsed against the table. A prediction that is the gold's exact text reads
    as the gold query (never worse than its text), even where that text has another reading too.
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
        if scored["exact_match"]:
            scored["parsed"] = _exact_gold(gold)
        else:
            scored["parsed"] = parse_sql(predicted_text, table["header"], table.get("rows"))
    except SQLParseError as error:
        scored["parse_error"] = str(error)
    if scored["parsed"] is not None:
        scored["logical_form_match"] = same_logical_form(scored["parsed"], gold)
        scored["execution_match"], scored["execution_error"] = _execution_match(scored["parsed"], gold, table)
    scored["components"] = component_matches(scored["parsed"], gold)
    scored["wrong_parts"] = [name for name, right in scored["components"].items() if not right]
    return scored


def _exact_gold(gold: dict) -> dict:
    """A copy of the gold query: what a prediction that is the gold's own text says."""
    return {"sel": gold["sel"], "agg": gold["agg"], "conds": [list(cond) for cond in gold["conds"]]}


def _gold_query_from_text(gold_text: str, table: dict) -> dict:
    try:
        return parse_sql(gold_text, table["header"], table.get("rows"))
    except SQLParseError as error:
        raise TextsqlError(
            f"The gold SQL {gold_text!r} does not parse against its table {table.get('id')!r} ({error}): "
            "the examples and tables.jsonl do not belong together. Prepare the dataset again."
        ) from None


def _execution_match(predicted: dict, gold: dict, table: dict) -> tuple[bool, str | None]:
    try:
        gold_result = execute_query(gold, table)
    except SQLExecutionError as error:
        # WikiSQL's evaluate.py stops here; textsql counts the example as wrong and says why.
        return False, f"gold query: {error}"
    try:
        return execute_query(predicted, table) == gold_result, None
    except SQLExecutionError as error:
        return False, f"predicted query: {error}"


def executes_plausibly(text: str, table: dict) -> bool:
    """Execution-guided decoding's test of a candidate: it parses against the header, executes without error, and a
    query without aggregation returns at least one row (an empty answer to a question is almost always wrong)."""
    try:
        query = parse_sql(text, table["header"], table.get("rows"))
        result = execute_query(query, table)
    except (SQLParseError, SQLExecutionError):
        return False
    return bool(query["agg"]) or bool(result)


def aggregate_metrics(scored: list[dict], gold_queries: list[dict]) -> dict:
    """Overall accuracies, component accuracies, and the breakdown by the gold query's aggregation and number of conditions.

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
        "scoring": "WikiSQL evaluate.py (logical form: Query.__eq__ unordered; execution: DBEngine, results in SQLite's order)",
        "components": {name: _share(scored, lambda s, n=name: s["components"][n]) for name in COMPONENTS},
        "parse_errors": sum(score["parse_error"] is not None for score in scored),
        "by_aggregation": {name: _accuracies(group) for name, group in by_aggregation.items() if group},
        "by_num_conditions": {bucket: _accuracies(group) for bucket, group in by_num_conditions.items() if group},
    }


def _share(scored: list[dict], is_right) -> float:
    return sum(bool(is_right(score)) for score in scored) / len(scored) if scored else 0.0


def _accuracies(scored: list[dict]) -> dict:
    return {
        "count": len(scored),
        "exact_match": _share(scored, lambda s: s["exact_match"]),
        "logical_form_accuracy": _share(scored, lambda s: s["logical_form_match"]),
        "execution_accuracy": _share(scored, lambda s: s["execution_match"]),
    }
