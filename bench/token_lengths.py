"""Token lengths of real WikiSQL with a real tokenizer, and what the walkthrough's fixed 96-token padding wastes on them.

    python bench/token_lengths.py --source ../shared/real/wikisql --tokenizer ../shared/real/t5/spiece.model
    python bench/token_lengths.py --source data/wikisql-release --tokenizer t5-small --output lengths.json

The release files are prepared by `textsql prep` (bench.common.prepared_release) twice: with question sources (the
walkthrough's format) and with question+header sources. It prints one JSON object: per split and over all, the token
length distribution (percentiles and mean, </s> included) of the question source, the question+header source and the
SQL target; and the padding each way of batching computes:
- the walkthrough's: every source and target padded (and cut) to 96 tokens: the share of the computed tokens that is
  padding, and how many sources / targets 96 tokens cut;
- textsql's: padding to the longest example of each batch (random batches of --batch_size; length-grouped batches,
  textsql's default, pad less still).
Nothing is trained; it takes seconds.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine, prepared_release  # noqa: E402  (the repository root is on sys.path now)
from textsql.prep import PERCENTILES  # noqa: E402
from textsql.prepared import load_prepared  # noqa: E402

WALKTHROUGH_LENGTH = 96  # the walkthrough padded (and truncated) questions and targets to 96 tokens


def distribution(lengths: list[int]) -> dict:
    values = np.array(lengths)
    return {**{f"p{p}": int(np.percentile(values, p)) for p in PERCENTILES}, "mean": round(float(values.mean()), 1)}


def fixed_padding(sources: list[int], targets: list[int], length: int) -> dict:
    """Every source and target padded (and cut) to `length`: the share of computed tokens that is padding, and the cuts."""
    computed = len(sources) * 2 * length
    kept = sum(min(n, length) for n in sources) + sum(min(n, length) for n in targets)
    return {
        "padded_length": length,
        "padding_share": round(1 - kept / computed, 3),
        "tokens_computed_per_real_token": round(computed / (sum(sources) + sum(targets)), 2),
        "sources_cut": sum(n > length for n in sources),
        "targets_cut": sum(n > length for n in targets),
    }


def batch_padding(sources: list[int], targets: list[int], batch_size: int, seed: int) -> dict:
    """Random batches, each padded to its longest source and target (nothing cut)."""
    order = list(range(len(sources)))
    random.Random(seed).shuffle(order)
    computed = 0
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        computed += len(batch) * (max(sources[i] for i in batch) + max(targets[i] for i in batch))
    real = sum(sources) + sum(targets)
    return {
        "batch_size": batch_size,
        "padding_share": round(1 - real / computed, 3),
        "tokens_computed_per_real_token": round(computed / real, 2),
    }


def measure(args) -> dict:
    formats = {
        name: load_prepared(prepared_release(args.source, args.tokenizer, args.workdir, name))
        for name in ("question", "question+header")
    }
    (question_data, metadata), (header_data, _) = formats["question"], formats["question+header"]
    report = {}
    for name, names in [(split, [split]) for split in question_data] + [("all", list(question_data))]:
        question = [len(ids) for s in names for ids in question_data[s]["input_ids"]]
        header = [len(ids) for s in names for ids in header_data[s]["input_ids"]]
        sql = [len(ids) for s in names for ids in question_data[s]["labels"]]
        report[name] = {
            "examples": len(sql),
            "tokens": {
                "question": distribution(question),
                "question+header": distribution(header),
                "sql": distribution(sql),
            },
            "walkthrough_padding": {
                "question": fixed_padding(question, sql, WALKTHROUGH_LENGTH),
                "question+header": fixed_padding(header, sql, WALKTHROUGH_LENGTH),
            },
            "batch_padding": {
                "question": batch_padding(question, sql, args.batch_size, args.seed),
                "question+header": batch_padding(header, sql, args.batch_size, args.seed),
            },
        }
    return {
        "benchmark": "token_lengths",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "source": args.source,
        "tokenizer": args.tokenizer,
        "source_prefix": metadata["source_prefix"],
        "added_characters": len(metadata["added_characters"]),
        "targets_lost_in_tokenization": metadata["targets_lost_in_tokenization"],
        "splits": report,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", required=True, help="WikiSQL release files: a folder or .tar.bz2.")
    parser.add_argument(
        "--tokenizer",
        default="t5-small",
        help="A hub name, a model folder, or T5's spiece.model or tokenizer.json file.",
    )
    parser.add_argument(
        "--batch_size", type=int, default=32, help="Batch size for the batch-wise padding (the walkthrough's 32)."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir", default=str(Path(tempfile.gettempdir()) / "textsql-bench"), help="Where the prepared data is kept."
    )
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    emit(measure(args), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
