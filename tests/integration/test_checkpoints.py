"""A planted checkpoint runs no code: a real tiny ZeRO-2 checkpoint verifies; the same re-saved with one extra pickled
object (whose unpickling would write a marker file) is refused by the check, by a resume and by infer, naming the file,
and the marker is never written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_cpu_env, tiny_train_argv

from textsql.arguments.merge import MergeArguments
from textsql.checkpoints import verify_checkpoint
from textsql.errors import TextsqlError

RUN = "tiny-t5-zero2-ws1-bs8-steps1"  # the settings that differ from the defaults end the name


class Planted:
    """What a collaborator adds to a checkpoint: unpickling it (torch.load(weights_only=False), as DeepSpeed loads its
    model states) writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def zero_run(assets, tmp_path_factory):
    """A real run folder of a tiny ZeRO-2 training that saved checkpoint-1 (trained once for this module)."""
    root = tmp_path_factory.mktemp("zero-run")
    argv = tiny_train_argv(
        assets,
        str(root / "runs"),
        max_steps=1,
        per_device_train_batch_size=8,
        save_strategy="steps",
        save_steps=1,
        eval_strategy="no",
        dataloader_num_workers=0,
        report_to="none",
        deepspeed="zero2",
    )
    done = subprocess.run(
        [sys.executable, "-m", "textsql.train", *argv],
        capture_output=True,
        text=True,
        env=child_cpu_env(),
        cwd=root,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return root / "runs" / RUN, argv


def plant(path: Path, marker: Path) -> None:
    """Re-save a torch file with one extra object in it, as a collaborator with write access to the folder could."""
    import torch

    content = torch.load(path, weights_only=False)  # our own fresh file
    content["planted"] = Planted(marker)
    torch.save(content, path)


def interrupted_copy(run: Path, where: Path) -> Path:
    """The run folder as a training killed after its checkpoint leaves it (no run summary): the next run resumes."""
    copy = shutil.copytree(run, where / "runs" / RUN)
    (copy / "run_summary.json").unlink()
    return copy


def test_a_real_zero_checkpoint_verifies_and_a_planted_object_is_refused_before_it_runs(zero_run, tmp_path):
    import torch

    run, _ = zero_run
    checked = {p.relative_to(run / "checkpoint-1").as_posix() for p in verify_checkpoint(run / "checkpoint-1")}
    assert checked == {
        "global_step1/mp_rank_00_model_states.pt",
        "global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "rng_state.pth",
        "scheduler.pt",
        "training_args.bin",
    }

    copy = interrupted_copy(run, tmp_path)
    states = copy / "checkpoint-1" / "global_step1" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "marker"
    plant(states, marker)
    live = tmp_path / "live.pt"
    shutil.copy(states, live)
    torch.load(live, weights_only=False)  # the planted file is live: DeepSpeed's own load runs it
    assert marker.read_text() == "ran"
    marker.unlink()

    with pytest.raises(TextsqlError) as refused:
        verify_checkpoint(copy / "checkpoint-1")
    message = str(refused.value)
    assert str(states) in message and "Unsupported global: GLOBAL exec)" in message and "Move" in message
    assert not marker.exists()

    # A renamed pickle is found by its content; a DeepSpeed tag pointing out of the checkpoint, and a linked folder, are refused.
    plain = interrupted_copy(run, tmp_path / "b") / "checkpoint-1"
    (plain / "extra").write_bytes(live.read_bytes())
    with pytest.raises(TextsqlError, match=r"extra is refused"):
        verify_checkpoint(plain)
    (plain / "extra").unlink()
    (plain / "latest").write_text("../../elsewhere")
    with pytest.raises(TextsqlError, match=r"latest is refused: DeepSpeed's tag names '../../elsewhere'"):
        verify_checkpoint(plain)
    (plain / "latest").write_text("global_step1")
    shutil.move(plain / "global_step1", tmp_path / "outside")
    (plain / "global_step1").symlink_to(tmp_path / "outside")
    with pytest.raises(TextsqlError, match=r"global_step1 is refused: it is a symbolic link"):
        verify_checkpoint(plain)
    assert not marker.exists()


def test_resume_and_infer_refuse_a_planted_checkpoint_and_nothing_in_it_runs(
    zero_run, assets, tmp_path, textsql_in_process, monkeypatch
):
    import torch

    run, argv = zero_run
    copy = interrupted_copy(run, tmp_path)
    marker = tmp_path / "marker"
    plant(copy / "checkpoint-1" / "global_step1" / "mp_rank_00_model_states.pt", marker)
    monkeypatch.chdir(tmp_path)
    runs_root = argv.index("--runs_root") + 1
    code, _, err = textsql_in_process(["train", *argv[:runs_root], str(tmp_path / "runs"), *argv[runs_root + 1 :]])
    assert code == 2 and "mp_rank_00_model_states.pt is refused" in err and "Traceback" not in err, err[-3000:]
    assert not marker.exists()

    # infer on a model folder whose weights are a pickle (pytorch_model.bin) with an object planted in it
    _, model_dir = assets
    model = shutil.copytree(model_dir, tmp_path / "model")
    from safetensors.torch import load_file

    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save(dict(weights, planted=Planted(marker)), model / "pytorch_model.bin")
    data_dir, _ = assets
    code, _, err = textsql_in_process(
        ["infer", "--model_dir", str(model), "--dataset_dir", str(data_dir), "--max_examples", "2", "--device", "cpu"]
    )
    assert code == 2 and "pytorch_model.bin is refused" in err and "GLOBAL exec" in err, err[-3000:]
    assert not marker.exists()


def test_checkpoint_files_cut_short_are_recognised(tmp_path):
    import torch
    from safetensors.torch import save_file

    from textsql.checkpoints import list_checkpoints

    folder = tmp_path / "run" / "checkpoint-4"
    (folder / "global_step4").mkdir(parents=True)
    torch.save({"w": torch.zeros(1000)}, folder / "optimizer.pt")
    torch.save({"w": torch.zeros(1000)}, folder / "global_step4" / "mp_rank_00_model_states.pt")
    save_file({"w": torch.zeros(1000)}, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text('{"global_step": 4}')
    (folder / "zero_to_fp32.py").write_text("# a script, not state")
    whole = list_checkpoints(tmp_path / "run")["checkpoint-4"]
    assert whole == {
        "optimizer.pt": True,
        "global_step4/mp_rank_00_model_states.pt": True,
        "model.safetensors": True,
        "trainer_state.json": True,
    }
    for name in ("optimizer.pt", "global_step4/mp_rank_00_model_states.pt", "model.safetensors", "trainer_state.json"):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    assert not any(list_checkpoints(tmp_path / "run")["checkpoint-4"].values())
    (tmp_path / "run" / "incomplete-checkpoint-8-L1").mkdir()
    assert list(list_checkpoints(tmp_path / "run")) == ["checkpoint-4"]


def test_a_run_resumes_from_the_newest_checkpoint_its_save_finished(tmp_path):
    from textsql.checkpoints import newest_whole_checkpoint

    run = tmp_path / "run"
    assert newest_whole_checkpoint(run) == (None, {})
    for step in (10, 20, 30):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"PK")  # no zip directory: cut short
    for step in (10, 20):
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    (run / "checkpoint-10" / "optimizer.pt").unlink()
    (run / "checkpoint-30" / "rng_state.pth").write_bytes(b"")
    newest, set_aside = newest_whole_checkpoint(run)
    assert newest == run / "checkpoint-10"
    assert set_aside == {
        "checkpoint-30": [
            "trainer_state.json is missing (the save did not finish)",
            "optimizer.pt is cut short",
            "rng_state.pth is cut short",
        ],
        "checkpoint-20": ["optimizer.pt is cut short"],
    }
    (run / "checkpoint-10" / "trainer_state.json").unlink()
    assert newest_whole_checkpoint(run)[0] is None


def test_every_command_that_loads_a_model_folder_refuses_a_planted_pickle_and_nothing_in_it_runs(
    assets, lora_adapter, tmp_path
):
    """infer, compare, quantize, merge and GRPO load a model folder through one loader (quantize.load_for_inference;
    GRPO through adapters and hub beneath it): a pickle planted in the folder is refused, naming the file, by each."""
    import torch
    from safetensors.torch import load_file

    from textsql.arguments.infer import InferArguments
    from textsql.arguments.quantize import QuantizeArguments
    from textsql.arguments.training import TextsqlTrainingArguments
    from textsql.hub import load_model
    from textsql.infer import run_inference
    from textsql.merge import merge_and_score
    from textsql.prepared import load_prepared
    from textsql.quantize import quantize_model
    from textsql.serve.compare import load_models
    from textsql.train.grpo import policy_model

    data_dir, model_dir = assets
    marker = tmp_path / "marker"
    model = shutil.copytree(model_dir, tmp_path / "model")  # the weights as a pickle with an object planted in it
    torch.save(dict(load_file(model / "model.safetensors"), planted=Planted(marker)), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    adapter = shutil.copytree(lora_adapter, tmp_path / "adapter")  # an adapter's weights, the same
    torch.save(
        dict(load_file(adapter / "adapter_model.safetensors"), planted=Planted(marker)), adapter / "adapter_model.bin"
    )
    (adapter / "adapter_model.safetensors").unlink()
    grpo = TextsqlTrainingArguments(output_dir=str(tmp_path / "grpo"))

    def unused(*_):
        raise AssertionError("GRPO's model was loaded")

    commands = {
        "infer": lambda: run_inference(InferArguments(model_dir=str(model), dataset_dir=str(data_dir), device="cpu")),
        "compare": lambda: load_models([str(model)], "cpu", str(data_dir), load_prepared(str(data_dir))[1]),
        "quantize": lambda: quantize_model(
            QuantizeArguments(model_dir=str(model), dataset_dir=str(data_dir), output_dir=str(tmp_path / "q"))
        ),
        "merge": lambda: merge_and_score(MergeArguments(adapter=str(adapter), output_dir=str(tmp_path / "merged"))),
        "grpo (a LoRA run)": lambda: policy_model(str(adapter), grpo, unused, unused),
        "grpo (a whole model)": lambda: policy_model(
            str(model), grpo, lambda: load_model(str(model), dtype=torch.float32), unused
        ),
    }
    for command, load in commands.items():
        with pytest.raises(
            TextsqlError, match=r"(pytorch_model|adapter_model)\.bin is refused.*GLOBAL exec"
        ) as refused:
            load()
        assert "model folder" in str(refused.value), command
    assert not marker.exists()
