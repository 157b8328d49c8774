"""One project folder for the notebooks and the command: relative paths mean the project root's, whether the kernel
runs in notebooks/ or the command at the root, and a missing dataset is named by its absolute path."""

from pathlib import Path

import pytest

from textsql.arguments.infer import InferArguments
from textsql.arguments.prep import PrepArguments
from textsql.arguments.training import DataArguments, ModelArguments, TextsqlTrainingArguments
from textsql.errors import TextsqlError
from textsql.paths import PROJECT_DIR_VARIABLE, in_project, project_root
from textsql.prepared import check_prepared
from textsql.wikisql.release import SAMPLE_SOURCE


@pytest.fixture
def project(tmp_path, monkeypatch):
    for folder in ("notebooks", "dsconfig", "data/wikisql", "textsql-demo/tiny-t5"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "data/wikisql/textsql_data.json").write_text("{}")
    monkeypatch.delenv(PROJECT_DIR_VARIABLE, raising=False)
    return tmp_path


def test_a_notebook_kernel_and_the_command_see_the_same_folders(project, monkeypatch):
    monkeypatch.chdir(project)  # the command, at the root: paths stay as given
    assert project_root() == project and DataArguments().dataset_dir == "data/wikisql"
    monkeypatch.chdir(project / "notebooks")  # a notebook's kernel
    assert project_root() == project
    assert DataArguments().dataset_dir == str(project / "data/wikisql")
    assert TextsqlTrainingArguments().runs_root == str(project / "runs")
    assert PrepArguments(source="generate").output_dir == str(project / "data/wikisql")
    (project / SAMPLE_SOURCE).mkdir()  # the shipped lines' name stays the name, a folder of that name or not
    assert PrepArguments(source=SAMPLE_SOURCE).source == SAMPLE_SOURCE
    assert InferArguments(model_dir="runs/x").dataset_dir == str(project / "data/wikisql")
    check_prepared(DataArguments().dataset_dir)  # what `textsql prep` wrote at the root is found from notebooks/
    # a model: a folder of the project when there is one, else a hub name left alone
    assert ModelArguments(model_id="textsql-demo/tiny-t5").model_id == str(project / "textsql-demo/tiny-t5")
    assert ModelArguments(model_id="t5-small").model_id == "t5-small"
    assert in_project("/abs/path") == "/abs/path"


def test_the_project_can_be_named_and_outside_a_project_the_working_folder_is_the_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(PROJECT_DIR_VARIABLE, raising=False)
    assert project_root() == tmp_path and in_project("runs") == "runs"
    monkeypatch.setenv(PROJECT_DIR_VARIABLE, str(tmp_path / "elsewhere"))
    assert in_project("runs") == str(tmp_path / "elsewhere" / "runs")


def test_a_missing_dataset_names_the_absolute_path_it_tried(project, monkeypatch):
    monkeypatch.chdir(project / "notebooks")
    with pytest.raises(TextsqlError) as error:
        check_prepared(DataArguments(dataset_dir="data/other").dataset_dir)
    assert str(project / "data" / "other") in str(error.value) and "does not exist" in str(error.value)
    assert Path(project / "data" / "other").exists() is False


def test_an_unreachable_hub_is_detected_at_once_and_named(tmp_path, monkeypatch):
    """No HF_HUB_OFFLINE, no network (a closed loopback port as the hub): a hub model is reported missing in seconds,
    naming the unreachable hub and the download command: the cache alone is asked (no minute of retries)."""
    from textsql.hub import load_tokenizer
    from textsql.train.distributed import free_port

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    with pytest.raises(TextsqlError) as error:
        load_tokenizer("t5-small-not-cached")
    message = str(error.value)
    assert "cannot be reached from here" in message and "127.0.0.1" in message and "hf download" in message
