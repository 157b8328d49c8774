"""What a new user meets first (issue 24): Ctrl-C answered with one line that says where the run resumes, bad numbers
and a missing dataset refused before anything starts (and nothing left behind), run folders that never collide."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_train_argv

from textsql.arguments.training import parse_arguments
from textsql.cli import main
from textsql.train.run import run_dir


def tiny_argv(assets, runs_root, *extra):
    return tiny_train_argv(
        assets,
        runs_root,
        *extra,
        max_steps=400,
        per_device_train_batch_size=8,
        save_strategy="steps",
        save_steps=3,
        eval_strategy="no",
        logging_steps=1,
        report_to="none",
        dataloader_num_workers=0,
    )


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 300) -> None:
    """Until `path` exists (its last two parts may hold `*`), while `process` runs."""
    deadline = time.monotonic() + seconds
    while not any(path.parent.parent.glob(f"{path.parent.name}/{path.name}")):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def test_the_interrupt_line_names_only_a_checkpoint_whose_save_finished(assets, tmp_path):
    from textsql.train.run import interrupted_message

    model, _, training = parse_arguments(tiny_argv(assets, tmp_path / "runs"))
    folder = run_dir(model, training, 1)
    (folder / "checkpoint-3").mkdir(parents=True)  # a save killed before it wrote anything
    line = interrupted_message(model, training, 1)
    assert line.startswith("interrupted before any checkpoint was complete") and "starts over" in line
    (folder / "checkpoint-3" / "trainer_state.json").write_text('{"global_step": 3}')
    (folder / "checkpoint-6").mkdir()
    assert interrupted_message(model, training, 1) == (
        f"interrupted; run the same command again to resume from {(folder / 'checkpoint-3').absolute()}."
    )


@pytest.mark.slow
def test_ctrl_c_prints_one_line_naming_the_checkpoint_to_resume_from(assets, tmp_path, cpu_env):
    argv = tiny_argv(assets, tmp_path / "runs")
    folder = tmp_path / run_dir(*[parse_arguments(argv)[i] for i in (0, 2)], 1)
    child = subprocess.Popen(
        [sys.executable, "-m", "textsql", "train", *argv],
        env=cpu_env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(folder / "checkpoint-*" / "trainer_state.json", child)  # any finished one: checkpoint-3 is short-lived
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().replace("\r", "\n").splitlines()[-1]  # after the progress bar, the last line
    assert (
        last.startswith("textsql train: interrupted; run the same command again to resume from ")
        and "checkpoint-" in last
    )


@pytest.mark.slow
def test_run_training_interrupted_like_a_notebook_stops_its_ranks_and_says_how_to_resume(assets, tmp_path, cpu_env):
    """A notebook's stop button interrupts the kernel only: run_training stops the training it started and raises one
    TrainingInterrupted (a TextsqlError) whose message names the checkpoint."""
    argv = tiny_argv(assets, tmp_path / "runs")
    folder = tmp_path / run_dir(*[parse_arguments(argv)[i] for i in (0, 2)], 1)
    code = (
        "import sys\nfrom textsql.train import run_training\nfrom textsql.arguments.training import parse_arguments\n"
        "from textsql.train.run import TrainingInterrupted\n"
        "try:\n    run_training(*parse_arguments(sys.argv[1:]), echo=lambda line: None)\n"
        "except TrainingInterrupted as error:\n    print('ONE LINE:', error)\n"
        "import psutil\nprint('CHILDREN LEFT:', len(psutil.Process().children(recursive=True)))\n"
    )
    kernel = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        env=cpu_env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # Any finished checkpoint (on a loaded machine a short-lived checkpoint-3 can be rotated out between two looks).
    wait_for(folder / "checkpoint-*" / "trainer_state.json", kernel)
    os.kill(kernel.pid, signal.SIGINT)  # the kernel alone, as Jupyter does
    out, err = kernel.communicate(timeout=120)
    assert "ONE LINE: interrupted; run the same command again to resume from" in out, out + err[-3000:]
    assert "CHILDREN LEFT: 0" in out, out


@pytest.mark.parametrize(
    "flag,value",
    [
        ("per_device_train_batch_size", "0"),
        ("gradient_accumulation_steps", "0"),
        ("max_steps", "0"),
        ("learning_rate", "0"),
    ],
)
def test_bad_numbers_are_refused_before_anything_starts(assets, tmp_path, monkeypatch, capsys, flag, value):
    monkeypatch.chdir(tmp_path)
    status = main(["train", *tiny_argv(assets, tmp_path / "runs", "--deepspeed", "zero2", f"--{flag}", value)])
    err = capsys.readouterr().err
    assert status == 2 and f"--{flag} must be" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists(), "a run that never started leaves nothing behind"


def test_a_missing_dataset_is_refused_naming_its_absolute_path_and_leaves_nothing(
    assets, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    argv = tiny_argv(assets, tmp_path / "runs", "--deepspeed", "zero2")
    argv[argv.index("--dataset_dir") + 1] = "data/nowhere"
    status = main(["train", *argv])
    err = capsys.readouterr().err
    assert status == 2 and str(tmp_path / "data" / "nowhere") in err and "textsql prep" in err
    assert not (tmp_path / "runs").exists()


def test_experiments_that_differ_in_a_setting_get_their_own_folders():
    def folder(*extra):
        model, _, training = parse_arguments(["--model_id", "t5-small", *extra])
        return run_dir(model, training, 1).name

    assert folder() == "t5-small-none-ws1-bs32"
    assert folder("--learning_rate", "1e-4") == "t5-small-none-ws1-bs32-lr0.0001"
    assert folder("--num_train_epochs", "5") == "t5-small-none-ws1-bs32-ep5"
    assert folder("--learning_rate", "1e-4", "--num_train_epochs", "5") != folder("--learning_rate", "1e-4")
    assert folder("--logging_steps", "7", "--report_to", "none") == folder(), (
        "how a run is watched is not another experiment"
    )


@pytest.mark.slow
def test_the_demo_says_what_each_step_is_how_to_shorten_it_and_what_comes_next(
    tmp_path, monkeypatch, textsql_in_process
):
    monkeypatch.chdir(tmp_path)
    status, out, err = textsql_in_process(
        [
            "demo",
            "--tiny",
            "--train_tables",
            "5",
            "--questions_per_table",
            "3",
            "--epochs",
            "1",
            "--d_model",
            "32",
            "--num_layers",
            "1",
            "--deepspeed",
            "none",
        ]
    )
    assert status == 0, out[-2000:] + err[-3000:]
    for number in range(1, 5):
        assert f"== [{number}/4] " in out and f"== [{number}/4] done in " in out, out[-3000:]
    assert "Shorter: --epochs 2 or --train_tables 100" in out and str(tmp_path / "textsql-demo") in out
    assert "timed here: " in out and "the training takes about" in out  # from its own steps, not a constant
    assert (out + err).count("the training takes about") == 1  # the demo's own line; the run adds no second timer
    assert "next:" in out and f"textsql tensorboard --runs_root {Path('textsql-demo') / 'runs'}" in out
    assert "bash scripts/bootstrap.sh lab" in out


def test_in_a_notebook_a_textsql_error_and_an_interrupt_are_one_paragraph(tmp_path):
    import nbformat
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    notebook = new_notebook(
        cells=[
            new_code_cell("from textsql.notebook import setup\n\nsetup()"),
            new_code_cell(
                "from textsql.errors import TextsqlError\n\nraise TextsqlError('the dataset is missing: run textsql prep')"
            ),
            new_code_cell("raise KeyboardInterrupt"),
        ]
    )
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    for cell, line in (
        (notebook.cells[1], "textsql: the dataset is missing: run textsql prep"),
        (notebook.cells[2], "textsql: interrupted."),
    ):
        text = "".join(output.get("text", "") + "".join(output.get("traceback", [])) for output in cell.outputs)
        assert text.strip() == line, text
    nbformat.validate(notebook)


def test_a_flag_typo_is_answered_with_the_closest_flag_before_torch_is_imported():
    code = (
        "import sys\nfrom textsql.cli import main\nstatus = main(['train', '--model_idd', 't5-small'])\n"
        "print(status, [name for name in ('torch', 'transformers.training_args', 'deepspeed') if name in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr[-2000:]
    assert "unrecognized argument --model_idd; did you mean --model_id?" in done.stderr


def test_every_flag_of_the_training_dataclasses_passes_the_quick_check():
    from dataclasses import fields

    from textsql.arguments.training import LEGACY_FLAGS, DataArguments, ModelArguments, TextsqlTrainingArguments
    from textsql.cli.flags import check_flags, train_flags

    names = {
        f.name for kind in (ModelArguments, DataArguments, TextsqlTrainingArguments) for f in fields(kind) if f.init
    }
    assert names <= train_flags(), sorted(names - train_flags())
    check_flags([f"--{name}" for name in sorted(names)] + list(LEGACY_FLAGS), train_flags(), "train")
