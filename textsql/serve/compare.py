"""`textsql compare`: several models' SQL side by side for one question (a Gradio app on 127.0.0.1, air-gapped) or
for a whole split (JSON): the executed answers, WikiSQL's verdicts where there is a gold query, and each model's speed.

Models are any folders textsql writes (a base model, a LoRA adapter, a merged or a quantized model; textsql.loading
loads each kind), of either family: a T5 and a causal LM each read the question as they were fine-tuned to
(textsql.prompts.metadata_for_model), about the same tables. As a CML Application, scripts/compare_app.py serves the app on $CDSW_APP_PORT.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from textsql.arguments.compare import CompareArguments, model_specs
from textsql.errors import TextsqlError
from textsql.evaluate import ScoringSet, choose_prediction, decode_and_score, generate_sql, load_scoring_set
from textsql.extras import require_lifecycle_extra
from textsql.families import family_of
from textsql.loading import folder_kind, load_for_inference, pick_device, read_record
from textsql.prepared import load_prepared
from textsql.prompts import metadata_for_model, model_source
from textsql.serve.tensorboard import DEFAULT_HOST
from textsql.wikisql.sql import SQLExecutionError, SQLParseError, execute_query, parse_sql, score_prediction

MODELS_VARIABLE = "TEXTSQL_COMPARE_MODELS"  # the CML Application's models (scripts/compare_app.py)
DATASET_VARIABLE = "TEXTSQL_DATASET_DIR"
MAX_TABLE_CHOICES = 500  # the table picker lists the split's first tables; a typed id is accepted too
PREVIEW_ROWS = 8
MAX_QUESTION_CHARACTERS = 1000  # a typed question; WikiSQL's longest are a few hundred


@dataclass
class LoadedModel:
    label: str
    path: str
    kind: str  # as people read it: model, LoRA adapter, quantized (method)
    model: object
    tokenizer: object
    family: str  # t5, qwen2, ...
    metadata: dict  # how it reads a question (textsql.prompts.metadata_for_model)


def describe_kind(path: str) -> str:
    kind = folder_kind(path)
    if kind == "quantized":
        return f"quantized ({read_record(path)['method']})"
    return "LoRA adapter" if kind == "adapter" else "model"


def load_models(models: list[str], device: str, dataset_dir: str, metadata: dict) -> list[LoadedModel]:
    """Every model, loaded once, with how it reads the dataset's questions (checked against its source format)."""
    loaded = []
    for label, path in model_specs(models):
        try:
            model, tokenizer = load_for_inference(path, device)
            reads = metadata_for_model(model.config, metadata, dataset_dir)
        except TextsqlError as error:  # which of the models, where several are named
            raise TextsqlError(f"The model '{label}' ({path}) cannot be compared: {error}") from None
        # One short generation first: first-call costs (allocations, weight packing) stay out of the latencies shown.
        generate_sql(model, tokenizer, ["warm up"], batch_size=1, max_new_tokens=2, progress=False)
        family = family_of(model.config).name
        loaded.append(LoadedModel(label, path, describe_kind(path), model, tokenizer, family, reads))
    return loaded


