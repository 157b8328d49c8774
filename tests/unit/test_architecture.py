"""The house rules of the package, checked: the import-linter layers contract (pyproject.toml), no import cycle,
textsql imports at the top of modules, a docstring opening every module, ruff clean, and generated notebooks."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "textsql"
BIN = Path(sys.executable).parent


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's verdict on the package under `root` (its pyproject.toml holds the contract)."""
    return subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PATH": str(BIN), "PYTHONPATH": str(root)},
    )


def test_layers_contract_is_kept():
    done = lint_imports(REPO)
    assert done.returncode == 0 and "KEPT" in done.stdout, done.stdout + done.stderr


def test_layers_contract_breaks_on_an_upward_import(tmp_path):
    """The contract can fail: the same package with one library module importing the CLI is refused, naming it."""
    shutil.copytree(PACKAGE, tmp_path / "textsql", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "textsql" / "run_summary.py"
    module.write_text(module.read_text() + "\nfrom textsql.cli import main  # an upward import\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout + done.stderr
    assert "textsql.run_summary -> textsql.cli" in done.stdout, done.stdout


def modules_in_cycles(graph) -> list[list[str]]:
    """Every import cycle among the package's modules (Tarjan's strongly connected components of size > 1)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(module):
        index[module] = low[module] = counter[0]
        counter[0] += 1
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle():
    graph = grimp.build_graph("textsql", cache_dir=None)
    assert modules_in_cycles(graph) == []


def test_cycle_detection_finds_a_planted_cycle(tmp_path, monkeypatch):
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\n")
    (package / "b.py").write_text("from cyclic import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert modules_in_cycles(grimp.build_graph("cyclic", cache_dir=None)) == [["cyclic.a", "cyclic.b"]]


# Modules whose textsql imports stay inside functions, each for a reason (docs/architecture.md).
LAZY_TEXTSQL_IMPORTS = {
    "textsql/cli/__init__.py": "a command's module is imported when it runs: `textsql --help` answers without torch",
    "textsql/cluster/__init__.py": "names load on first use: what a node runs imports only what it needs",
    "textsql/cli/train.py": "the training modules (torch, transformers, DeepSpeed) load once the flags are known right",
    "textsql/cli/cluster.py": "the training arguments (torch, transformers) load for train, launch and preflight only",
}


def python_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "shipped_dsconfig" not in p.parts)


@pytest.mark.parametrize("path", python_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_module_opens_with_a_docstring(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.relative_to(REPO)} must open with a one-line docstring on its job"


def test_textsql_imports_sit_at_the_top_of_modules():
    inside = []
    for path in python_modules():
        relative = str(path.relative_to(REPO))
        if relative in LAZY_TEXTSQL_IMPORTS or relative.startswith("textsql/cluster/"):
            continue  # the cluster's node and rank programs import lazily on purpose (see docs/architecture.md)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("textsql"):
                        inside.append(f"{relative}:{inner.lineno} from {inner.module} import ...")
    assert not inside, "textsql imports belong at the top of the module:\n" + "\n".join(inside)


def test_ruff_lint_is_clean():
    done = subprocess.run(
        [str(BIN / "ruff"), "check", "--no-cache", "textsql", "tests", "bench", "scripts"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_clean():
    done = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "--no-cache", "textsql", "tests", "bench", "scripts"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_regenerating_the_notebooks_changes_nothing(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_notebooks
    finally:
        sys.path.remove(str(REPO / "scripts"))
    make_notebooks.main(tmp_path)
    generated = sorted(p.name for p in tmp_path.glob("*.ipynb"))
    assert generated == sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")), "every notebook is generated"
    for name in generated:
        assert (tmp_path / name).read_text() == (REPO / "notebooks" / name).read_text(), (
            f"notebooks/{name} differs from what scripts/make_notebooks.py writes: edit the script and run it"
        )


def test_test_files_have_unique_names():
    """pytest imports test modules by their base name (no packages under tests/): two files of one name in unit/ and
    integration/ stop the whole run at collection."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
