"""User errors of every `textsql` command end in exit status 2 with one paragraph on stderr and no traceback
(in-process through textsql.cli.main: cheap), and the Hugging Face hints and HF_HUB_OFFLINE are handled in one place."""

import json
import re
import shutil
import subprocess
import traceback
from pathlib import Path

import pytest

from textsql.cli import main
from textsql.hub import download_command, hub_offline

REPO = Path(__file__).resolve().parents[2]
BAD_DSCONFIG = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_sise": 1}}

# argv, and a fragment of the message the user must see.
USER_ERRORS = [
    ([], "a command is needed"),
    (["nosuch"], "unknown command 'nosuch'"),
    (["prep"], "the following arguments are required: --source"),
    (["prep", "--source", "generate", "--no_such_flag", "1"], "unrecognized argument --no_such_flag (`textsql prep"),
    (["prep", "--source", "generate", "--source_format", "bogus"], "--source_format must be one of"),
    (["infer"], "the following arguments are required: --model_dir"),
    (
        ["infer", "--model_dir", "m", "--batch_size", "0"],
        "--batch_size, --num_beams and --max_new_tokens must be at least 1",
    ),
    (["infer", "--model_dir", "m", "--dataset_dir", "no-such-data"], "is not a prepared textsql dataset"),
    (
        ["prep", "--source", "/nonexistent", "--model_id", "no-such-model"],
        "'/nonexistent' does not exist",
    ),  # the data first
    (["train", "--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be at least 1, not 0"),
    (["check-config"], "the following arguments are required: FILE"),
    (["check-config", "nope.json"], "'nope.json' is neither a JSON file nor a shipped strategy"),
    (["check-config", "bad.json"], "did you mean reduce_bucket_size?"),
    (["plan", "--nodes", "0"], "--nodes must be a whole number of at least 1"),
    (["plan", "--bogus"], "unrecognized argument --bogus"),
    (["plan", "--gpu_memry_gb", "40"], "did you mean --gpu_memory_gb?"),  # every command's typo answered early
    (["tune", "--", "--learning_rte", "1e-3"], "did you mean --learning_rate?"),  # train's flags after --
    (["plan", "--model_id", "t5-3B", "--nodes", "1"], "did you mean t5-3b?"),  # at once, not after the hub's retries
    (["plan", "--model_id", "t5-smal"], "did you mean t5-small?"),
    (["plan", "--deepspeed", "bad.json"], "did you mean reduce_bucket_size?"),
    (["report", "--runs_root", "no-runs"], "The runs root 'no-runs' does not exist"),
    (["report", "--bogus"], "unrecognized arguments: --bogus"),
    (["tensorboard", "--port", "x"], "argument --port: invalid int value: 'x'"),
    (["demo", "--source_format", "bogus"], "--source_format is one of"),
    (["demo", "--bogus"], "unrecognized argument --bogus"),
    (["demo", "--family", "causal"], "--family shapes the tiny demo, and this is the real model's: add --tiny"),
    (["demo", "--train_tables", "9", "--d_model", "32"], "--train_tables, --d_model shape the tiny demo"),
    (["demo", "--test_questions", "-1"], "--test_questions is 0"),
    (["cluster", "check-hostfile"], "usage: textsql cluster check-hostfile HOSTFILE"),
    (["cluster", "check-hostfile", "no-hostfile"], "Hostfile no-hostfile does not exist"),
    (["cluster", "launch", "--hostfile", "h"], "Hostfile h does not exist"),
    (["cluster", "bogus"], "unknown cluster command 'bogus'"),
    (["cluster", "launch", "--hostfile", "h", "--include", "a", "--exclude", "b"], "cannot both be given"),
    (["cluster", "preflight", "--include", "a"], "choose among the hosts of a hostfile: pass --hostfile"),
    (
        ["cluster", "preflight", "--hostfile", "two-hosts", "--include", "nowhere"],
        "Hostname 'nowhere' not found in hostfile",
    ),
    (["cluster", "preflight", "--hostfile", "two-hosts", "--exclude", "127.0.0.1@127.0.0.2"], "leaves no host"),
    (["cluster", "preflight", "--hostfile", "two-hosts", "--num_nodes", "3"], "asks for more hosts than the hostfile"),
]


def run(argv: list[str]) -> tuple[int | str, str]:
    """(exit status or "crashed", a traceback if it crashed) of `textsql ARGV`, in this process."""
    try:
        return main(argv), ""
    except SystemExit as exit_:  # argparse ends usage errors with sys.exit(2), --help with sys.exit(0)
        return (exit_.code or 0), ""
    except Exception:  # noqa: BLE001 - a crash is the failure this test reports
        return "crashed", traceback.format_exc()


@pytest.mark.parametrize(
    "argv,fragment", USER_ERRORS, ids=lambda value: " ".join(value) if isinstance(value, list) else None
)
def test_user_error_exits_2_with_one_paragraph(argv, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    (tmp_path / "bad.json").write_text(json.dumps(BAD_DSCONFIG))
    (tmp_path / "two-hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    status, crash = run(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert status == 2 and not crash, f"exit {status}\n{crash}{captured.err[-2000:]}"
    assert "Traceback" not in captured.out + captured.err
    assert fragment in err, err[-2000:]
    assert "\n\n" not in err, f"more than one paragraph:\n{err}"


@pytest.mark.parametrize(
    "value,offline",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("off", False),
        ("", False),
        (None, False),
    ],
)
def test_hub_offline_reads_hf_hub_offline_as_huggingface_hub_does(value, offline, monkeypatch):
    if value is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub_offline() is offline


def test_offline_hint_follows_hub_offline(monkeypatch):
    from textsql.wikisql.release import _dataset_load_message

    error = OSError("Couldn't reach 'someone/copy' on the Hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "false")  # online: no download hint, whatever the variable's spelling
    assert "HF_HUB_OFFLINE is set" not in _dataset_load_message("someone/copy", error)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "`hf download someone/copy --repo-type dataset --local-dir data/copy`" in _dataset_load_message(
        "someone/copy", error
    )


def test_download_command_is_the_current_cli():
    assert (
        download_command("t5-small", "config.json", local_dir="models/t5-small")
        == "hf download t5-small config.json --local-dir models/t5-small"
    )


def test_one_reader_of_hf_hub_offline_and_no_removed_cli_anywhere():
    # The package decides offline-or-not only in textsql.hub (bench/ and tests only pass the variable on to children).
    reads = re.compile(r"""environ(\.get)?\s*[\[(]\s*["']HF_HUB_OFFLINE""")
    readers = [p.relative_to(REPO) for p in (REPO / "textsql").rglob("*.py") if reads.search(p.read_text())]
    assert readers == [Path("textsql/hub.py")], readers
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")  # the project's files: not .venv, not build output
    files = [
        REPO / name
        for name in tracked
        if name
        and (REPO / name).is_file()
        and not (REPO / name).is_symlink()
        and Path(name).suffix in (".py", ".md", ".ipynb", ".sh", ".txt", ".toml", ".yaml", ".yml", ".json", "")
    ]
    removed = "huggingface" + "-cli"
    assert [p.relative_to(REPO) for p in files if removed in p.read_text(errors="ignore")] == []


@pytest.mark.parametrize("command", ["train", "prep"])
@pytest.mark.parametrize(
    "typo, closest",
    [
        ("tiny-qwen2-rael", "tiny-qwen2-real"),
        ("textsql-demo/tiny-qwen2-rael", "textsql-demo/tiny-qwen2-real"),
        ("./textsql-demo/tiny-qwen2", "textsql-demo/tiny-qwen2-real"),
    ],
)
def test_a_mistyped_model_folder_is_no_such_folder_with_the_closest(
    command, typo, closest, assets, tmp_path, monkeypatch, textsql_in_process
):
    data_dir, model_dir = assets
    monkeypatch.chdir(tmp_path)
    for folder in ("tiny-qwen2-real", "textsql-demo/tiny-qwen2-real", "textsql-demo/runs"):
        shutil.copytree(model_dir, tmp_path / folder)
    argv = {
        "train": ["train", "--dataset_dir", str(data_dir), "--runs_root", "runs", "--max_steps", "1"],
        "prep": ["prep", "--source", "generate", "--output_dir", "data"],
    }[command]
    status, _, err = textsql_in_process([*argv, "--model_id", typo])
    assert status == 2 and f"There is no folder '{typo}'" in err, err[-2000:]
    assert f"The closest existing: {closest}" in err and "hf download" not in err and "\n\n" not in err.strip()


def test_a_hub_id_whose_owner_is_no_folder_here_is_sent_to_the_hub(tmp_path, monkeypatch, textsql_in_process):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "textsql-demo" / "tiny-qwen2").mkdir(parents=True)
    status, _, err = textsql_in_process(["prep", "--source", "generate", "--model_id", "textsql-dem/tiny-qwen2"])
    assert status == 2 and "HF_HUB_OFFLINE is set and 'textsql-dem/tiny-qwen2' is not in the local" in err, err
    assert "`hf download textsql-dem/tiny-qwen2 --local-dir models/tiny-qwen2`" in err
    assert err.strip().endswith("If you meant a local folder, the closest existing: textsql-demo/tiny-qwen2.")
