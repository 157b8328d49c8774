"""Decoding and scoring shared by training and inference: batched generation (greedy, beams, execution-guided), the
scoring set of a split, WikiSQL's metrics and the lines that print them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from textsql.errors import TextsqlError
from textsql.families import ensure_pad_token, family_of, pad_token_id
from textsql.prep import load_prepared, load_tables, model_source
from textsql.wikisql.sql import aggregate_metrics, exact_match, executes_plausibly, score_prediction

DECODINGS = ("greedy", "execution_guided")


def check_decoding(decoding: str, num_beams: int, flag: str = "--") -> None:
    if decoding not in DECODINGS:
        raise TextsqlError(f"{flag}decoding must be one of {', '.join(DECODINGS)}, not '{decoding}'.")
    if num_beams < 1:
        raise TextsqlError(f"{flag}num_beams must be at least 1.")
    if decoding == "execution_guided" and num_beams < 2:
        raise TextsqlError(
            f"{flag}decoding execution_guided chooses among beam-search candidates: pass {flag}num_beams 4 (at least 2)."
        )


def decoding_label(decoding: str, num_beams: int) -> str:
    if decoding == "execution_guided":
        return f"execution-guided ({num_beams} beams)"
    return "greedy" if num_beams == 1 else f"beam search ({num_beams} beams)"


def pick_device(choice: str):
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise TextsqlError("--device cuda was asked for, but no CUDA GPU is visible; use --device auto or cpu.")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def generate_sql(
    model,
    tokenizer,
    sources: list[str],
    *,
    batch_size: int = 64,
    num_beams: int = 1,
    num_candidates: int = 1,
    max_new_tokens: int = 128,
    synced_gpus: bool = False,
    progress: bool = True,
    device=None,
) -> list[list[str]]:
    """The `num_candidates` best generations (beam order) for each source, in batches of similar length so each batch
    pads little (taken longest and shortest in turn: `alternating`), input order kept; the progress bar counts
    questions. A causal LM's prompts are padded on the left (its new tokens follow every prompt
    directly), it stops at EOS, and only the tokens after the prompt are decoded."""
    import torch
    from tqdm.auto import tqdm

    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    outputs: list[list[str]] = [[] for _ in sources]
    # Under ZeRO-3 parameters are placeholders, so the caller names the device.
    device = device if device is not None else next(model.parameters()).device
    causal = family_of(model.config).causal
    if causal:
        ensure_pad_token(tokenizer)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(sources), desc="generating", unit="question", disable=not progress)
    for start in alternating(range(0, len(order), batch_size)):
        indices = order[start : start + batch_size]
        encoded = tokenizer(
            [sources[i] for i in indices],
            return_tensors="pt",
            padding=True,
            padding_side="left" if causal else "right",
        ).to(device)
        with torch.no_grad():
            generated = model.generate(
                **encoded,
                num_beams=num_beams,
                num_return_sequences=num_candidates,
                max_new_tokens=max_new_tokens,
                synced_gpus=synced_gpus,
                pad_token_id=pad_token_id(tokenizer),
                eos_token_id=tokenizer.eos_token_id,
            )
        if causal:  # the prompt comes back first
            generated = generated[:, encoded["input_ids"].shape[1] :]
        texts = [" ".join(text.split()) for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]
        for n, i in enumerate(indices):
            outputs[i] = texts[n * num_candidates : (n + 1) * num_candidates]
        bar.update(len(indices))
    bar.close()
    model.train(was_training)
    return outputs


def alternating(items) -> list:
    """Longest and shortest in turn (items sorted longest first: first, last, second, second to last, ...): the
    longest batch still comes first (a batch that does not fit fails at once), and after any two batches the progress
    bar's rate is about the whole run's, where longest first made its first estimate too long (46 minutes said, 18
    taken)."""
    items = list(items)
    return [items[i // 2] if i % 2 == 0 else items[-(i // 2) - 1] for i in range(len(items))]


def sql_token_budget(metadata: dict, split: str = "validation", default: int = 128) -> int:
    """New tokens to generate for a prepared split's questions: its longest gold SQL (with EOS) and a quarter more, as
    prep counted them, so a model that has not learned to stop yet (early in training) costs no more than that; a
    longer answer is none of the split's queries. `default` where prep recorded no lengths."""
    longest = ((metadata.get("lengths") or {}).get(split) or {}).get("target_percentiles", {}).get("p100")
    return int(longest * 1.25) + 1 if longest else default


def choose_prediction(candidates: list[str], table: dict | None, decoding: str) -> tuple[str, int]:
    """(prediction, its rank among the candidates): the top one, or with execution_guided the first that executes
    plausibly on the table (textsql.wikisql.sql.executes_plausibly), falling back to the top one."""

    if decoding == "execution_guided" and table is not None:
        for rank, text in enumerate(candidates):
            if executes_plausibly(text, table):
                return text, rank
    return candidates[0], 0


