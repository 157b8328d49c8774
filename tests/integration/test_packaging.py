"""textsql installs anywhere: a built wheel (and an editable install) finds the shipped DeepSpeed configs and WikiSQL
lines as package data, and the core commands run without the optional notebooks extra, whose absence is named with
the fix."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from textsql.errors import TextsqlError

REPO = Path(__file__).resolve().parents[2]
SHIPPED_DSCONFIGS = [
    "zero1",
    "zero2",
    "zero2_offload",
    "zero3",
    "zero3_nvme",
    "zero3_offload",
]  # one per DeepSpeed strategy
# The notebooks extra's packages and the Jupyter machinery under them, hidden from the fresh venv's imports below.
NOTEBOOKS_EXTRA_MODULES = (
    "matplotlib",
    "papermill",
    "nbclient",
    "nbformat",
    "ipykernel",
    "jupyterlab",
    "jupyter_server",
    "jupyter_client",
    "jupyter_core",
    "IPython",
)
HIDE_THE_EXTRA = """import sys

class WithoutNotebooksExtra:
    '''Meta path finder: the notebooks extra's modules import as if they were not installed.'''
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, WithoutNotebooksExtra)
"""


def run(argv, cwd, env=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def ok(argv, cwd, env=None) -> str:
    result = run(argv, cwd, env)
    assert result.returncode == 0, (
        f"{' '.join(map(str, argv))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


def source_tree(destination: Path) -> Path:
    """What building textsql reads (pyproject.toml, its readme, the package with its link to dsconfig/), copied so
    that the build's own folders (build/, *.egg-info) land outside the repository."""
    destination.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, destination / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "textsql", destination / "textsql", symlinks=True, ignore=ignore)
    shutil.copytree(REPO / "dsconfig", destination / "dsconfig", ignore=ignore)
    shutil.copytree(REPO / "fsdpconfig", destination / "fsdpconfig", ignore=ignore)
    return destination


