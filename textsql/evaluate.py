"""Decoding and scoring shared by training and inference: batched generation (greedy, beams, execution-guided,
constrained to the table's queries), the scoring set of a split, WikiSQL's metrics and the lines that print them."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass

from textsql.arguments.decoding import constrained, execution_guided
from textsql.errors import TextsqlError
from textsql.families import ensure_pad_token, family_of, pad_token_id
from textsql.prepared import load_prepared, load_tables
from textsql.prompts import model_source
from textsql.wikisql.constrained import QueryGrammar, vocabulary_of
from textsql.wikisql.sql import aggregate_metrics, exact_match, executes_plausibly, score_prediction


def decoding_label(decoding: str, num_beams: int) -> str:
    if execution_guided(decoding):
        label = f"execution-guided ({num_beams} beams)"
    else:
        label = "greedy" if num_beams == 1 else f"beam search ({num_beams} beams)"
    return f"constrained {label}" if constrained(decoding) else label


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
    on_batch=None,
    constrain_to: list[tuple[str, dict | None]] | None = None,
    echo=None,
) -> list[list[str]]:
    """The `num_candidates` best generations (beam order) for each source, in batches of similar length so each batch
    pads little (taken longest and shortest in turn: `alternating`), input order kept; the progress bar counts
    questions. A causal LM's prompts are padded on the left (its new tokens follow every prompt directly), it stops at
    EOS, and only the tokens after the prompt are decoded.

    With `constrain_to` ((question, table) per source) every row and beam may only write a WikiSQL query over its
    table (textsql.wikisql.constrained.QueryGrammar, one logits processor per generate() call) within max_new_tokens;
    its text is what the allowed tokens' bytes write. A source without a table is decoded unconstrained (a warning
    counts them). `on_batch`, when given, is called after each batch (a Trainer's callbacks see a prediction step);
    `echo`, when given, is told once how long the whole generation takes, timed on its first two batches (the longest
    and the shortest: `alternating`)."""
    import torch
    from tqdm.auto import tqdm

    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    outputs: list[list[str]] = [[] for _ in sources]
    # Under ZeRO-3 parameters are placeholders, so the caller names the device.
    device = device if device is not None else next(model.parameters()).device
    causal = family_of(model.config).causal
    if causal:
        ensure_pad_token(tokenizer)
    vocabulary = grammars = None
    if constrain_to is not None:
        vocabulary = vocabulary_of(tokenizer)
        producible = vocabulary.producible()
        grammars = [QueryGrammar(table, question, producible) if table else None for question, table in constrain_to]
        missing = sum(grammar is None for grammar in grammars)
        if missing:
            warnings.warn(
                f"{missing} of {len(grammars)} questions have no table: decoded without the constraint", stacklevel=2
            )
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(sources), desc="generating", unit="question", disable=not progress)
    batches, started = alternating(range(0, len(order), batch_size)), time.perf_counter()
    for done, start in enumerate(batches, 1):
        indices = order[start : start + batch_size]
        encoded = tokenizer(
            [sources[i] for i in indices],
            return_tensors="pt",
            padding=True,
            padding_side="left" if causal else "right",
        ).to(device)
        processor = None
        if grammars is not None:
            processor = ConstrainedLogits(
                [grammars[i] for i in indices],
                vocabulary,
                # a causal LM's rows hold the (left-padded) prompt first; T5's decoder ids start with its start token
                start=encoded["input_ids"].shape[1] if causal else 1,
                rows_per_source=num_beams,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
            )
        with torch.no_grad():
            generated = model.generate(
                **encoded,
                num_beams=num_beams,
                num_return_sequences=num_candidates,
                max_new_tokens=max_new_tokens,
                synced_gpus=synced_gpus,
                pad_token_id=pad_token_id(tokenizer),
                eos_token_id=tokenizer.eos_token_id,
                **({"logits_processor": processor_list(processor)} if processor is not None else {}),
            )
        if causal:  # the prompt comes back first
            generated = generated[:, encoded["input_ids"].shape[1] :]
        texts = [" ".join(text.split()) for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]
        if processor is not None:  # the text the automaton read (a tokenizer's decode may clean up spaces)
            for row, ids in enumerate(generated.tolist()):
                if processor.grammars[row // num_candidates] is not None:
                    texts[row] = vocabulary.text(
                        ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
                    )
        for n, i in enumerate(indices):
            outputs[i] = texts[n * num_candidates : (n + 1) * num_candidates]
        bar.update(len(indices))
        if echo is not None and done == 2 < len(batches):
            echo(describe_generation_estimate(time.perf_counter() - started, len(batches), len(sources)))
        if on_batch is not None:  # a caller's sign of life (a Trainer's callbacks: a pod's watch of training progress)
            on_batch()
    bar.close()
    model.train(was_training)
    return outputs


def describe_generation_estimate(first_two_s: float, batches: int, questions: int) -> str:
    """How long generating `questions` in `batches` takes, from its first two batches' seconds (one long, one short)."""
    seconds = first_two_s / 2 * batches
    length = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"
    return (
        f"timed here: {first_two_s:.1f} s for the first 2 of {batches} batches, so generating for {questions} questions "
        f"takes about {length} in all."
    )


class ConstrainedLogits:
    """A logits processor for one generate() call: each row (and beam) may only take the tokens its source's grammar
    allows after the text generated so far, and only those after which a query can still be completed within
    max_new_tokens (counting at least one byte a token); EOS only where a query is complete. A row's state is found
    from its generated ids (beams reorder rows between steps): its parent prefix's state advanced by the last token."""

    def __init__(self, grammars, vocabulary, *, start: int, rows_per_source: int, max_new_tokens: int, eos_token_id):
        self.grammars = grammars
        self.vocabulary = vocabulary
        self.start = start
        self.rows_per_source = rows_per_source
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id
        self.states: dict[tuple, frozenset] = {}
        self.tensors: dict[tuple, tuple] = {}
        self.dead_ends = 0  # rows left with no allowed token (their text cannot become a query): EOS ends them
        self.eos = None

    def state(self, source: int, ids: tuple) -> frozenset:
        key = (source, ids)
        state = self.states.get(key)
        if state is None:
            grammar = self.grammars[source]
            if not ids:
                state = grammar.initial
            else:
                data = self.vocabulary.token_bytes[ids[-1]] if ids[-1] < len(self.vocabulary.token_bytes) else None
                state = grammar.advance(self.state(source, ids[:-1]), data) if data else frozenset()
            self.states[key] = state
        return state

    def allowed(self, source: int, state: frozenset, vocabulary_size: int, device):
        import torch

        if self.eos is None:
            self.eos = torch.tensor([self.eos_token_id], dtype=torch.long, device=device)
        key = (source, state)
        if key not in self.tensors:
            ids, needs, eos = self.grammars[source].allowed(state, self.vocabulary)
            kept = [(token, need) for token, need in zip(ids, needs) if token < vocabulary_size]
            self.tensors[key] = (
                torch.tensor([token for token, _ in kept], dtype=torch.long, device=device),
                torch.tensor([need for _, need in kept], dtype=torch.float32, device=device),
                eos,
            )
        return self.tensors[key]

    def __call__(self, input_ids, scores):
        # The automaton allocates many small objects, none of them in a cycle (reference counting frees them), and the
        # collections they triggered scanned the whole process's heap: about half of the processor's time.
        return self.masked(input_ids, scores)

    def masked(self, input_ids, scores):
        import torch

        generated = input_ids[:, self.start :].tolist()
        left = self.max_new_tokens - len(generated[0]) - 1  # tokens after this one
        rows, columns, free = [], [], []
        for row, ids in enumerate(generated):
            source = row // self.rows_per_source
            if self.grammars[source] is None or self.eos_token_id in ids:  # unconstrained, or finished
                free.append(row)
                continue
            tokens, needs, accepting = self.allowed(
                source, self.state(source, tuple(ids)), scores.shape[1], scores.device
            )
            tokens = tokens[needs <= left]
            if accepting or not len(tokens):
                self.dead_ends += not accepting
                tokens = torch.cat([tokens, self.eos])
            rows.append(torch.full((len(tokens),), row, dtype=torch.long, device=scores.device))
            columns.append(tokens)
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        if rows:
            allowed[torch.cat(rows), torch.cat(columns)] = True
        allowed[free] = True
        return scores.masked_fill(~allowed, float("-inf"))


def processor_list(processor):
    from transformers import LogitsProcessorList

    return LogitsProcessorList([processor])


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

    if execution_guided(decoding) and table is not None:
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


def spread_indices(total: int, count: int) -> list[int]:
    """`count` indices taken evenly across `total` (every total/count-th one, the first included), in order."""
    count = min(count, total)
    return [index * total // count for index in range(count)]


def load_scoring_set(
    dataset_dir: str,
    split: str,
    max_examples: int | None = None,
    prepared: tuple | None = None,
    spread: bool = False,
) -> ScoringSet:
    """The split's questions, gold queries and tables; `prepared` is load_prepared(dataset_dir) when the caller has it.
    With `max_examples`, its first N questions, or with `spread` N taken evenly across it (a release's slice starts
    with easier questions: WikiSQL's first 300 test questions score about 4 points above the 1,062)."""

    dataset, metadata = prepared if prepared is not None else load_prepared(dataset_dir)
    if split not in dataset:
        raise TextsqlError(f"'{dataset_dir}' has no '{split}' split; it has {', '.join(dataset)}.")
    rows = dataset[split]
    if max_examples:
        count = min(max_examples, len(rows))
        rows = rows.select(spread_indices(len(rows), count) if spread else range(count))
    tables = load_tables(dataset_dir)
    if "prompt" in rows.column_names:  # a causal LM's prompts, as prep fitted them (values, columns cut to fit)
        sources = list(rows["prompt"])
    elif "source" in rows.column_names:  # T5's sources, as prep fitted them (cell values dropped to fit)
        sources = list(rows["source"])
    else:  # data prepared before prep kept the source text
        sources = [model_source(q, tables.get(t), metadata) for q, t in zip(rows["question"], rows["table_id"])]
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
    model,
    tokenizer,
    scoring: ScoringSet,
    *,
    decoding: str = "greedy",
    num_beams: int = 1,
    compare_to_greedy: bool = False,
    greedy_predictions: list[str] | None = None,
    **generate_kwargs,
) -> tuple[list[dict], dict]:
    """Generate for every question of `scoring` with the decoding asked for, then score: (records, metrics).

    Each record says which candidate was taken ("candidate_rank") and whether that changed the answer from the top one
    ("decoding_changed"); the metrics count how often. With `compare_to_greedy` (for any decoding but plain greedy) a
    greedy pass (one beam, unconstrained) is generated too, and the "decoding" block tells the chosen answers against
    greedy's (fixed: greedy wrong, chosen right; broken: the reverse; net), the top candidate against greedy (what the
    beams and the constraint gain) and the chosen answer against the top candidate (what the execution filter gains).
    `greedy_predictions` (one per question, from a greedy run of the same model) stand in for that pass.
    """
    constrain_to = None
    if constrained(decoding):
        constrain_to = [(q, scoring.tables.get(t)) for q, t in zip(scoring.questions, scoring.table_ids)]
    candidates = generate_sql(
        model,
        tokenizer,
        scoring.sources,
        num_beams=num_beams,
        num_candidates=num_beams if execution_guided(decoding) else 1,
        constrain_to=constrain_to,
        **generate_kwargs,
    )
    records, metrics = score_candidates(scoring, candidates, decoding, num_beams)
    if constrain_to is not None:
        metrics["decoding"]["unconstrained_questions"] = sum(table is None for _, table in constrain_to)
    if compare_to_greedy and (decoding != "greedy" or num_beams > 1):
        if greedy_predictions is None:
            greedy = generate_sql(model, tokenizer, scoring.sources, num_beams=1, num_candidates=1, **generate_kwargs)
            greedy_predictions = [options[0] for options in greedy]
        elif len(greedy_predictions) != len(scoring.sources):
            raise TextsqlError(
                f"{len(greedy_predictions)} greedy predictions for {len(scoring.sources)} questions: pass the "
                "predictions of a greedy run over the same questions."
            )
        compare_with_greedy(scoring, records, metrics, candidates, greedy_predictions)
    return records, metrics


def score_candidates(
    scoring: ScoringSet, candidates: list[list[str]], decoding: str, num_beams: int
) -> tuple[list[dict], dict]:
    """Each question's answer chosen from its candidates (beam order) as `decoding` chooses (choose_prediction), scored:
    (records, metrics), each record with the chosen candidate's rank and whether it changed the answer from the top
    one, the metrics' "decoding" block counting how often."""
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


def compare_with_greedy(
    scoring: ScoringSet, records: list[dict], metrics: dict, candidates: list[list[str]], greedy_predictions: list[str]
) -> None:
    """score_candidates' records and metrics told against greedy's answers (one per question): each record gets
    greedy's SQL and verdict, the "decoding" block the answers fixed and broken against greedy, the top candidate
    against greedy and the chosen answer against the top candidate."""
    greedy_records, greedy_metrics = score_predictions(scoring, greedy_predictions)
    top_records = records
    if any(record["decoding_changed"] for record in records):
        top_records, _ = score_predictions(scoring, [options[0] for options in candidates])
    for record, greedy_record in zip(records, greedy_records):
        record["greedy_sql"] = greedy_record["predicted_sql"]
        record["greedy_execution_match"] = greedy_record["execution_match"]
    metrics["decoding"].update(
        greedy_execution_accuracy=greedy_metrics["execution_accuracy"],
        differs_from_greedy=sum(r["predicted_sql"] != g["predicted_sql"] for r, g in zip(records, greedy_records)),
        against_greedy=execution_changes(greedy_records, records),
        top_candidate_against_greedy=execution_changes(greedy_records, top_records),
        choice_against_top_candidate=execution_changes(top_records, records),
    )


def execution_changes(before: list[dict], after: list[dict]) -> dict:
    """How many answers execution-matched in `after` but not `before` (fixed), the reverse (broken), and the net gain;
    questions without a table (no execution match) count in neither."""
    fixed = sum(bool(a["execution_match"]) and b["execution_match"] is False for b, a in zip(before, after))
    broken = sum(bool(b["execution_match"]) and a["execution_match"] is False for b, a in zip(before, after))
    return {"fixed": fixed, "broken": broken, "net": fixed - broken}


BOOTSTRAP_SAMPLES = 2000


def paired_bootstrap(before: list, after: list, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict:
    """The difference in execution accuracy (after - before) on the same questions, and its 95% interval from
    resampling the questions with replacement. Each side is (question key, right) pairs, as `execution_pairs` gives
    them: two sides that did not score the same questions in the same order are refused."""
    import random

    if [key for key, _ in before] != [key for key, _ in after]:
        raise ValueError("the two sides of a paired comparison scored different questions, or in another order")
    rng = random.Random(seed)
    n = len(before)
    differences = [int(a) - int(b) for (_, a), (_, b) in zip(after, before)]
    means = sorted(sum(differences[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    return {
        "difference": sum(differences) / n,
        "interval_95": [means[int(0.025 * samples)], means[int(0.975 * samples) - 1]],
        "questions_gained": differences.count(1),
        "questions_lost": differences.count(-1),
    }


def accuracy_interval(rights: list[bool], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> list[float]:
    """The 95% interval of an accuracy over these questions (bootstrap: the questions resampled with replacement)."""
    import random

    rng = random.Random(seed)
    n = len(rights)
    means = sorted(sum(rights[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    return [means[int(0.025 * samples)], means[int(0.975 * samples) - 1]]


def execution_pairs(records: list[dict]) -> list[tuple[tuple[str, str], bool]]:
    """A scoring's records as paired_bootstrap takes them: ((table, question), whether its SQL gave the gold result)."""
    return [((r["table_id"], r["question"]), bool(r["execution_match"])) for r in records]


def format_components(components: dict) -> str:
    """The parts of the query right (textsql.wikisql.sql.COMPONENTS), in one line."""
    return "parts right: " + ", ".join(f"{name.replace('_', ' ')} {share:.1%}" for name, share in components.items())


def format_metrics(metrics: dict) -> str:
    decoding = metrics.get("decoding", {})
    changed = ""
    if execution_guided(decoding.get("method", "greedy")):
        changed = f"; execution-guided changed {decoding['changed']} from the top beam"
    if decoding.get("unconstrained_questions"):
        changed += f"; {decoding['unconstrained_questions']} without a table decoded unconstrained"
    lines = [
        f"{metrics['examples']} examples ({metrics.get('split', '')}, {decoding.get('label', 'greedy')}): "
        f"execution {metrics['execution_accuracy']:.1%}, logical form {metrics['logical_form_accuracy']:.1%}, "
        f"exact match {metrics['exact_match']:.1%} ({metrics['parse_errors']} unparseable{changed}; "
        f"{metrics.get('queries_per_second', 0):.1f} questions/s)"
    ]
    if "against_greedy" in decoding:
        lines.append(format_against_greedy(decoding))
    if metrics.get("components"):
        lines.append(format_components(metrics["components"]))
    return "\n".join(lines)


def format_against_greedy(decoding: dict) -> str:
    """The decoding's answers against greedy's, and the beams' own gain told apart from the execution filter's."""
    against = decoding["against_greedy"]
    line = (
        f"against greedy ({decoding['greedy_execution_accuracy']:.1%}): {against['fixed']} fixed, "
        f"{against['broken']} broken, net {against['net']:+d}"
    )
    if execution_guided(decoding["method"]):
        top, choice = decoding["top_candidate_against_greedy"], decoding["choice_against_top_candidate"]
        line += f" (top beam vs greedy {top['net']:+d}, execution filter vs top beam {choice['net']:+d})"
    return line
