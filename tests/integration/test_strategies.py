"""Every strategy name textsql prints (the strategy table, `textsql plan`, tune's default candidates, the labels the
report shows for the shipped configs, the docs) trains two steps on the CPU, or is refused before launch with its
reason; a mistyped name gets the closest one."""

import json
import re
from pathlib import Path

import pytest
from conftest import tiny_train_argv

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A strategy's name, alone in a code span or in a list inside one, as its config file too (dsconfig/zero2.json).
NAME = re.compile(r"(?:dsconfig/|fsdpconfig/)?((?:zero[0-9]|fsdp)(?:_[a-z0-9]+)*|none)(?:\.json)?")
# Code spans of the docs that match NAME but name no strategy: a key of `textsql plan --json`, the Trainer's FSDP
# settings.
NOT_STRATEGIES = {"zero3_residency", "fsdp_config"}
# What cannot run on the CPU, refused before launch, with a phrase of its reason.
REFUSED_ON_THE_CPU = {
    "fsdp_shard_grad_op": "needs GPUs",
    "fsdp_hybrid_shard": "needs GPUs",
    "fsdp_full_shard": "needs GPUs",
    "fsdp_full_shard_offload": "needs GPUs",
}


def names_in_docs() -> dict[str, set[str]]:
    """Strategy names in the docs' code spans (`zero2`, `dsconfig/zero3_offload.json`, `zero1, zero2`), by file."""
    found = {}
    for path in DOCS:
        for span in re.findall(r"`([^`\n]+)`", path.read_text()):
            for token in re.split(r"[\s,()]+", span):
                match = NAME.fullmatch(token)
                if match and match.group(1) not in NOT_STRATEGIES:
                    found.setdefault(match.group(1), set()).add(path.relative_to(REPO).as_posix())
    return found


def names_in_plan(textsql_in_process) -> set[str]:
    """The rows of `textsql plan`'s table, full fine-tuning and LoRA, read from its output."""
    status, out, err = textsql_in_process(["plan", "--model_id", "t5-small", "--lora", "True"])
    assert status == 0, err
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("strategy ")) + 1
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith("("))  # the notes under the table
    rows = [line.split()[0] for line in lines[start:end] if not line.startswith("with LoRA")]
    assert rows and all(re.fullmatch(r"[a-z0-9_]+", name) for name in rows), lines[start:end]
    return set(rows)


def names_tune_tries() -> set[str]:
    """tune's default candidates on a CPU, on one GPU pod and on two."""
    from textsql.tune.space import strategy_choices

    return {name for where in (("cpu", 1), ("cuda", 1), ("cuda", 2)) for name in strategy_choices("", *where)}


def names_the_report_shows() -> set[str]:
    """The strategy labels a run of each shipped config records, which the report's technique column shows."""
    from textsql.strategy.dsconfig import describe_strategy, load_dsconfig, shipped_configs
    from textsql.strategy.fsdpconfig import describe_fsdp_strategy, load_fsdpconfig, shipped_fsdp_configs

    labels = {describe_strategy(None)["label"]}
    labels |= {describe_strategy(load_dsconfig(path))["label"] for path in shipped_configs().values()}
    labels |= {describe_fsdp_strategy(load_fsdpconfig(path))["label"] for path in shipped_fsdp_configs().values()}
    return labels


def every_strategy_name(textsql_in_process) -> dict[str, set[str]]:
    """Each name textsql prints, with where it was seen."""
    from textsql.strategy.table import STRATEGIES

    seen = {}
    sources = {
        "textsql/strategy/table.py": set(STRATEGIES),
        "textsql plan": names_in_plan(textsql_in_process),
        "tune's default candidates": names_tune_tries(),
        "the report's labels": names_the_report_shows(),
    }
    for where, names in sources.items():
        for name in names:
            seen.setdefault(name, set()).add(where)
    for name, files in names_in_docs().items():
        seen.setdefault(name, set()).update(files)
    return seen


def strategy_flags(name: str, nvme_dir: Path) -> list[str]:
    """The `textsql train` flags a strategy name is used with (what the docs tell a user)."""
    from textsql.strategy.table import NVME_STRATEGIES, is_fsdp

    if name == "none":
        return []
    if is_fsdp(name) or name.startswith("fsdp_"):
        return ["--fsdp_config", name]
    return ["--deepspeed", name] + (["--nvme_path", str(nvme_dir)] if name in NVME_STRATEGIES else [])


def two_steps(assets, runs_root, *extra) -> list[str]:
    return tiny_train_argv(
        assets,
        runs_root,
        *extra,
        max_steps=2,
        per_device_train_batch_size=8,
        max_train_samples=16,
        max_eval_samples=8,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        dataloader_num_workers=0,
    )


