"""Every CPU/GPU decision, fed the hardware facts of an A100, V100, T4, H100 or no GPU (textsql.strategy.devices, train.set_up_run)."""

import os
from pathlib import Path

import pytest

from textsql.errors import TextsqlError
from textsql.families import family_named
from textsql.strategy.devices import (
    A100_40GB,
    H100_SXM,
    T4,
    V100,
    Gpu,
    NodeDevices,
    check_nodes_agree,
    choose_accelerator,
    choose_precision,
    cpu_native_bf16,
    inference_dtype,
    launcher_device_args,
    peak_tflops,
    precision_from_trainer_flags,
    ranks_per_node,
    resolve_precision,
    threads_per_rank,
)

NO_GPU = NodeDevices((), 16)


def node(gpu: Gpu | None, count: int = 1, cores: int = 16) -> NodeDevices:
    return NodeDevices((gpu,) * count if gpu else (), cores)


@pytest.mark.parametrize(
    "gpus,expected",
    [
        ((A100_40GB,), ("bf16", True)),
        ((H100_SXM, H100_SXM), ("bf16", True)),
        ((V100,), ("fp32", False)),  # emulated bf16 would pass torch.cuda.is_bf16_supported(); not native
        ((T4,), ("fp32", False)),
        ((), ("fp32", False)),
        ((A100_40GB, V100), ("fp32", False)),  # one precision must suit every GPU
    ],
)
def test_auto_precision_is_bf16_only_with_native_bf16_and_tf32_only_on_ampere(gpus, expected):
    choice = choose_precision("auto", gpus)
    assert (choice.name, choice.tf32) == expected
    assert choice.trainer_flags() == {"bf16": expected[0] == "bf16", "fp16": False, "tf32": expected[1]}


# /proc/cpuinfo's flags lines of the two CPUs measured (bench/results/2026-12-02-cpu-precision.json), cut short.
AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2 sha_ni\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ZEN4 = "flags\t\t: fpu avx avx2 avx512f avx512_bf16 avx512_vnni\n"  # AVX512-BF16 without AMX


@pytest.mark.parametrize(
    "cpuinfo,native",
    [(AVX2_EPYC, False), (SAPPHIRE_RAPIDS, True), (ZEN4, True), ("", False), ("flags: avx512_fp16\n", False)],
)
def test_auto_on_the_cpu_is_bf16_only_where_the_cpu_flags_name_native_bf16(cpuinfo, native):
    found = cpu_native_bf16(environ={}, cpuinfo=cpuinfo)
    assert found is native
    choice = choose_precision("auto", (), cpu_native_bf16=found)
    assert (choice.name, choice.tf32) == (("bf16" if native else "fp32"), False)
    assert ("natively" if native else "no native bf16") in choice.reason
    assert inference_dtype("auto", "cpu", NodeDevices((), 2, cpu_native_bf16=found)) == (
        "bfloat16" if native else "float32"
    )
    assert inference_dtype("float32", "cpu", NodeDevices((), 2, cpu_native_bf16=True)) == "float32"
    # what a CPU has says nothing of a GPU run: its GPUs decide
    assert choose_precision("auto", (V100,), cpu_native_bf16=True).name == "fp32"
    # bf16 asked for on a CPU without it runs (autocast emulates it) and the reason says what that costs
    assert "emulated" in choose_precision("bf16", (), cpu_native_bf16=False).reason


def test_the_cpu_flags_can_be_pinned_and_the_choice_is_kept_with_the_node():
    assert cpu_native_bf16(environ={"TEXTSQL_CPU_NATIVE_BF16": "0"}, cpuinfo=SAPPHIRE_RAPIDS) is False
    assert cpu_native_bf16(environ={"TEXTSQL_CPU_NATIVE_BF16": "1"}, cpuinfo=AVX2_EPYC) is True
    with pytest.raises(TextsqlError, match="TEXTSQL_CPU_NATIVE_BF16 is 0 or 1"):
        cpu_native_bf16(environ={"TEXTSQL_CPU_NATIVE_BF16": "yes"}, cpuinfo="")
    node = NodeDevices((), 2, cpu_native_bf16=True)
    assert NodeDevices.from_dict(node.as_dict()) == node and "native bf16" in node.describe()
    assert NodeDevices.from_dict({"gpus": [], "cpu_cores": 2}).cpu_native_bf16 is False  # an older textsql's answer


