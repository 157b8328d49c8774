"""The notebooks execute headlessly (papermill) with tiny parameters and call the same package functions as the CLI."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute(name: str, tmp_path: Path, parameters: dict) -> dict:
    import nbformat
    import papermill

    output = tmp_path / f"executed-{name}"
    papermill.execute_notebook(
        str(NOTEBOOKS / name),
        str(output),
        parameters=parameters,
        cwd=str(tmp_path),
        kernel_name="python3",
        progress_bar=False,
    )
    return nbformat.read(output, as_version=4)


def demo_model_in_project(project: Path, name: str, model_dir: Path) -> None:
    """`project`/textsql-demo/`name` as `textsql demo` leaves it: a notebook's default model, which works offline."""
    (project / "textsql-demo").mkdir(exist_ok=True)
    (project / "textsql-demo" / name).symlink_to(model_dir)


def without_the_real_model(tmp_path: Path, monkeypatch) -> None:
    """A user cache without the imported real model (a notebook's first choice, textsql.notebook.real_model), sharing
    the suite's built GPTQ environment and compiled ops: the notebook falls back to the demo's tiny model (prep_dataset,
    which would import the real model, also needs an index that cannot be reached: UNREACHABLE_INDEX)."""
    from textsql.paths import user_cache_dir

    shared, cache = user_cache_dir(), tmp_path / "user-cache"
    (cache / "textsql").mkdir(parents=True)
    for name in ("gptq", "torch-extensions"):
        (shared / name).mkdir(parents=True, exist_ok=True)
        (cache / "textsql" / name).symlink_to(shared / name, target_is_directory=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))


def outputs_text(notebook) -> str:
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", "") + json.dumps(output.get("data", {})))
    return "\n".join(texts)


def test_notebooks_have_a_parameters_cell_and_a_kernelspec():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        assert notebook.metadata["kernelspec"]["language"] == "python", path.name
        tagged = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name} needs exactly one parameters cell"
        assert all(len(c.source.splitlines()) <= 12 for c in notebook.cells if c.cell_type == "code"), (
            f"{path.name}: cells call the package, they stay short"
        )


@pytest.mark.slow
def test_prep_then_train_notebooks_execute(assets, raw_wikisql, tmp_path, cpu_env, monkeypatch):
    from conftest import UNREACHABLE_INDEX

    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    _, model_dir = assets
    # No model_id: a notebook's default is the imported real model, else the demo's tiny T5 when the project has one.
    demo_model_in_project(tmp_path, "tiny-t5", model_dir)
    without_the_real_model(tmp_path, monkeypatch)
    for key, value in UNREACHABLE_INDEX.items():  # as on an air-gapped cluster without the wheel: prep cannot import it
        monkeypatch.setenv(key, value)
    prep = execute(
        "prep_dataset.ipynb",
        tmp_path,
        {"source": str(raw_wikisql), "output_dir": "data/wikisql", "max_examples_per_split": 200},
    )
    assert "p50/p95/p99/max" in outputs_text(prep)
    assert "The real model cannot be had here" in outputs_text(prep)  # said, then the demo's tiny model
    prepared = json.loads((tmp_path / "data/wikisql/textsql_data.json").read_text())
    assert prepared["examples"]["train"] == 200 and prepared["source_format"] == "question+header+values"  # the best

    train = execute(
        "train_single_pod.ipynb",
        tmp_path,
        {
            "dataset_dir": "data/wikisql",
            "deepspeed": "zero2",
            "per_device_train_batch_size": 16,
            "extra_args": {"max_steps": 12, "logging_steps": 4, "eval_strategy": "no", "save_strategy": "no"},
            "execution_accuracy_samples": 8,  # constrained (the default), as infer decodes
        },
    )
    text = outputs_text(train)
    assert "--module textsql.train" in text and "strategy       zero2" in text and "peak RSS" in text
    assert text.count("strategy       zero2") == 1, "the run summary is shown once"
    for noise in ("[INFO]", "FutureWarning", "IProgress not found"):
        assert noise not in text, f"{noise!r} in the notebook's output"
    summary = json.loads((tmp_path / "runs/tiny-t5-zero2-ws1-bs16-steps12/run_summary.json").read_text())
    assert summary["global_step"] == 12 and summary["strategy"]["label"] == "zero2"
    assert summary["execution_accuracy_questions"] == 8


@pytest.mark.slow
def test_inference_notebook_executes(trained_run, tmp_path, cpu_env, monkeypatch):
    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    run_dir, data_dir = trained_run
    from textsql.prepared import load_prepared

    row = load_prepared(data_dir)[0]["test"][0]
    notebook = execute(
        "run_inference.ipynb",
        tmp_path,
        {
            "model_dir": str(run_dir),
            "dataset_dir": str(data_dir),
            "max_examples": 40,
            "questions": [row["question"]],
            "table_id": row["table_id"],
        },
    )
    text = outputs_text(notebook)
    assert "Expected Answer:" in text and "40 examples (test, constrained greedy)" in text and "by aggregation" in text
    # constrained decoding (the default) against greedy's answers: the counts, and the questions it changed
    metrics = json.loads((run_dir / "eval_metrics.json").read_text())
    against = metrics["decoding"]["against_greedy"]
    assert f"constrained greedy against greedy: {against}" in text and "greedy_sql" in text
    assert "parts right: select column" in text
    assert any(
        "image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", [])
    )  # the chart
    assert json.loads((run_dir / "eval_metrics.json").read_text())["examples"] == 40