class Comparison:
    """A prepared dataset and loaded models: answers one question with each model, or scores a split."""

    def __init__(self, args: CompareArguments):
        self.args = args
        self.prepared = load_prepared(args.dataset_dir)
        self.metadata = self.prepared[1]
        self.device = str(pick_device(args.device).type)
        self.models = load_models(args.models, self.device, args.dataset_dir, self.metadata)
        self.scoring = load_scoring_set(args.dataset_dir, args.split, prepared=self.prepared)
        self.tables = self.scoring.tables
        self.questions_by_table: dict[str, list[int]] = {}
        for i, table_id in enumerate(self.scoring.table_ids):
            if table_id in self.tables:
                self.questions_by_table.setdefault(table_id, []).append(i)

    def table(self, table_id: str) -> dict:
        table = self.tables.get(table_id)
        if table is None:
            raise TextsqlError(f"Table '{table_id}' is not in '{self.args.dataset_dir}/tables.jsonl'.")
        return table

    def answer(self, table_id: str, question: str, example: int | None = None) -> dict:
        """Each model's SQL for `question` about `table_id`, its executed answer and latency; with `example` (an index
        of the split whose question this is) the gold query, its answer and WikiSQL's verdicts too."""
        table = self.table(table_id)
        question = question.strip()
        if not question:
            raise TextsqlError("Type a question about the table, or pick one of the split's questions.")
        if len(question) > MAX_QUESTION_CHARACTERS:
            raise TextsqlError(
                f"That question has {len(question)} characters; ask one of at most {MAX_QUESTION_CHARACTERS}."
            )
        gold_sql = gold_query = None
        if example is not None:
            gold_sql, gold_query = self.scoring.gold_texts[example], self.scoring.gold_queries[example]
        result = {
            "table_id": table_id,
            "question": question,
            "gold_sql": gold_sql,
            "gold_answer": execute_query(gold_query, table) if gold_query else None,
            "models": [],
        }
        for loaded in self.models:
            started = time.perf_counter()
            predicted, _ = choose_prediction(
                generate_sql(
                    loaded.model,
                    loaded.tokenizer,
                    [model_source(question, table, loaded.metadata, loaded.tokenizer)],
                    batch_size=1,
                    max_new_tokens=self.args.max_new_tokens,
                    progress=False,
                )[0],
                table,
                "greedy",
            )
            latency = time.perf_counter() - started
            row = {
                "label": loaded.label,
                "kind": loaded.kind,
                "family": loaded.family,
                "sql": predicted,
                "latency_ms": round(latency * 1000, 1),
            }
            try:
                row["answer"] = execute_query(parse_sql(predicted, table["header"]), table)
            except (SQLParseError, SQLExecutionError) as error:
                row["error"] = str(error)
            if gold_query:
                verdict = score_prediction(predicted, gold_sql, gold_query, table)
                row["verdicts"] = {
                    key: verdict[key] for key in ("exact_match", "logical_form_match", "execution_match")
                }
            result["models"].append(row)
        return result

    def sources_for(self, loaded: LoadedModel, scoring: ScoringSet) -> ScoringSet:
        """`scoring` with the sources `loaded` reads: the prepared ones where the dataset was prepared for its family,
        else built as it was fine-tuned to read them (fitted to its budget where its settings record one: cell values)."""
        if loaded.metadata is self.metadata:
            return scoring
        sources = [
            model_source(question, scoring.tables[table_id], loaded.metadata, loaded.tokenizer)
            for question, table_id in zip(scoring.questions, scoring.table_ids, strict=True)
        ]
        return replace(scoring, sources=sources)

    def compare_split(self, max_examples: int | None = None) -> dict:
        """Every model over the split's questions, scored as `textsql infer` scores: metrics, speed, and for each
        question each model's SQL and verdict; agreement is the share of identical SQL with the first model."""
        scoring = load_scoring_set(self.args.dataset_dir, self.args.split, max_examples, prepared=self.prepared)
        per_model, records_by_model = [], []
        for loaded in self.models:
            started = time.perf_counter()
            records, metrics = decode_and_score(
                loaded.model,
                loaded.tokenizer,
                self.sources_for(loaded, scoring),
                batch_size=self.args.batch_size,
                max_new_tokens=self.args.max_new_tokens,
                progress=False,
            )
            seconds = time.perf_counter() - started
            records_by_model.append(records)
            first = records_by_model[0]
            per_model.append(
                {
                    "label": loaded.label,
                    "path": loaded.path,
                    "kind": loaded.kind,
                    "family": loaded.family,
                    "execution_accuracy": metrics["execution_accuracy"],
                    "logical_form_accuracy": metrics["logical_form_accuracy"],
                    "exact_match": metrics["exact_match"],
                    "parse_errors": metrics["parse_errors"],
                    "components": metrics["components"],  # the parts of the query right, which move first
                    "queries_per_second": round(len(records) / seconds, 2),
                    "agreement_with_first": sum(
                        a["predicted_sql"] == b["predicted_sql"] for a, b in zip(first, records, strict=True)
                    )
                    / len(records),
                }
            )
        questions = []
        for i in range(len(scoring.sources)):
            questions.append(
                {
                    "question": scoring.questions[i],
                    "table_id": scoring.table_ids[i],
                    "gold_sql": scoring.gold_texts[i],
                    "models": {
                        m.label: {"sql": r[i]["predicted_sql"], "execution_match": r[i]["execution_match"]}
                        for m, r in zip(self.models, records_by_model, strict=True)
                    },
                }
            )
        return {
            "dataset_dir": self.args.dataset_dir,
            "split": self.args.split,
            "examples": len(scoring.sources),
            "device": self.device,
            "models": per_model,
            "questions": questions,
        }


def format_split_comparison(report: dict) -> str:
    lines = [
        f"{report['examples']} {report['split']} questions on {report['device']}:",
        f"{'model':<20} {'kind':<26} {'family':<12} {'execution':>10} {'logical form':>13} {'questions/s':>12} "
        f"{'same SQL as first':>18}",
    ]
    for row in report["models"]:
        lines.append(
            f"{row['label']:<20} {row['kind']:<26} {row['family']:<12} {row['execution_accuracy']:>10.1%} "
            f"{row['logical_form_accuracy']:>13.1%} "
            f"{row['queries_per_second']:>12.1f} {row['agreement_with_first']:>18.1%}"
        )
    return "\n".join(lines)


def _verdict_text(row: dict) -> str:
    if "verdicts" not in row:
        return "no gold query (typed question)"
    v = row["verdicts"]
    return " · ".join(
        f"{name} {'✓' if v[key] else '✗'}"
        for name, key in (
            ("execution", "execution_match"),
            ("logical form", "logical_form_match"),
            ("exact", "exact_match"),
        )
    )


def result_rows(result: dict) -> list[list]:
    """The app's side-by-side table: one row per model."""
    return [
        [
            row["label"],
            row["kind"],
            row["family"],
            row["sql"],
            str(row.get("answer", row.get("error"))),
            _verdict_text(row),
            row["latency_ms"],
        ]
        for row in result["models"]
    ]


