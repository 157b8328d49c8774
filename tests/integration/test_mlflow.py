"""MLflow tracking against a real tracking server (SQLite backend, 127.0.0.1): a T5 training scored during training
with its model logged and registered, a LoRA run tracked because a tracking URI is set, a two-rank ZeRO-2 run (one
MLflow run), a tune (its candidates nested), all read back with MLflow's client, `textsql report` from the
experiment, and the run page of MLflow's UI in headless Chromium. Without a URI or --report_to mlflow, nothing imports
mlflow; with --report_to mlflow and no server, the store is a SQLite file under the runs root."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import child_cpu_env, headless_chromium, main_in_process, tiny_train_argv, torch_threads

SECRET = "sk-fake-secret-4f7a1c"  # given as --hub_token and in the environment: must reach MLflow nowhere
EXPERIMENT = "textsql-tiny-t5"  # the default rule: textsql-<model folder name>


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """`mlflow server` on a free port of 127.0.0.1 with a SQLite store, started (not yet waited for): (uri, process)."""
    from textsql.train.distributed import free_port

    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(folder / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        + ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "art")],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its workers in one process group, stopped together
        cwd=folder,
        # MLflow 3's job runner (huey consumers, some 40 worker threads) serves GenAI jobs textsql never submits.
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
    )
    yield f"http://127.0.0.1:{port}", process, folder / "server.log"
    os.killpg(process.pid, signal.SIGKILL)  # its graceful stop takes tens of seconds; nothing of it is kept
    process.wait()
    log.close()


def wait_for(uri: str, process, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"mlflow server did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tracked(server_process, assets, tmp_path_factory):
    """Four tracked jobs against the server: the two-rank run and the tune in child processes while the T5 and the
    LoRA run train in this process. (uri, runs_root, tune_dir)."""
    uri, process, log = server_process
    work = tmp_path_factory.mktemp("tracked")
    runs, tune_dir = work / "runs", work / "tune"
    env = dict(child_cpu_env(), MLFLOW_TRACKING_URI=uri, TEXTSQL_FAKE_API_TOKEN=SECRET, TENSORBOARD_LOGGING_DIR="")
    common = dict(per_device_eval_batch_size=32, dataloader_num_workers=0, save_strategy="no")
    wait_for(uri, process, log)
    two_ranks = tiny_train_argv(
        assets, runs, max_steps=4, per_device_train_batch_size=8, deepspeed="zero2", num_gpus=2, eval_strategy="no"
    )
    data_dir, model_dir = assets
    tune = ["tune", "--model_id", str(model_dir), "--dataset_dir", str(data_dir), "--tune_dir", str(tune_dir)]
    tune += ["--global_batch_size", "16", "--micro_batches", "16", "--strategies", "none", "--warmup_steps", "1"]
    tune += ["--timed_steps", "1", "--repeat_top", "0", "--repeats", "1", "--", "--runs_root", str(runs)]
    tune += ["--max_steps", "2", "--dataloader_num_workers", "0", "--eval_strategy", "no", "--save_strategy", "no"]
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "textsql", *command],
            env=env,
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in (["train", *two_ranks], tune)
    ]
    in_process = dict(env, OMP_NUM_THREADS=str(torch_threads()))
    scored = tiny_train_argv(
        assets,
        runs,
        "--hub_token",
        SECRET,
        max_steps=6,
        per_device_train_batch_size=16,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=6,
        max_eval_samples=32,
        execution_accuracy_samples=8,
        report_to="mlflow",
        mlflow_log_model="True",
        **common,
    )
    assert main_in_process(["train", *scored], in_process) == 0
    # Tracked because MLFLOW_TRACKING_URI is set (as in a CML session), --report_to left alone.
    lora = tiny_train_argv(
        assets, runs, max_steps=4, per_device_train_batch_size=8, lora="True", lora_rank=4, eval_strategy="no"
    )
    lora += ["--mlflow_log_model", "True", "--dataloader_num_workers", "0", "--save_strategy", "no"]
    assert main_in_process(["train", *lora], in_process) == 0
    for child in children:
        output, _ = child.communicate(timeout=900)
        assert child.returncode == 0, output[-5000:]
    return uri, runs, tune_dir


def runs_by_name(uri: str) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, [e.name for e in client.search_experiments()]
    found = client.search_runs([experiment.experiment_id], max_results=100)
    return {run.info.run_name: run for run in found}


def no_secret(client, run) -> None:
    texts = [*run.data.params.items(), *run.data.tags.items()]
    assert not any(SECRET in f"{name}={value}" for name, value in texts)
    assert "hub_token" not in run.data.params and not any("FAKE_API" in name for name, _ in texts)


@pytest.mark.slow
def test_a_training_logs_its_arguments_curves_scores_memory_summary_and_model(tracked):
    from mlflow import MlflowClient

    uri, runs, _ = tracked
    client = MlflowClient(uri)
    run = runs_by_name(uri)["tiny-t5-none-ws1-bs16-steps6"]
    assert run.info.status == "FINISHED"
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
    assert (
        params["max_steps"] == "6"
        and params["strategy.label"] == "none"
        and params["execution_accuracy_samples"] == "8"
    )
    assert tags["textsql.family"] == "t5" and tags["textsql.strategy"] == "none" and tags["textsql.pods"] == "1"
    assert tags["textsql.lora"] == "none" and tags["textsql.kind"] == "train"
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert len(loss) >= 3 and [m.step for m in loss] == sorted(m.step for m in loss)  # the curve, by step
    for name in ("eval_execution_accuracy", "eval_logical_form_accuracy", "eval_exact_match", "eval_sql_select_column"):
        assert 0 <= metrics[name] <= 1, name
    assert metrics["final_execution_accuracy"] == metrics["eval_execution_accuracy"]
    assert metrics["memory_peak_cpu_rss_gib"] > 0 and metrics["train_samples_per_second"] > 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"run_summary.json", "model"} <= artifacts
    model = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= model and "train.log" not in model
    summary = client.download_artifacts(run.info.run_id, "run_summary.json")
    assert '"global_step": 6' in Path(summary).read_text()
    no_secret(client, run)
    # Registered from the logged folder (docs/training.md): a model version whose source is the run's artifact.
    client.create_registered_model("tiny-t5-sql")
    version = client.create_model_version("tiny-t5-sql", f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    assert version.version == "1" and client.get_model_version("tiny-t5-sql", "1").run_id == run.info.run_id


@pytest.mark.slow
def test_a_lora_run_is_tracked_by_the_configured_uri_and_logs_its_adapter(tracked):
    from mlflow import MlflowClient

    uri, _, _ = tracked
    client = MlflowClient(uri)
    run = runs_by_name(uri)["tiny-t5-none-lora-r4-ws1-bs8-steps4"]
    assert run.info.status == "FINISHED" and run.data.tags["textsql.lora"] == "r4"
    assert run.data.params["lora"] == "true" and run.data.params["strategy.lora.rank"] == "4"
    model = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "model")}
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "textsql_adapter.json",
        "tokenizer_config.json",
    } <= model
    assert len(client.get_metric_history(run.info.run_id, "loss")) >= 2
    no_secret(client, run)


@pytest.mark.slow
def test_two_ranks_make_one_mlflow_run_with_the_resolved_deepspeed_config(tracked):
    import json

    from mlflow import MlflowClient

    uri, _, _ = tracked
    client = MlflowClient(uri)
    found = [run for name, run in runs_by_name(uri).items() if "-ws2-" in name]
    assert [run.info.run_name for run in found] == ["tiny-t5-zero2-ws2-bs8-steps4"]  # one run, not one per rank
    (run,) = found
    assert run.data.tags["textsql.world_size"] == "2" and run.data.params["strategy.zero_stage"] == "2"
    config = json.loads(Path(client.download_artifacts(run.info.run_id, "ds_config.json")).read_text())
    assert config["zero_optimization"]["stage"] == 2 and config["train_micro_batch_size_per_gpu"] == 8
    no_secret(client, run)


@pytest.mark.slow
def test_a_tune_nests_each_candidate_under_its_run(tracked):
    from mlflow import MlflowClient

    uri, _, tune_dir = tracked
    client = MlflowClient(uri)
    runs = runs_by_name(uri)
    parent = runs[f"tune-{tune_dir.name}"]
    assert parent.info.status == "FINISHED" and parent.data.tags["textsql.kind"] == "tune"
    children = {name for name, run in runs.items() if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    # one candidate, the default, measured once; then its recipe trained as textsql train reads it (tune's --confirm)
    assert children == {"none-mb16-acc1-r0", "recipe-none-mb16-acc1-r0"}
    assert parent.data.tags["textsql.winner"] in {name.removesuffix("-r0") for name in children}
    assert {"tune_table.md", "tune_recipe.yaml"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert parent.data.params["global_batch_size"] == "16"


@pytest.mark.slow
def test_report_reads_the_runs_from_mlflow(tracked, tmp_path, textsql_in_process, monkeypatch):
    uri, _, _ = tracked
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    status, out, err = textsql_in_process(
        ["report", "--mlflow_experiment", EXPERIMENT, "--output_dir", str(tmp_path), "--no_plots"]
    )
    assert status == 0, err
    for name in ("tiny-t5-none-ws1-bs16-steps6", "tiny-t5-zero2-ws2-bs8-steps4", "none-mb16-acc1-r0"):
        assert name in out
    assert (tmp_path / "report.csv").is_file()


@pytest.mark.slow
def test_the_run_page_renders_in_headless_chromium(tracked, tmp_path):
    from matplotlib.image import imread

    uri, _, _ = tracked
    run = runs_by_name(uri)["tiny-t5-none-ws1-bs16-steps6"]
    page = f"{uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    dom = headless_chromium("--virtual-time-budget=20000", "--dump-dom", page, user_data_dir=tmp_path / "dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert "tiny-t5-none-ws1-bs16-steps6" in dom.stdout and "learning_rate" in dom.stdout
    screenshot = tmp_path / "run.png"
    shot = headless_chromium(
        "--virtual-time-budget=20000", f"--screenshot={screenshot}", page, user_data_dir=tmp_path / "shot"
    )
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-3000:]
    pixels = imread(screenshot)
    assert pixels.shape[:2] == (900, 1400) and pixels[..., :3].var() > 0.005, "the screenshot is blank"


def test_untracked_runs_never_import_mlflow_and_the_offline_store_is_under_the_runs_root(assets, tmp_path):
    """No URI and no --report_to mlflow: parsing, the tracking decision and the Trainer's callbacks leave mlflow
    unimported. --report_to mlflow without a server: a SQLite store and artifacts beside it, under the runs root."""
    code = (
        "import sys\n"
        "from textsql.arguments.training import parse_arguments\n"
        "from textsql.tracking import for_training, tracking_uri, local_artifacts\n"
        f"m, d, t = parse_arguments(['--model_id', {str(assets[1])!r}, '--runs_root', {str(tmp_path)!r}])\n"
        "assert for_training(t, {}, m.model_id, 't5', {}, 1, 'x') is None\n"
        "assert 'mlflow' not in sys.modules, 'mlflow imported'\n"
        f"m, d, t = parse_arguments(['--report_to', 'mlflow', '--runs_root', {str(tmp_path)!r}])\n"
        "uri = tracking_uri(t.runs_root)\n"
        "print(uri, local_artifacts(uri, t.runs_root))\n"
        "assert 'mlflow' not in sys.modules, 'mlflow imported'\n"
    )
    env = {k: v for k, v in child_cpu_env().items() if not k.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [f"sqlite:///{tmp_path}/mlflow.db", (tmp_path / "mlartifacts").as_uri()]
