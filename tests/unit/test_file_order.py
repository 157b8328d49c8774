"""The suite's file order (tests/conftest.py): the longest measured files first, the others after them in collection
order, and each file's seconds merged into tests/durations.json after a run."""

import json
import os

import pytest
from conftest import FileSeconds, longest_files_first

pytest_plugins = ["pytester"]


def make_test_files(pytester):
    pytester.makepyfile(
        test_a="def test_a1(): pass\ndef test_a2(): pass\n",
        test_b="def test_b(): pass\n",
        test_c="def test_c(): pass\n",
        test_d="def test_d(): pass\n",
    )


def test_the_longest_measured_file_comes_first_and_files_not_measured_after(pytester):
    make_test_files(pytester)
    items, _ = pytester.inline_genitems()
    collected, unordered = [item.nodeid for item in items], list(items)
    assert collected == [
        "test_a.py::test_a1",
        "test_a.py::test_a2",
        "test_b.py::test_b",
        "test_c.py::test_c",
        "test_d.py::test_d",
    ]

    longest_files_first(items, {"test_c.py": 30.0, "test_b.py": 5.5, "test_gone.py": 99.0})
    assert [item.nodeid for item in items] == [
        "test_c.py::test_c",
        "test_b.py::test_b",
        "test_a.py::test_a1",
        "test_a.py::test_a2",
        "test_d.py::test_d",
    ]
    longest_files_first(unordered, {})  # no durations file: collection order
    assert [item.nodeid for item in unordered] == collected


@pytest.mark.parametrize("workers", [0, 2], ids=["one process", "two pytest-xdist workers"])
def test_a_run_s_seconds_are_merged_into_the_file(pytester, workers):
    """The files the run measured get its figures (from the workers' reports, under pytest-xdist); a file it did not
    run keeps its own; a file gone is dropped."""
    make_test_files(pytester)
    durations = pytester.path / "durations.json"
    kept = {"test_a.py": 500.0, "test_d.py": 7.0, "test_gone.py": 9.0}
    durations.write_text(json.dumps({"run": "an earlier run", "seconds": kept}))
    pytester.makepyfile(test_b="import time\ndef test_b(): time.sleep(0.2)\n")

    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers else []
    result = pytester.inline_run("test_a.py", "test_b.py", *xdist, plugins=[FileSeconds(durations, pytester.path)])
    result.assertoutcome(passed=3)
    written = json.loads(durations.read_text())
    assert list(written["seconds"]) == ["test_d.py", "test_b.py", "test_a.py"]  # longest first
    assert written["seconds"]["test_d.py"] == 7.0 and 0.2 <= written["seconds"]["test_b.py"] < 7.0
    assert written["seconds"]["test_a.py"] < 0.2 and written["run"].endswith(
        f"3 tests, {f'{workers} pytest-xdist workers' if workers else 'one process'} on {os.cpu_count()} cores"
    )
