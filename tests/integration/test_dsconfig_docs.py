"""DeepSpeed configs as the documentation gives them (tests/data/dsconfig): what runs under the Trainer is accepted, with
the warnings textsql means; what the Trainer, accelerate or DeepSpeed stops on is refused with that component's reason.
A real Seq2SeqTrainer run (tests/integration/dsconfig_trainer_probe.py, one subprocess) shows both sides of the line.

Sources (read for transformers 5.23, accelerate 1.15, DeepSpeed 0.19.8):
  hf_*          huggingface/transformers docs/source/en/deepspeed.md (ZeRO-1/2/3 and NVMe sections, the notebook
                ds_config_zero3.json, the fp16 and Apex amp snippets)
  accelerate_*  huggingface/accelerate docs/source/usage_guides/deepspeed.md (zero_stage2_config.json,
                zero_stage3_offload_config.json, the ZeRO++ block)
  deepspeed_*   microsoft/DeepSpeed docs: _tutorials/getting-started.md (ds_config.json), _tutorials/zero.md (ZeRO-1,
                ZeRO-2 and ZeRO-Infinity blocks), _pages/config-json.md (ZeRO options with offload, bfloat16, the
                communication options, grad_hooks, cpu_offload)
Snippets that are only a block of a config sit in the documentation's own full-config frame (batch sizes "auto") where
the test is about the block; the ZeRO-1 snippet and the fp16 snippet are kept bare, as users copy them.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU on the test machines; must precede importing deepspeed

import pytest

from textsql.errors import TextsqlError
from textsql.strategy.dsconfig import DsConfigWarning, load_dsconfig
from textsql.strategy.opbuilds import extensions_folder

DATA = Path(__file__).resolve().parents[1] / "data" / "dsconfig"
PRECISION = "fp16.enabled is true: the Trainer stops unless --fp16 is True too"
BUCKET = "zero_optimization.reduce_bucket_size is 5e8 elements: a buffer of 2.0 GB"

# Every accepted file with all the warnings it gets (one fragment each, no more warnings than these).
ACCEPTED = {
    "hf_zero2_offload.json": [BUCKET],
    "hf_zero3_offload.json": [],
    "accelerate_zero2.json": [
        PRECISION,
        "gradient_accumulation_steps = 1 (compared with --gradient_accumulation_steps)",
    ],
    "accelerate_zero3_offload.json": [
        PRECISION,
        "gradient_accumulation_steps = 1 (compared with --gradient_accumulation_steps)",
        'zero_optimization.stage3_gather_16bit_weights_on_model_save: "auto" is filled by accelerate, not from the '
        "training arguments: with false",
    ],
    "accelerate_zeropp.json": [],
    "deepspeed_zero1_tutorial.json": [BUCKET],
    "deepspeed_zero2_tutorial.json": [BUCKET],
    "deepspeed_zero3_infinity_tutorial.json": [],
    "deepspeed_config_json_zero3.json": [
        PRECISION,
        "train_batch_size = 32 (compared with world size × --per_device_train_batch_size",
        'zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated (DeepSpeed: "Config parameter '
        'stage3_gather_fp16_weights_on_model_save is deprecated use stage3_gather_16bit_weights_on_model_save instead")',
    ],
    "deepspeed_bfloat16.json": [
        "bfloat16: DeepSpeed's old name for the bf16 block. Under the Trainer accelerate always writes a bf16 block",
        "zero_optimization.reduce_bucket_size is not set, so DeepSpeed uses its default of 5e8",
    ],
}
# Every refused file: (what textsql says, what the component itself says when the Trainer runs it, or None where the
# CPU run cannot show it). The second fragment is matched against tests/integration/dsconfig_trainer_probe.py's error.
REFUSED = {
    "hf_zero2_snippet_verbatim.json": (
        "is not valid JSON: Expecting ',' delimiter at line 14, column 9",
        "JSONDecodeError: Expecting ',' delimiter: line 14 column 9",
    ),
    "hf_zero1_snippet.json": ("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",) * 2,
    "hf_fp16_snippet.json": ("Please specify the ZeRO optimization config in the DeepSpeed config.",) * 2,
    "hf_zero3_nvme.json": (
        "zero_optimization.aio: unknown key here (DeepSpeed rejects it); aio is a top-level block",
        "DeepSpeedZeroConfig aio Extra inputs are not permitted",
    ),
    "hf_apex_amp.json": (
        "amp: DeepSpeed rejects this block: NVIDIA Apex AMP integration has been removed",
        "`amp.enabled` not found in kwargs",
    ),  # accelerate stops on its "auto" before DeepSpeed sees it
    "deepspeed_getting_started.json": ("'bool' object has no attribute 'get'",) * 2,
    "deepspeed_communication_options.json": (
        "sparse_gradients: DeepSpeed rejects this block: Sparse compression of dense torch.nn.Embedding gradients has "
        "been removed",
        "Sparse compression of dense torch.nn.Embedding gradients has been removed",
    ),
    "deepspeed_cpu_offload_legacy.json": ("You are using ZeRO-Offload with a client provided optimizer",) * 2,
    "deepspeed_grad_hooks.json": (
        "zero_optimization.grad_hooks: unknown key (DeepSpeed rejects it)",
        "DeepSpeedZeroConfig grad_hooks Extra inputs are not permitted",
    ),
    "deprecated_and_new_name_together.json": (
        "Cannot provide deprecated parameter 'stage3_gather_fp16_weights_on_model_save' and replacing parameter",
    )
    * 2,
    "auto_nobody_fills.json": ("`zero_optimization.stage3_max_live_parameters` not found in kwargs",) * 2,
    "fp16_dynamic_loss_scale_window_zero.json": (
        "fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled",
        None,
    ),  # fp16 needs a GPU
}
# Accepted files the CPU run cannot train: fp16 (a GPU precision; the first one shows the warned mismatch instead),
# hard-coded numbers that need other arguments, ZeRO++ quantization (CUDA kernels only).
NOT_TRAINED_ON_CPU = {
    "accelerate_zero2.json",
    "accelerate_zero3_offload.json",
    "accelerate_zeropp.json",
    "deepspeed_config_json_zero3.json",
    "deepspeed_zero1_tutorial.json",
}
# What accelerate fills beyond the Trainer, all in one file: stage, offload device and 16-bit saving from its
# DeepSpeedPlugin, the two stage3_ buckets at stage 2 from _prepare_deepspeed.
ACCELERATE_AUTOS = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {
        "stage": "auto",
        "offload_optimizer": {"device": "auto"},
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto",
    },
}


def test_every_data_file_is_listed():
    assert {p.name for p in (DATA / "accepted").glob("*.json")} == set(ACCEPTED)
    assert {p.name for p in (DATA / "refused").glob("*.json")} == set(REFUSED)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_documented_config_is_accepted_with_its_warnings(name):
    path = DATA / "accepted" / name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DsConfigWarning)
        assert load_dsconfig(path) == json.loads(path.read_text())
    found = [str(w.message) for w in caught if issubclass(w.category, DsConfigWarning)]
    for fragment in ACCEPTED[name]:
        assert any(fragment in message for message in found), (fragment, found)
    assert len(found) == len(ACCEPTED[name]), found


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_documented_config_that_cannot_run_is_refused_with_the_reason(name):
    with pytest.raises(TextsqlError) as info:
        load_dsconfig(DATA / "refused" / name)
    assert REFUSED[name][0] in str(info.value)


def test_fp16_window_is_deepspeeds_own_refusal():
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = json.loads((DATA / "refused" / "fp16_dynamic_loss_scale_window_zero.json").read_text())
    cfg["train_micro_batch_size_per_gpu"], cfg["zero_optimization"]["reduce_bucket_size"] = 1, 1000
    with pytest.raises(Exception, match=REFUSED["fp16_dynamic_loss_scale_window_zero.json"][0]):
        DeepSpeedConfig(cfg)


def test_the_trainer_trains_what_is_accepted_and_stops_where_it_is_refused(tmp_path):
    autos = tmp_path / "accelerate_autos.json"
    autos.write_text(json.dumps(ACCELERATE_AUTOS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsConfigWarning)
        load_dsconfig(autos)  # accepted (its warnings are tested in test_dsconfig.py)
    trained = [DATA / "accepted" / name for name in sorted(set(ACCEPTED) - NOT_TRAINED_ON_CPU)] + [autos]
    mismatch = DATA / "accepted" / "accelerate_zero2.json"
    stopped = [DATA / "refused" / name for name, (_, said) in sorted(REFUSED.items()) if said is not None]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_folder(env)))  # textsql's one op cache
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    results = tmp_path / "results.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "dsconfig_trainer_probe.py"),
            str(results),
            *map(str, trained + [mismatch] + stopped),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = {Path(o["config"]).name: o for o in map(json.loads, results.read_text().splitlines())}
    assert len(outcomes) == len(trained) + 1 + len(stopped), done.stdout[-3000:]
    for path in trained:
        assert outcomes[path.name]["ok"], outcomes[path.name]
    assert "ds fp16.enabled=True vs hf fp16|fp16_full_eval=False" in outcomes[mismatch.name]["error"]  # as warned
    for path in stopped:
        outcome = outcomes[path.name]
        assert not outcome["ok"] and REFUSED[path.name][1] in outcome["error"], outcome
