"""The README's quick start runs as written: each fenced `textsql` command, in order, against what the demo leaves in
textsql-demo/ (built here small), through textsql.cli.main in this process (one interpreter: cheap); then the causal
road's block after it, from `textsql demo --tiny --family causal` (run small) to a comparison where the trained models score
above the untrained one. Its first lines name both families' demos, and how to run each."""

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start_commands(block: int = 0) -> list[list[str]]:
    """The `textsql` lines of the quick start's first fenced block (T5's), or of its second (the causal road)."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the quick start has T5's block and the causal road's"
    return [shlex.split(line) for line in blocks[block].splitlines() if line.startswith("textsql ")]


def test_the_first_lines_name_both_families_and_the_command_that_shows_each():
    top = README.read_text().split("\n\n", 2)[1]  # the paragraph under the title
    assert "**T5**" in top and "**decoder-only causal LMs**" in top
    assert "`textsql demo --tiny` shows it" in top and "`textsql demo` shows a real one writing right SQL" in top
    assert "`textsql demo\n--tiny --family causal` shows it" in top


def test_quick_start_activates_the_environment_first(tmp_path):
    """In a new shell (no virtual environment on PATH), the quick start's first line makes `textsql` a command."""
    import os
    import subprocess

    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    first = block.splitlines()[0]
    assert first == "source .venv/bin/activate"
    repo = README.parent
    if not (repo / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv here: this checkout was set up another way than scripts/bootstrap.sh")
    venv_bin = str(repo / ".venv" / "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": path}
    before = subprocess.run(["bash", "-c", "command -v textsql"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert before.returncode != 0, f"textsql is on PATH without activating: {before.stdout}"
    after = subprocess.run(
        ["bash", "-c", f"cd {repo} && {first} && textsql --help"], env=env, capture_output=True, text=True
    )
    assert after.returncode == 0 and "usage: textsql" in after.stdout, after.stderr


def test_quick_start_names_every_step():
    commands = [argv[1] for argv in quick_start_commands()]
    assert commands == ["prep", "check-config", "plan", "train", "infer", "report"]
    assert [argv[1] for argv in quick_start_commands(1)] == ["demo", "prep", "train", "compare"]
    assert quick_start_commands(1)[0] == ["textsql", "demo", "--tiny", "--family", "causal"]
    assert "bash scripts/bootstrap.sh demo --tiny --family causal" in README.read_text()


@pytest.mark.slow
def test_quick_start_commands_run_as_written(tmp_path, monkeypatch, textsql_in_process, causal_demo):
    import json

    from conftest import demo_in_project

    from textsql.demo.tiny import build_assets
    from textsql.report import build_table, find_runs, load_scalars

    # what `textsql demo` leaves, small; and `textsql demo --tiny --family causal`, the causal block's first line (run small)
    build_assets(tmp_path / "textsql-demo", train_tables=20, questions_per_table=4, d_model=32, num_layers=1)
    demo_in_project(tmp_path, causal_demo, "causal")
    monkeypatch.chdir(tmp_path)
    for argv in quick_start_commands():
        status, out, err = textsql_in_process(argv[1:])
        assert status == 0, f"`{' '.join(argv)}` exited {status}:\n{out[-2000:]}\n{err[-3000:]}"
        assert "Traceback" not in out + err
    run = tmp_path / "runs" / "tiny-t5-zero2-ws1-bs16-steps20"
    assert (run / "eval_metrics.json").is_file()
    scalars = load_scalars([run / "tensorboard"], tags=("train/loss", "eval/execution_accuracy"))
    assert len(scalars["train/loss"]) >= 10, f"a 20-step run draws a loss curve, not one point: {scalars}"
    # a default run scores its SQL at the end: in its summary, TensorBoard and the report
    summary = json.loads((run / "run_summary.json").read_text())
    assert 0.0 <= summary["execution_accuracy"] <= 1.0 and summary["execution_accuracy_questions"] > 0
    assert [step for step, _ in scalars["eval/execution_accuracy"]] == [20]
    assert (tmp_path / "runs" / "report" / "report.md").is_file()
    # the causal road: prep for the demo's run, a LoRA adapter on it, and the models compared on the same questions
    for argv in quick_start_commands(1)[1:]:
        status, out, err = textsql_in_process(argv[1:])
        assert status == 0, f"`{' '.join(argv)}` exited {status}:\n{out[-2000:]}\n{err[-3000:]}"
    report = json.loads((tmp_path / "compare.json").read_text())
    assert [(m["label"], m["family"], m["kind"]) for m in report["models"]] == [
        ("untrained", "qwen2", "model"),
        ("demo", "qwen2", "model"),
        ("lora", "qwen2", "LoRA adapter"),
        ("t5", "t5", "model"),
    ]
    assert report["examples"] == 20
    parts = {m["label"]: sum(m["components"].values()) for m in report["models"]}
    assert parts["demo"] > parts["untrained"] and parts["lora"] > parts["untrained"], report["models"]
    (lora,) = (row for row in build_table(find_runs(tmp_path / "runs")).to_dict("records") if "lora" in row["run"])
    assert lora["execution_accuracy"] is not None and lora["accuracy_split"].endswith("questions, end of training)")