@pytest.mark.slow
def test_finetune_lora_notebook_executes(assets, two_tiny_runs, tmp_path, cpu_env, monkeypatch):
    """LoRA -> merge -> quantize -> compare, as the notebook runs them (dynamic int8: the CPU's), on its default base:
    the model the demo fine-tuned (here a 12-step run of the tiny T5 in the demo's place), so the models disagree."""
    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    data_dir, _ = assets
    runs_root, _ = two_tiny_runs
    without_the_real_model(tmp_path, monkeypatch)
    demo_run = tmp_path / "textsql-demo" / "runs" / "tiny-t5"
    demo_run.parent.mkdir(parents=True)
    demo_run.symlink_to(runs_root / "tiny-t5-none-ws1-bs16-lr0.003-steps12-warmup2", target_is_directory=True)
    notebook = execute(
        "finetune_lora.ipynb",
        tmp_path,
        {
            "dataset_dir": str(data_dir),
            "lora_rank": 4,
            "per_device_train_batch_size": 16,
            "method": "dynamic-int8",
            "max_examples": 8,
            "extra_args": {"max_steps": 20, "eval_strategy": "no", "save_strategy": "no", "learning_rate": 3e-2},
        },
    )
    text = outputs_text(notebook)
    (adapter,) = (tmp_path / "runs").glob("tiny-t5-none-lora-r4-*-steps20")
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter.parent / f"{adapter.name}-merged" / "model.safetensors").is_file()  # merged: a plain model
    assert (adapter.parent / f"{adapter.name}-merged-dynamic-int8" / "textsql_quantization.json").is_file()
    assert "dynamic-int8" in text and "Traceback" not in text
    # The last cell: the questions where the models disagree, a table with rows (not the note that there are none).
    last = "".join(o.get("data", {}).get("text/html", "") + o.get("text", "") for o in notebook.cells[-1]["outputs"])
    assert "<td>" in last and "The models wrote the same SQL" not in last, last[-2000:]


@pytest.mark.slow
def test_finetune_causal_lm_notebook_executes(causal_demo, trained_run, tmp_path, cpu_env, monkeypatch):
    """prep -> LoRA -> merge -> quantize, then QLoRA (NF4) -> merge (scored again) -> GPTQ, and compare, with no
    model_id: on the run `textsql demo --tiny --family causal` fine-tuned (offline), in a project where the README's causal road
    already prepared its data (the notebook's default folder is another), with a T5 run compared beside it on the same
    questions; the adapter then scores above the demo's untrained model."""
    from conftest import demo_in_project

    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    demo_in_project(tmp_path, causal_demo, "causal")
    without_the_real_model(tmp_path, monkeypatch)
    (tmp_path / "data" / "wikisql-causal").mkdir(parents=True)  # what the README's causal road prepared
    (tmp_path / "data" / "wikisql-causal" / "textsql_data.json").write_text("{}")
    notebook = execute(
        "finetune_causal_lm.ipynb",
        tmp_path,
        {
            "source": str(causal_demo / "wikisql-generated"),
            "max_examples_per_split": 48,
            "lora_rank": 4,
            "per_device_train_batch_size": 16,
            "method": "dynamic-int8",
            "max_examples": 6,
            "max_new_tokens": 12,
            "t5_model": str(trained_run[0]),
            "extra_args": {"max_steps": 4, "eval_strategy": "no", "save_strategy": "no", "learning_rate": 1e-2},
        },
    )
    text = outputs_text(notebook)
    assert "layout: causal LM (qwen2)" in text and "### Question: " in text
    assert "### Columns: " in text  # prepared in the format the demo's run learned: its default, the table's values
    (adapter,) = (tmp_path / "runs").glob("tiny-qwen2-none-lora-r4-*-steps4")
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter.parent / f"{adapter.name}-merged" / "model.safetensors").is_file()
    assert (adapter.parent / f"{adapter.name}-merged-dynamic-int8" / "textsql_quantization.json").is_file()
    (qlora,) = (tmp_path / "runs").glob("tiny-qwen2-none-qlora-nf4-r4-*-steps4")
    merged = json.loads((qlora.parent / f"{qlora.name}-merged" / "textsql_merge.json").read_text())
    assert merged["quantize_base"] == "nf4" and "merged model" in text and "execution accuracy" in text
    assert (qlora.parent / f"{qlora.name}-merged-gptq-4bit" / "textsql_quantization.json").is_file()
    for row in ("base ", "lora ", "merged ", "dynamic-int8 ", "qlora ", "qlora-merged ", "gptq-4bit ", "t5 "):
        assert f"\n{row}" in text, f"{row!r} is not a row of the comparison"
    assert "qwen2" in text and "Traceback" not in text
    from textsql.arguments.compare import CompareArguments
    from textsql.serve.compare import Comparison

    untrained = f"untrained={tmp_path / 'textsql-demo' / 'tiny-qwen2'}"
    compared = Comparison(CompareArguments([untrained, f"lora={adapter}"], str(tmp_path / "data" / "notebook-causal")))
    parts = [sum(m["components"].values()) for m in compared.compare_split(24)["models"]]
    assert parts[1] > parts[0], parts