def test_fp32_means_fp32_matmuls_and_explicit_choices_are_checked():
    assert choose_precision("fp32", (A100_40GB,)).tf32 is False
    with pytest.raises(TextsqlError, match="Tesla V100.*compute capability 7.0.*--precision fp32"):
        choose_precision("bf16", (V100,))
    t5, qwen2 = family_named("t5"), family_named("qwen2")
    with pytest.raises(TextsqlError, match="fp16 is refused for T5 models: T5 checkpoints.*overflow.*--force_fp16"):
        choose_precision("fp16", (V100,), family=t5)
    assert choose_precision("fp16", (V100,), family=t5, force_fp16=True).name == "fp16"
    assert choose_precision("fp16", (V100,), family=qwen2).name == "fp16"  # the family says fp16 is safe
    assert choose_precision("bf16", ()).name == "bf16"  # CPU autocast: the tests use it
    with pytest.raises(TextsqlError, match="needs a GPU"):
        choose_precision("fp16", (), family=qwen2)


def test_fp16_is_decided_by_the_model_s_family_read_from_its_config_and_only_then(tmp_path):
    """The family comes from config.json (model_type), never from the model's name: a folder named t5 holding a GPT-2
    config trains in fp16, and the config is read only where fp16 is asked for."""
    import json

    for name, model_type in (("t5-like-name", "gpt2"), ("plain", "t5")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert resolve_precision("fp16", str(tmp_path / "t5-like-name"), (V100,)).name == "fp16"
    with pytest.raises(TextsqlError, match="fp16 is refused for T5"):
        resolve_precision("fp16", str(tmp_path / "plain"), (V100,))
    assert resolve_precision("fp16", str(tmp_path / "plain"), (V100,), force_fp16=True).name == "fp16"
    assert resolve_precision("auto", str(tmp_path / "absent"), (A100_40GB,)).name == "bf16"  # nothing read


def test_trainer_flags_go_through_the_same_resolution():
    assert precision_from_trainer_flags("auto", None, True) == "fp16"
    assert precision_from_trainer_flags("auto", True, None) == "bf16"
    assert precision_from_trainer_flags("fp32", False, False) == "fp32"
    with pytest.raises(TextsqlError, match="contradicts --precision fp32"):
        precision_from_trainer_flags("fp32", True, None)
    with pytest.raises(TextsqlError, match="both given"):
        precision_from_trainer_flags("auto", True, True)


def test_device_choice_and_a_clear_error_when_gpus_were_asked_for():
    assert choose_accelerator("auto", node(A100_40GB)) == "cuda"
    assert choose_accelerator("auto", NO_GPU) == "cpu"
    assert choose_accelerator("cpu", node(A100_40GB)) == "cpu"
    with pytest.raises(TextsqlError, match="asked for \\(--accelerator cuda\\).*sees none"):
        choose_accelerator("cuda", NO_GPU)


def test_one_rank_per_gpu_never_data_parallel():
    assert ranks_per_node(None, node(A100_40GB, 4)) == 4
    assert ranks_per_node(None, NO_GPU) == 1
    assert ranks_per_node(1, node(A100_40GB, 4)) == 1
    assert ranks_per_node(2, NO_GPU) == 2  # CPU ranks for tests
    with pytest.raises(TextsqlError, match="has 2 GPU"):
        ranks_per_node(3, node(A100_40GB, 2))


def test_each_rank_gets_its_share_of_the_cores():
    assert threads_per_rank(node(A100_40GB, 4, cores=32), 4) == 8  # ZeRO offload's CPU Adam is OpenMP-parallel
    assert threads_per_rank(node(A100_40GB, 1, cores=8), 1) == 8
    assert threads_per_rank(NodeDevices((), 2), 2) == 1
    assert threads_per_rank(NodeDevices((), 2), 3) == 1


def test_a_users_cuda_visible_devices_is_respected_by_the_launcher():
    four = node(A100_40GB, 4)
    assert launcher_device_args(4, four, None) == ["--num_gpus", "4"]
    assert launcher_device_args(2, node(A100_40GB, 2), "2,5") == [
        "--include",
        "localhost:2,5",
    ]  # not --num_gpus: it would delete it
    assert launcher_device_args(1, node(A100_40GB, 2), "2,5") == ["--include", "localhost:2"]
    assert launcher_device_args(2, NO_GPU, None) == ["--num_gpus", "2"]


def test_nodes_that_disagree_are_refused_naming_the_node():
    assert check_nodes_agree({"10.0.0.1": node(A100_40GB), "10.0.0.2": node(A100_40GB)}) == "cuda"
    assert check_nodes_agree({"a": NO_GPU, "b": NO_GPU}) == "cpu"
    with pytest.raises(TextsqlError, match="10.0.0.2 has no GPU.*every node must have GPUs, or none"):
        check_nodes_agree({"10.0.0.1": node(A100_40GB), "10.0.0.2": NO_GPU})
    with pytest.raises(TextsqlError, match="10.0.0.9 has 1 x Tesla V100.*native bf16 on some"):
        check_nodes_agree({"10.0.0.1": node(A100_40GB), "10.0.0.9": node(V100)})
    with pytest.raises(TextsqlError, match="b runs 2 rank\\(s\\) but has 1 GPU"):
        check_nodes_agree({"a": node(A100_40GB), "b": node(A100_40GB)}, slots={"b": 2})
    facts = node(H100_SXM, 2)
    assert NodeDevices.from_dict(facts.as_dict()) == facts  # how probes travel between nodes


def test_peak_table_tells_sxm_from_pcie_and_nvl_and_fp32_runs_use_their_own_peak():
    assert peak_tflops("NVIDIA H100 80GB HBM3").bf16 == 989.0
    assert peak_tflops("NVIDIA H100 NVL").bf16 == 835.0 and peak_tflops("NVIDIA H100 PCIe").bf16 == 756.0
    assert peak_tflops("NVIDIA H200 NVL").bf16 == 835.0 and peak_tflops("NVIDIA H200").bf16 == 989.0
    assert peak_tflops("NVIDIA A10").bf16 == 125.0 and peak_tflops("NVIDIA A100-SXM4-40GB").bf16 == 312.0
    a100 = peak_tflops("NVIDIA A100-PCIE-40GB")
    assert a100.for_precision("bf16", True) == (312.0, "bf16 dense")
    assert a100.for_precision("fp32", True) == (156.0, "TF32 dense")
    assert a100.for_precision("fp32", False) == (19.5, "FP32")
    assert peak_tflops("Some Future GPU") is None and peak_tflops("Some Future GPU", 500.0).bf16 == 500.0


# --------------------------------------------------------------------------- what `textsql train` asks the Trainer for


def plan_for(devices, assets, tmp_path, monkeypatch, *trainer_flags, **run):
    """train.set_up_run for this model on these devices; `run` are TextsqlTrainingArguments fields (precision, accelerator)."""
    from textsql.arguments.training import parse_arguments
    from textsql.train.run import set_up_run

    monkeypatch.setenv("DS_ACCELERATOR", "")  # set_up_run decides it; monkeypatch puts the old value back
    monkeypatch.delenv("DS_ACCELERATOR")
    argv = ["--model_id", str(assets[1]), "--output_dir", str(tmp_path / "run"), *trainer_flags]
    argv += [word for name, value in run.items() for word in (f"--{name}", value)]
    model, _, training = parse_arguments(argv)
    return set_up_run(model, training, devices=devices)


def flag(settings: dict, name: str) -> str:
    return str(settings[name])


@pytest.mark.parametrize(
    "gpu,bf16,tf32",
    [(A100_40GB, "True", "True"), (H100_SXM, "True", "True"), (V100, "False", "False"), (T4, "False", "False")],
)
def test_train_asks_the_trainer_for_what_the_gpu_has(assets, tmp_path, monkeypatch, gpu, bf16, tf32):
    plan = plan_for(node(gpu), assets, tmp_path, monkeypatch)
    assert plan.accelerator == "cuda" and plan.trainer_settings["use_cpu"] is False
    assert (
        flag(plan.trainer_settings, "bf16"),
        flag(plan.trainer_settings, "tf32"),
        flag(plan.trainer_settings, "fp16"),
    ) == (bf16, tf32, "False")


def test_train_on_no_gpu_and_the_trainers_own_flags(assets, tmp_path, monkeypatch):
    plan = plan_for(NO_GPU, assets, tmp_path, monkeypatch)
    assert (
        plan.accelerator == "cpu"
        and flag(plan.trainer_settings, "use_cpu") == "True"
        and flag(plan.trainer_settings, "tf32") == "False"
    )
    assert os.environ["DS_ACCELERATOR"] == "cpu"  # decided here, before DeepSpeed is imported
    with pytest.raises(TextsqlError, match="fp16 is refused for T5"):
        plan_for(node(A100_40GB), assets, tmp_path, monkeypatch, "--fp16", "True")
    with pytest.raises(TextsqlError, match="contradicts --precision fp32"):
        plan_for(node(A100_40GB), assets, tmp_path, monkeypatch, "--bf16", "True", precision="fp32")
    plan = plan_for(node(A100_40GB), assets, tmp_path, monkeypatch, "--bf16", "True")
    assert flag(plan.trainer_settings, "bf16") == "True" and flag(plan.trainer_settings, "tf32") == "True"
    with pytest.raises(TextsqlError, match="--accelerator cuda"):
        plan_for(NO_GPU, assets, tmp_path, monkeypatch, accelerator="cuda")
    # a CPU with native bf16 trains in bf16 under auto, and the Trainer is told so
    plan = plan_for(NodeDevices((), 16, cpu_native_bf16=True), assets, tmp_path, monkeypatch)
    assert flag(plan.trainer_settings, "bf16") == "True" and flag(plan.trainer_settings, "tf32") == "False"


# --------------------------------------------------------------------------- how training processes are started on a pod


def test_one_rank_per_gpu_through_the_launcher_by_default(monkeypatch):
    from textsql.train.local_launch import STARTED_BY_TEXTSQL, child_environment, training_command

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    four = node(A100_40GB, 4, cores=32)
    command = training_command(Path("args.json"), 4, four, uses_deepspeed=False)
    assert command[1] == "--master_port" and command[2].isdigit()  # a free port: two trainings on one pod never collide
    assert command[3:] == ["--num_gpus", "4", "--module", "textsql.train", "args.json"]
    assert training_command(Path("args.json"), 1, four, uses_deepspeed=False)[1:] == [
        "-m",
        "textsql.train",
        "args.json",
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert training_command(Path("a.json"), 2, node(A100_40GB, 2), uses_deepspeed=True)[3:5] == [
        "--include",
        "localhost:1,3",
    ]
    env = child_environment(4, four)
    assert env["OMP_NUM_THREADS"] == "8" and "DS_ACCELERATOR" not in env
    assert env[STARTED_BY_TEXTSQL] == "4"
    assert child_environment(2, NodeDevices((), 2))["DS_ACCELERATOR"] == "cpu"


def test_a_process_that_sees_several_gpus_trains_on_one(caplog):
    from types import SimpleNamespace

    from textsql.train.trainer import pin_to_one_gpu

    args = SimpleNamespace(world_size=1, n_gpu=4, _n_gpu=4, device="cuda:0")
    pin_to_one_gpu(args)
    assert args._n_gpu == 1 and "4 GPUs are visible" in caplog.text
    ranked = SimpleNamespace(world_size=2, n_gpu=1, _n_gpu=1, device="cuda:1")
    pin_to_one_gpu(ranked)
    assert ranked._n_gpu == 1


def test_textsql_train_starts_ranks_only_when_it_is_not_one(monkeypatch):
    from textsql.arguments.training import TextsqlTrainingArguments
    from textsql.train.local_launch import STARTED_BY_TEXTSQL, launches_ranks

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(STARTED_BY_TEXTSQL, raising=False)
    four = node(A100_40GB, 4)
    assert launches_ranks(TextsqlTrainingArguments(), four) == 4
    assert launches_ranks(TextsqlTrainingArguments(num_gpus=2), four) == 2
    assert (
        launches_ranks(TextsqlTrainingArguments(num_gpus=1), four) == 0
    )  # one rank: trains in this process, on one GPU
    assert (
        launches_ranks(TextsqlTrainingArguments(), node(A100_40GB, 1))
        == launches_ranks(TextsqlTrainingArguments(), NO_GPU)
        == 0
    )
    monkeypatch.setenv(STARTED_BY_TEXTSQL, "1")
    assert launches_ranks(TextsqlTrainingArguments(), four) == 0  # run_training started this process: never again
    monkeypatch.delenv(STARTED_BY_TEXTSQL)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launches_ranks(TextsqlTrainingArguments(), four) == 0  # already a rank


# --------------------------------------------------------------------------- one decision for train, a cluster and tune


@pytest.mark.parametrize(
    "devices,flags",
    [
        (node(A100_40GB, 2), []),
        (node(A100_40GB, 2), ["--bf16", "True"]),  # the Trainer's own flag
        (node(A100_40GB, 2), ["--precision", "fp16", "--force_fp16", "True"]),  # fp16 on T5, asked for
        (node(A100_40GB, 2), ["--precision", "fp32"]),
        (node(A100_40GB, 2), ["--accelerator", "cpu"]),
        (node(V100, 1), []),
        (NO_GPU, []),
    ],
)
def test_train_a_cluster_and_tune_decide_device_ranks_and_precision_alike(
    assets, tmp_path, monkeypatch, devices, flags
):
    """The same flags on the same pod: textsql train's set_up_run, a cluster's plan_launch and tune's candidates get
    one answer (strategy.devices.resolve_run_devices); tune once skipped --bf16/--fp16 and --force_fp16."""
    from textsql.arguments.training import parse_arguments
    from textsql.arguments.tune import TuneArguments
    from textsql.cluster.launch import plan_launch
    from textsql.tune import tune_devices

    train = plan_for(devices, assets, tmp_path, monkeypatch, *flags)
    argv = ["--model_id", str(assets[1]), "--output_dir", str(tmp_path / "cluster-run"), *flags]
    cluster = plan_launch(argv, ranks=[None], devices=devices, workdir=tmp_path, log_root=tmp_path / "l", env={})
    _, _, training = parse_arguments(argv)
    tune = tune_devices(TuneArguments(model_id=str(assets[1]), accelerator=training.accelerator), training, devices)
    answers = {
        (train.accelerator, train.precision),
        (cluster.accelerator, cluster.precision),
        (tune.accelerator, tune.precision),
    }
    assert len(answers) == 1, answers
    assert cluster.world_size == tune.ranks == (len(devices.gpus) if train.accelerator == "cuda" else 1)
    if "--bf16" in flags or "fp16" in flags:
        assert tune.precision.name == ("bf16" if "--bf16" in flags else "fp16")