def test_the_collection_reads_every_source(textsql_in_process):
    """The names come from the outputs and the docs themselves: each source names the strategies it should."""
    seen = every_strategy_name(textsql_in_process)
    assert {"none", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme"} <= set(seen)
    assert set(REFUSED_ON_THE_CPU) <= set(seen)
    assert {"textsql plan", "textsql/strategy/table.py"} <= seen["zero3_nvme"]
    assert "tune's default candidates" in seen["zero3"] and "tune's default candidates" not in seen["zero3_nvme"]
    assert "README.md" in seen["zero3_offload"] and "docs/training.md" in seen["zero2_offload"]


@pytest.mark.slow
def test_every_strategy_textsql_names_trains_two_steps_or_is_refused_before_launch(
    assets, tmp_path, monkeypatch, textsql_in_process
):
    import torch.nn.functional as F
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    monkeypatch.chdir(tmp_path)
    seen = every_strategy_name(textsql_in_process)
    trained, refused = {}, {}
    linear = F.linear
    for name in sorted(seen):
        runs = tmp_path / name
        status, out, err = textsql_in_process(
            ["train", *two_steps(assets, runs, *strategy_flags(name, tmp_path / "nvme"))]
        )
        where = f"{name} (named in {', '.join(sorted(seen[name]))})"
        if name in REFUSED_ON_THE_CPU:
            assert status == 2, f"{where} should be refused on the CPU:\n{err[-2000:]}"
            assert REFUSED_ON_THE_CPU[name] in err and "Traceback" not in err, f"{where}: {err[-2000:]}"
            assert not runs.exists(), f"{where} was refused after its run folder was made"
            refused[name] = err
            continue
        assert status == 0, f"{where} does not train:\n{out[-1500:]}\n{err[-3000:]}"
        (summary_file,) = runs.glob("*/run_summary.json")
        summary = json.loads(summary_file.read_text())
        assert summary["strategy"]["label"] == name and summary["global_step"] == 2, where
        # ZeRO-3 swaps torch's F.linear and transformers keeps the DeepSpeed config for the whole process; a run in a
        # notebook's process gives both back.
        assert F.linear is linear, f"{where} left torch.nn.functional.linear replaced"
        assert not is_deepspeed_zero3_enabled(), f"{where} left its DeepSpeed config as the process's"
        trained[name] = summary
    assert set(trained) | set(refused) == set(seen)
    nvme = trained["zero3_nvme"]["strategy"]
    assert nvme["offload_optimizer"] == nvme["offload_param"] == "nvme"
    swapped = {p.name for p in (tmp_path / "nvme").rglob("*.swp")}
    assert any(name.startswith("exp_avg_sq") for name in swapped), "ZeRO-Infinity wrote no optimizer state to the disk"


def test_zero3_nvme_without_a_path_is_refused_before_launch_with_the_fix(assets, tmp_path, textsql_in_process):
    status, _, err = textsql_in_process(["train", *two_steps(assets, tmp_path / "runs", "--deepspeed", "zero3_nvme")])
    assert status == 2 and "Traceback" not in err
    assert "--nvme_path DIR" in err and "zero3_offload" in err and len(err.strip().split("\n\n")) == 1
    assert not (tmp_path / "runs").exists()
    status, _, err = textsql_in_process(
        ["train", *two_steps(assets, tmp_path / "runs", "--deepspeed", "zero2", "--nvme_path", str(tmp_path))]
    )
    assert status == 2 and "offloads nothing to NVMe" in err and not (tmp_path / "runs").exists()


def test_zero3_nvme_finds_deepspeeds_async_io_op_under_a_stderr_without_a_descriptor(capsys):
    """libaio is installed here (bootstrap's setup installs libaio-dev for the tests), so DeepSpeed's check passes, even
    where sys.stderr has no file descriptor (captured, as here, or a notebook's), which its compile test redirects."""
    import sys

    from textsql.strategy.dsconfig import async_io_problem

    with pytest.raises(OSError):
        sys.stderr.fileno()
    async_io_problem.cache_clear()
    assert async_io_problem() is None, async_io_problem()


@pytest.mark.parametrize(
    "flag,typo,closest",
    [
        ("--deepspeed", "zer02", "zero2"),
        ("--deepspeed", "zero3_ofload", "zero3_offload"),
        ("--fsdp_config", "fsdp_ful_shard", "fsdp_full_shard"),
    ],
)
def test_a_mistyped_strategy_gets_the_closest_name_and_every_name(
    assets, tmp_path, textsql_in_process, flag, typo, closest
):
    status, _, err = textsql_in_process(["train", *two_steps(assets, tmp_path / "runs", flag, typo)])
    assert status == 2 and "Traceback" not in err
    assert f"did you mean {closest}?" in err.lower()
    assert "zero3_nvme" in err and "fsdp_full_shard_offload" in err  # both kinds' names: either flag takes its own
    assert not (tmp_path / "runs").exists()


def test_an_fsdp_name_given_to_deepspeed_says_which_flag_takes_it(assets, tmp_path, textsql_in_process):
    status, _, err = textsql_in_process(
        ["train", *two_steps(assets, tmp_path / "runs", "--deepspeed", "fsdp_full_shard")]
    )
    assert status == 2 and "`--fsdp_config fsdp_full_shard`" in err


def test_plan_table_keeps_its_columns_on_the_longest_strategy_name(textsql_in_process):
    status, out, _ = textsql_in_process(["plan", "--model_id", "t5-small", "--lora", "True"])
    assert status == 0
    header = next(line for line in out.splitlines() if line.startswith("strategy "))
    rows = [line for line in out.splitlines() if re.match(r"(zero|fsdp|none)\S*\s+\d", line)]
    assert any(row.startswith("fsdp_full_shard_offload ") for row in rows)
    titles = [m.end() for m in re.finditer(r"\S+", header)]
    for row in rows:  # every number ends under its column title (the components, the step, the peak; the host GB)
        fields = [(m.end(), m.group()) for m in re.finditer(r"\S+", row)]
        numbers = [end for end, text in fields[1:] if re.fullmatch(r"[\d.]+", text)]
        assert numbers[:-1] == titles[1 : len(numbers)], f"misaligned:\n{header}\n{row}"
        assert numbers[-1] == titles[header.split().index("GB")], f"misaligned:\n{header}\n{row}"
    assert "NVMe       zero3_nvme: the GPU holds what it holds under zero3_offload" in out
    assert re.search(r"at least [\d.]+ s per step at 2 GB/s \(--nvme_gb_per_s", " ".join(out.split()))
