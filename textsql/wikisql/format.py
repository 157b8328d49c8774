"""WikiSQL's format: operators, examples, the SQL text a model writes and the source text it reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.errors import TextsqlError

# Indexed as in the release's `sql` field.

AGG_OPS = ["", "MAX", "MIN", "COUNT", "SUM", "AVG"]
COND_OPS = ["=", ">", "<", "OP"]


@dataclass
class Example:
    """One question, its target SQL string, and (when the source has it) the structured query."""

    question: str
    target: str
    table_id: str = ""
    sql: dict | None = None


@dataclass
class WikiSQLData:
    """Examples per split plus the tables they refer to (empty for hub copies without tables)."""

    source: str
    splits: dict[str, list[Example]]
    tables: dict[str, dict] = field(default_factory=dict)


def render_sql(sql: dict, header: list[str] | None) -> str:
    """Human-readable SQL exactly as the Hugging Face `wikisql` loader builds it (runs of whitespace collapsed)."""
    column = header[sql["sel"]] if header is not None else f"col{sql['sel']}"
    text = f"SELECT {AGG_OPS[sql['agg']]} {column} FROM table"
    if sql["conds"]:
        text += " WHERE " + " AND ".join(f"{header[c]} {COND_OPS[o]} {v}" for c, o, v in sql["conds"])
    return " ".join(text.split())


# What the model reads: the question alone (the walkthrough's format), or followed by the table's column names, as
# T5-based WikiSQL systems that reach ~90% execution accuracy do: a model cannot copy a column name it never sees; or
# also the table's cells the question mentions, each with its column (BRIDGE's lever: a WHERE value becomes a copy, and
# the column holding it is named beside it; textsql.wikisql.cells finds them).
VALUES_FORMAT = "question+header+values"
SOURCE_FORMATS = ("question", "question+header", VALUES_FORMAT)


HEADER_SEPARATOR = " | "


HEADER_LEAD = " columns: "
VALUES_LEAD = " values: "
VALUE_LINK = " = "  # column = cell


# How a prompt is laid out: "seq2seq" (the source an encoder reads; the target is separate) or "causal" (one text a
# decoder-only LM continues with the SQL; textsql.families decides which a model takes).
LAYOUTS = ("seq2seq", "causal")
PROMPT_QUESTION, PROMPT_COLUMNS, PROMPT_VALUES, PROMPT_SQL = (
    "### Question: ",
    "### Columns: ",
    "### Values: ",
    "### SQL:\n",
)


def _one_line(text) -> str:
    return " ".join(str(text).split())


def source_text(
    question: str,
    header: list[str] | None,
    prefix: str,
    source_format: str,
    layout: str = "seq2seq",
    max_columns: int | None = None,
    values: list[tuple[str, str]] | None = None,
) -> str:
    """What the model reads for a question: the prefix and the question, and with 'question+header' (or
    'question+header+values') the column names (the first `max_columns` of them when given); with
    'question+header+values' then `values`, (column name, cell) pairs best first, as `column = cell` (no section when
    there are none). A causal LM reads a plain prompt it continues with the SQL (no prefix): `### Question: ...`,
    `### Columns: a | b`, `### Values: b = Utah Jazz | a = 1998`, then `### SQL:` and a new line; T5 reads
    `prefix question columns: a | b values: b = Utah Jazz | a = 1998`."""
    if source_format not in SOURCE_FORMATS:
        raise TextsqlError(f"Unknown source format '{source_format}'; textsql knows {', '.join(SOURCE_FORMATS)}.")
    if layout not in LAYOUTS:
        raise TextsqlError(f"Unknown prompt layout '{layout}'; textsql knows {', '.join(LAYOUTS)}.")
    columns = listed = None
    if source_format != "question":
        if header is None:
            raise TextsqlError(f"--source_format {source_format} needs the question's table; this question has none.")
        columns = HEADER_SEPARATOR.join(_one_line(name) for name in header[:max_columns])
    if source_format == VALUES_FORMAT and values:
        listed = HEADER_SEPARATOR.join(_one_line(column) + VALUE_LINK + _one_line(cell) for column, cell in values)
    question = " ".join(question.split()) if layout == "causal" else question
    if layout == "causal":
        lines = [PROMPT_QUESTION + question] + ([PROMPT_COLUMNS + columns] if columns is not None else [])
        lines += [PROMPT_VALUES + listed] if listed else []
        return "\n".join(lines) + "\n" + PROMPT_SQL
    return (
        prefix
        + question
        + (HEADER_LEAD + columns if columns is not None else "")
        + (VALUES_LEAD + listed if listed else "")
    )
