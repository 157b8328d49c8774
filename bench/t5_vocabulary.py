"""The real T5 tokenizer on the real WikiSQL files, per source format: which characters it lacks, which prep adds
(from every split's sources and train's answers), and how many test answers it still cannot write.

    python bench/t5_vocabulary.py --real ../shared/real --output t5_vocabulary.json

For each format the real release files (1,000 train and 1,062 test questions, shared/real/wikisql) are prepared for a
model folder holding t5-base's config and the real T5 tokenizer.json (Google's 32,000-piece vocabulary, which t5-small
shares) with textsql prep, as a user runs it. Per format it reports the characters added, the prompts holding a
character the bare vocabulary lacks, and per split the answers that do not come back from tokenize -> decode (lost:
the model cannot write them; column names recovered: only a column name's spelling changed, which scoring forgives).
No model is trained: this is what the vocabulary allows, whatever the model learns.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)

FORMATS = ("question", "question+header", "question+header+values")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", default=str(REPO.parent / "shared" / "real"), help="The shared/real folder.")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "textsql-bench-t5-vocabulary"))
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from textsql.hub import load_tokenizer
    from textsql.prep import PrepArguments, characters_lost_in_targets, prepare_dataset
    from textsql.prepared import load_prepared, load_tables
    from textsql.vocabulary import missing_characters

    real, work = Path(args.real), Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    model = work / "t5-base-tokenizer"
    model.mkdir(parents=True)
    shutil.copy(real / "t5" / "tokenizer.json", model / "tokenizer.json")
    shutil.copy(real / "t5" / "t5-base" / "config.json", model / "config.json")
    base = load_tokenizer(str(model))
    load_before, started = os.getloadavg(), time.perf_counter()
    results = []
    for source_format in FORMATS:
        folder = prepare_dataset(
            PrepArguments(
                source=str(real / "wikisql"),
                model_id=str(model),
                output_dir=str(work / source_format),
                source_format=source_format,
                validation_from_train=0,
            )
        )
        dataset, meta = load_prepared(folder)
        tables = load_tables(folder)
        extended = load_tokenizer(str(folder / meta["tokenizer_dir"])) if meta["tokenizer_dir"] else base
        sources = {name: list(split["source"]) for name, split in dataset.items()}
        bare = set(missing_characters(base, (t for texts in sources.values() for t in texts))["unknown"])
        results.append(
            {
                "source_format": source_format,
                "added_characters": meta["added_characters"],
                "characters_changed_by_normalizer": meta["characters_changed_by_normalizer"],
                "prompts_with_a_character_t5_lacks": {
                    name: sum(any(c in bare for c in text) for text in texts) for name, texts in sources.items()
                },
                "characters_t5_lacks_in_prompts": sorted(bare),
                "answers_lost": {
                    name: characters_lost_in_targets({name: split}, extended, tables) for name, split in dataset.items()
                },
                "questions": meta["examples"],
                "source_p50_tokens": meta["lengths"]["train"]["source_percentiles"]["p50"],
                "values_listed": meta["values_listed"],
            }
        )
    report = {
        "benchmark": "t5_vocabulary",
        "date": time.strftime("%Y-%m-%d"),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "data": "shared/real/wikisql: 1,000 train and 1,062 test questions (the release's own lines) and their tables",
        "tokenizer": "shared/real/t5/tokenizer.json (t5-base/t5-large; t5-small's vocabulary), t5-base's config.json",
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "results": results,
    }
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
