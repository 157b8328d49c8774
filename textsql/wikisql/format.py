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
# T5-based WikiSQL systems that reach ~90% execution accuracy do: a model cannot copy a column name it never sees.
SOURCE_FORMATS = ("question", "question+header")


HEADER_SEPARATOR = " | "


HEADER_LEAD = " columns: "


# How a prompt is laid out: "seq2seq" (the source an encoder reads; the target is separate) or "causal" (one text a
# decoder-only LM continues with the SQL; textsql.families decides which a model takes).
LAYOUTS = ("seq2seq", "causal")
PROMPT_QUESTION, PROMPT_COLUMNS, PROMPT_SQL = "### Question: ", "### Columns: ", "### SQL:\n"


def source_text(
    question: str,
    header: list[str] | None,
    prefix: str,
    source_format: str,
    layout: str = "seq2seq",
    max_columns: int | None = None,
) -> str:
    """What the model reads for a question: the prefix and the question, and with 'question+header' the column names
    (the first `max_columns` of them when given). A causal LM reads a plain prompt it continues with the SQL
    (no prefix): `### Question: ...`, `### Columns: a | b` with 'question+header', then `### SQL:` and a new line."""
    if source_format not in SOURCE_FORMATS:
        raise TextsqlError(f"Unknown source format '{source_format}'; textsql knows {', '.join(SOURCE_FORMATS)}.")
    if layout not in LAYOUTS:
        raise TextsqlError(f"Unknown prompt layout '{layout}'; textsql knows {', '.join(LAYOUTS)}.")
    columns = None
    if source_format == "question+header":
        if header is None:
            raise TextsqlError("--source_format question+header needs the question's table; this question has none.")
        columns = HEADER_SEPARATOR.join(" ".join(str(name).split()) for name in header[:max_columns])
    question = " ".join(question.split()) if layout == "causal" else question
    if layout == "causal":
        lines = [PROMPT_QUESTION + question] + ([PROMPT_COLUMNS + columns] if columns is not None else [])
        return "\n".join(lines) + "\n" + PROMPT_SQL
    return prefix + question + (HEADER_LEAD + columns if columns is not None else "")
