"""WikiSQL's format: operators, examples, the SQL text a model writes, and the names of the source formats a model
reads (textsql.prompts lays them out)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