@dataclass
class ScoringSet:
    """Questions with their gold SQL, structured queries and tables, ready to generate for and score."""

    sources: list[str]
    questions: list[str]
    table_ids: list[str]
    gold_texts: list[str]
    gold_queries: list[dict | None]
    tables: dict[str, dict]


def load_scoring_set(
    dataset_dir: str, split: str, max_examples: int | None = None, prepared: tuple | None = None
) -> ScoringSet:
    """The split's questions, gold queries and tables; `prepared` is load_prepared(dataset_dir) when the caller has it."""

    dataset, metadata = prepared if prepared is not None else load_prepared(dataset_dir)
    if split not in dataset:
        raise TextsqlError(f"'{dataset_dir}' has no '{split}' split; it has {', '.join(dataset)}.")
    rows = dataset[split]
    if max_examples:
        rows = rows.select(range(min(max_examples, len(rows))))
    tables = load_tables(dataset_dir)
    if "prompt" in rows.column_names:  # a causal LM's prompts, as prep fitted them (column lists cut to fit)
        sources = list(rows["prompt"])
    else:
        sources = [
            model_source(q, tables[t]["header"] if t in tables else None, metadata)
            for q, t in zip(rows["question"], rows["table_id"])
        ]
    return ScoringSet(
        sources=sources,
        questions=list(rows["question"]),
        table_ids=list(rows["table_id"]),
        gold_texts=list(rows["target"]),
        gold_queries=[json.loads(s) if s else None for s in rows["sql"]],
        tables=tables,
    )


def score_predictions(scoring: ScoringSet, predictions: list[str]) -> tuple[list[dict], dict]:
    """Per-example records for predictions.jsonl and the aggregate metrics."""

    records, scored, gold_queries = [], [], []
    for i, predicted in enumerate(predictions):
        table = scoring.tables.get(scoring.table_ids[i])
        gold_query = scoring.gold_queries[i]
        if table is None or gold_query is None:
            # Hub copies without tables: only the exact string match can be judged.
            result = {
                "exact_match": exact_match(predicted, scoring.gold_texts[i]),
                "logical_form_match": None,
                "execution_match": None,
                "parsed": None,
                "parse_error": "no table to parse against",
            }
        else:
            result = score_prediction(predicted, scoring.gold_texts[i], gold_query, table)
            scored.append(result)
            gold_queries.append(gold_query)
        records.append(
            {
                "question": scoring.questions[i],
                "table_id": scoring.table_ids[i],
                "gold_sql": scoring.gold_texts[i],
                "predicted_sql": predicted,
                **result,
            }
        )
    if not scored:
        raise TextsqlError(
            "None of these examples has a table, so logical-form and execution accuracy cannot be computed; use a dataset prepared from the release files or the HF wikisql layout."
        )
    return records, aggregate_metrics(scored, gold_queries)


def decode_and_score(
    model, tokenizer, scoring: ScoringSet, *, decoding: str = "greedy", num_beams: int = 1, **generate_kwargs
) -> tuple[list[dict], dict]:
    """Generate for every question of `scoring` with the decoding asked for, then score: (records, metrics).

    With execution_guided each record says which beam was taken ("candidate_rank") and whether that changed the
    answer from the top beam; the metrics count how often.
    """
    candidates = generate_sql(
        model,
        tokenizer,
        scoring.sources,
        num_beams=num_beams,
        num_candidates=num_beams if decoding == "execution_guided" else 1,
        **generate_kwargs,
    )
    chosen = [
        choose_prediction(options, scoring.tables.get(table_id), decoding)
        for options, table_id in zip(candidates, scoring.table_ids)
    ]
    records, metrics = score_predictions(scoring, [text for text, _ in chosen])
    for record, (text, rank), options in zip(records, chosen, candidates):
        record["candidate_rank"] = rank
        record["decoding_changed"] = text != options[0]
    changed = sum(record["decoding_changed"] for record in records)
    metrics["decoding"] = {
        "method": decoding,
        "num_beams": num_beams,
        "label": decoding_label(decoding, num_beams),
        "changed": changed,
        "changed_share": changed / len(records) if records else 0.0,
    }
    return records, metrics


def format_components(components: dict) -> str:
    """The parts of the query right (textsql.wikisql.sql.COMPONENTS), in one line."""
    return "parts right: " + ", ".join(f"{name.replace('_', ' ')} {share:.1%}" for name, share in components.items())


def format_metrics(metrics: dict) -> str:
    decoding = metrics.get("decoding", {})
    changed = (
        f"; execution-guided changed {decoding['changed']}" if decoding.get("method") == "execution_guided" else ""
    )
    lines = [
        f"{metrics['examples']} examples ({metrics.get('split', '')}, {decoding.get('label', 'greedy')}): "
        f"execution {metrics['execution_accuracy']:.1%}, logical form {metrics['logical_form_accuracy']:.1%}, "
        f"exact match {metrics['exact_match']:.1%} ({metrics['parse_errors']} unparseable{changed}; "
        f"{metrics.get('queries_per_second', 0):.1f} questions/s)"
    ]
    if metrics.get("components"):
        lines.append(format_components(metrics["components"]))
    return "\n".join(lines)