RESULT_HEADERS = ["model", "kind", "family", "SQL", "answer", "WikiSQL verdicts", "latency (ms)"]


def air_gapped_gradio():
    """gradio, imported with its analytics and version check off (they would call api.gradio.app)."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    require_lifecycle_extra("gradio", "textsql compare's app")
    import gradio  # heavy (FastAPI, its frontend): imported only when the app is served

    return gradio


def build_app(comparison: Comparison):
    """The Gradio Blocks: pick a table and a question (or type one), then each model's SQL, answer and verdicts."""
    import pandas

    gr = air_gapped_gradio()
    table_ids = list(comparison.questions_by_table)[:MAX_TABLE_CHOICES]

    def table_choice(table_id: str) -> tuple[str, str]:
        header = comparison.tables[table_id]["header"]
        return f"{table_id}: {', '.join(header[:4])}{', ...' if len(header) > 4 else ''}", table_id

    def questions_for(table_id: str | None):
        choices = [(comparison.scoring.questions[i], i) for i in comparison.questions_by_table.get(table_id or "", [])]
        table = comparison.tables.get(table_id or "")
        preview = pandas.DataFrame(table["rows"][:PREVIEW_ROWS], columns=table["header"]) if table else None
        return gr.update(choices=choices, value=choices[0][1] if choices else None), preview

    def compare(table_id: str | None, example, typed: str | None):
        if not table_id:
            raise gr.Error("Pick a table first.")
        try:
            if typed and typed.strip():
                result = comparison.answer(table_id, typed)
            elif example is not None and example != "":
                index = int(example)
                if (
                    not 0 <= index < len(comparison.scoring.questions)
                    or comparison.scoring.table_ids[index] != table_id
                ):
                    raise gr.Error(f"The split has no question {index} about table {table_id}: pick one from the list.")
                result = comparison.answer(table_id, comparison.scoring.questions[index], index)
            else:
                raise gr.Error("Pick a question or type one.")
        except TextsqlError as error:
            raise gr.Error(str(error)) from None
        gold = (
            f"**Gold SQL:** `{result['gold_sql']}`  \n**Gold answer:** {result['gold_answer']}"
            if result["gold_sql"]
            else "Typed question: no gold query, so no verdicts."
        )
        return pandas.DataFrame(result_rows(result), columns=RESULT_HEADERS), gold, result

    names = ", ".join(f"{m.label} ({m.kind}, {m.family})" for m in comparison.models)
    with gr.Blocks(title="textsql compare", analytics_enabled=False) as app:
        gr.Markdown(
            f"# textsql compare\nModels: {names}. Dataset: `{comparison.args.dataset_dir}` ({comparison.args.split})."
        )
        with gr.Row():
            table = gr.Dropdown(
                [table_choice(t) for t in table_ids],
                value=table_ids[0] if table_ids else None,
                label="Table",
                allow_custom_value=True,
            )
            # Custom values allowed: the API (and a session whose table changed) may name any question of the split.
            first = questions_for(table_ids[0] if table_ids else None)[0]
            example = gr.Dropdown(
                first["choices"], value=first["value"], label="Question from the split", allow_custom_value=True
            )
        typed = gr.Textbox(
            label="Or type a question about this table", placeholder="What is the ... when the ... is ...?"
        )
        button = gr.Button("Compare", variant="primary")
        results = gr.Dataframe(
            headers=RESULT_HEADERS, label="Each model's SQL, answer and verdicts", interactive=False, wrap=True
        )
        gold = gr.Markdown()
        preview = gr.Dataframe(label="The table (first rows)", interactive=False)
        with gr.Accordion("As JSON", open=False):
            details = gr.JSON()
        # The question list is a lookup: no progress overlay (it greyed the chosen question like a placeholder while
        # pending) and no place in the one-at-a-time queue of model calls (it waited behind a running comparison).
        quick = {"show_progress": "hidden", "concurrency_limit": None}
        table.change(questions_for, inputs=table, outputs=[example, preview], api_name="questions", **quick)
        app.load(questions_for, inputs=table, outputs=[example, preview], **quick)
        button.click(compare, inputs=[table, example, typed], outputs=[results, gold, details], api_name="compare")
    return app


def serve_app(comparison: Comparison, port: int, host: str = DEFAULT_HOST) -> None:
    """Serve the app until stopped (Ctrl-C or SIGTERM): no share link, no analytics, no server-side rendering."""
    gr = air_gapped_gradio()
    app = build_app(comparison)
    app.queue(default_concurrency_limit=1)  # one model call at a time: latencies are each model's own
    # The Default theme's fonts are served by gradio itself (LocalFont); run history could offer a Hugging Face bucket.
    app.launch(
        server_name=host,
        server_port=port,
        share=False,
        inbrowser=False,
        show_error=True,
        ssr_mode=False,
        mcp_server=False,
        run_history=False,
        quiet=True,
        footer_links=["api", "settings"],
        theme=gr.themes.Default(),
    )