def fresh_venv(folder: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new venv without textsql that sees this environment's installed packages through a
    .pth line (the .pth files there, the editable textsql's among them, are then not processed) but not the extra's."""
    run([sys.executable, "-m", "venv", "--without-pip", folder], cwd=folder.parent).check_returncode()
    python = folder / "bin" / "python"
    site = Path(ok([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], folder).strip())
    (site / "textsql_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (site / "textsql_test_without_notebooks_extra.py").write_text(
        HIDE_THE_EXTRA.format(hidden=set(NOTEBOOKS_EXTRA_MODULES))
    )
    (site / "textsql_test_without_notebooks_extra.pth").write_text("import textsql_test_without_notebooks_extra\n")
    return python, site


def pip(*args) -> list:
    return [sys.executable, "-m", "pip", *args]


def test_checkout_has_one_dsconfig_folder_that_the_package_reads():
    from textsql.strategy.dsconfig import DSCONFIG_DIR, shipped_configs

    link = REPO / "textsql" / "shipped_dsconfig"
    assert link.is_symlink() and link.resolve() == (REPO / "dsconfig").resolve()  # a link, not a second copy
    assert DSCONFIG_DIR == (REPO / "dsconfig").resolve()
    assert set(shipped_configs()) == {p.stem for p in (REPO / "dsconfig").glob("*.json")} == set(SHIPPED_DSCONFIGS)
    from textsql.strategy.fsdpconfig import FSDPCONFIG_DIR, shipped_fsdp_configs

    link = REPO / "textsql" / "shipped_fsdpconfig"
    assert link.is_symlink() and link.resolve() == FSDPCONFIG_DIR == (REPO / "fsdpconfig").resolve()
    assert set(shipped_fsdp_configs()) == {p.stem for p in (REPO / "fsdpconfig").glob("*.json")}


def test_wheel_and_editable_installs_run_the_core_commands_anywhere_without_the_notebooks_extra(tmp_path):
    source, wheels, elsewhere = source_tree(tmp_path / "source"), tmp_path / "wheels", tmp_path / "elsewhere"
    elsewhere.mkdir()
    ok(pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", wheels, source), tmp_path)
    (wheel,) = wheels.glob("textsql-*.whl")
    python, site = fresh_venv(tmp_path / "venv")
    ok(pip("--python", python, "install", "--no-deps", "--no-index", "-q", wheel), tmp_path)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CDSW_APP_PORT")}
    env.update(HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", PYTHONNOUSERSITE="1")
    probe = (
        "import importlib, json, textsql, textsql.strategy.dsconfig as d\n"
        "from textsql.wikisql.release import SAMPLE_SOURCE, load_wikisql, verified_sample\n"
        "def importable(name):\n    try:\n        return bool(importlib.import_module(name))\n    except ImportError:\n        return False\n"
        "print(json.dumps({'package': textsql.__file__, 'dir': str(d.DSCONFIG_DIR), 'configs': sorted(d.shipped_configs()), "
        "'sample': str(verified_sample()), "
        "'sample_questions': {s: len(e) for s, e in load_wikisql(SAMPLE_SOURCE).splits.items()}, "
        "'matplotlib': importable('matplotlib')}))"
    )
    installed = json.loads(ok([python, "-c", probe], elsewhere, env))
    assert Path(installed["package"]).is_relative_to(site)  # the wheel, not the repository
    assert Path(installed["dir"]).is_relative_to(site) and installed["configs"] == SHIPPED_DSCONFIGS
    # the real WikiSQL lines, their sha256 checked, read by name from the wheel's copy (with their licence beside them)
    assert Path(installed["sample"]).is_relative_to(site) and (Path(installed["sample"]) / "LICENSE").is_file()
    assert installed["sample_questions"] == {"train": 1000, "test": 1062}
    assert installed["matplotlib"] is False  # the extra really is out of reach

    textsql = python.parent / "textsql"
    assert "check-config" in ok([textsql, "--help"], elsewhere, env)
    assert "zero2: OK (zero2, offload: none)" in ok([textsql, "check-config", "zero2"], elsewhere, env)
    assert "fsdp_full_shard: OK (FSDP2 full shard" in ok([textsql, "check-config", "fsdp_full_shard"], elsewhere, env)
    assert "recommendation:" in ok([textsql, "plan"], elsewhere, env)
    assert "--gpu_memory_gb" in ok([textsql, "plan", "--help"], elsewhere, env)
    lab = run([textsql, "lab"], elsewhere, env)
    assert lab.returncode == 2 and "pip install 'textsql[notebooks]'" in lab.stderr and "Traceback" not in lab.stderr, (
        lab.stderr
    )

    # Editable, as bootstrap.sh installs it: the package reads the checkout's dsconfig/, the folder users edit.
    ok(
        pip("--python", python, "install", "--no-deps", "--no-index", "--no-build-isolation", "-q", "-e", source),
        tmp_path,
    )
    editable = json.loads(ok([python, "-c", probe], elsewhere, env))
    assert Path(editable["package"]).is_relative_to(source) and editable["dir"] == str((source / "dsconfig").resolve())
    assert editable["configs"] == SHIPPED_DSCONFIGS


def test_plots_without_matplotlib_name_the_notebooks_extra(monkeypatch, tmp_path):
    from textsql.planner.display import plot_plan
    from textsql.report import plot_loss_curves, plot_time_and_memory

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets when it is not installed
    for plot in (
        lambda: plot_plan({}, tmp_path / "plan.png"),
        lambda: plot_time_and_memory(None, tmp_path / "t.png"),
        lambda: plot_loss_curves([], None, tmp_path / "l.png"),
    ):
        with pytest.raises(TextsqlError, match=r"needs matplotlib.*pip install 'textsql\[notebooks\]'"):
            plot()
    assert not list(tmp_path.iterdir())
