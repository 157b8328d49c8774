"""GPTQ for `textsql quantize --method gptq`: which models and group sizes, the calibration examples drawn from the
prepared dataset, the job run in textsql's GPTQ environment, and its output checked before textsql loads it."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.families import Family, auto_model_class, family_of
from textsql.gptq.environment import ensure_environment, run_job
from textsql.hub import download_command, load_config
from textsql.prepared import load_prepared

logger = logging.getLogger("textsql.quantize")

GROUP_SIZES = (128, 64, 32)  # the automatic choice, largest first: 128 is GPTQ's usual group
CALIBRATION_SEED = 0
JOB_RECORD = "gptq_job.json"  # what textsql/gptq/job.py writes beside the model, folded into textsql's record
# Measured (llmcompressor 0.14, a tiny T5, 2 encoder + 2 decoder layers): its sequential pipeline traced 1 subgraph
# where it expected 4, so T5's layers would not be calibrated one after another, as GPTQ's method needs.
SEQ2SEQ_REASON = (
    "GPTQ quantizes a model layer by layer, each calibrated on the outputs of the layers already quantized before it; "
    "llmcompressor, which textsql runs it with, does that for decoder-only causal LMs, and cannot split an "
    "encoder-decoder's forward pass into its layers (measured on a tiny T5: 1 of 4 layer groups traced), nor do the "
    "GPTQ runtimes serve T5"
)


def refuse_unless_causal(family: Family) -> None:
    """GPTQ is for causal LMs (the family registry's kind, never the model's name); anything else is refused."""
    if not family.causal:
        raise TextsqlError(
            f"--method gptq quantizes causal LMs, and this is a {family.name} ({family.kind}) model: {SEQ2SEQ_REASON}. "
            "Quantize it with torchao-int8, bnb-int8, bnb-nf4 (4-bit) or dynamic-int8 instead."
        )


def choose_group_size(widths: Iterable[int], requested: int = 0) -> int:
    """The GPTQ group (weights sharing one scale along a layer's input) for layers whose inputs are `widths` wide:
    `requested` when it divides every width, else refused; with 0, the largest of 128, 64, 32 that divides them all."""
    widths = sorted(set(widths))
    if not widths:
        raise TextsqlError("The model has no Linear layer for GPTQ to quantize (its output layer is left as it is).")
    if requested:
        if all(width % requested == 0 for width in widths):
            return requested
        fits = [size for size in GROUP_SIZES if all(width % size == 0 for width in widths)]
        raise TextsqlError(
            f"--group_size {requested} does not divide every layer's input width ({', '.join(map(str, widths))}): "
            f"each group must hold whole rows of weights. Choose a divisor of them all"
            + (f" ({', '.join(map(str, fits))} would do), or leave --group_size out." if fits else ".")
        )
    for size in GROUP_SIZES:
        if all(width % size == 0 for width in widths):
            return size
    raise TextsqlError(
        f"None of the group sizes {', '.join(map(str, GROUP_SIZES))} divides every layer's input width of this model "
        f"({', '.join(map(str, widths))}). Pass --group_size N with N dividing them all."
    )


def quantized_layer_widths(model) -> dict[str, int]:
    """{name: input width} of the layers GPTQ quantizes: every nn.Linear (a family's subclasses too) but the output
    layer, as the job's recipe targets them."""
    import torch

    output = model.get_output_embeddings()
    return {
        name: module.in_features
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not output
    }


def layers_gptq_leaves(model) -> list[str]:
    """Linear-like layers the job's recipe does not reach: GPT-2's Conv1D (not an nn.Linear). The output layer is left
    on purpose and not listed."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Conv1D"]


def empty_model(model_dir: str):
    """The model's modules without weights (torch's meta device): its shapes, for the decisions above."""
    import torch

    config = load_config(model_dir)
    with torch.device("meta"):
        return auto_model_class(family_of(config)).from_config(config)


def calibration_input_ids(dataset_dir: str, samples: int, seed: int = CALIBRATION_SEED) -> list[list[int]]:
    """`samples` examples of the prepared dataset's training split, drawn at random (seeded), as token ids: the prompt
    and its SQL, the sequence the model reads while it writes the SQL."""
    dataset, metadata = load_prepared(dataset_dir)
    if "train" not in dataset:
        raise TextsqlError(f"'{dataset_dir}' has no train split to calibrate GPTQ on; prepare it with `textsql prep`.")
    train = dataset["train"]
    count = min(samples, len(train))
    if count < samples:
        logger.warning("GPTQ calibrates on all %d training examples (%d were asked for).", count, samples)
    return [list(row) for row in train.shuffle(seed=seed).select(range(count))["input_ids"]]


def quantize_with_gptq(
    model_dir: str,
    output: Path,
    *,
    bits: int,
    group_size: int,
    samples: int,
    dataset_dir: str,
    device: str,
    env_dir: str | None,
    wheels: str | None,
    echo=print,
) -> dict:
    """Quantize `model_dir` into `output` with GPTQ in textsql's GPTQ environment (created first if needed); return
    what ran (for textsql's record). textsql writes the job's inputs (a model folder, token ids) and checks its output:
    config.json and safetensors, nothing else."""
    config = load_config(model_dir)
    refuse_unless_causal(family_of(config))
    if not Path(model_dir).is_dir():
        raise TextsqlError(
            f"--method gptq needs the model as a local folder, and '{model_dir}' is not one: download it first "
            f"(`{download_command(model_dir, local_dir='DIR')}`) and pass DIR."
        )
    if not list(Path(model_dir).glob("*.safetensors")):
        raise TextsqlError(
            f"'{model_dir}' has no *.safetensors weights; the GPTQ job loads safetensors only (never a pickle). Save "
            "the model with save_pretrained(..., safe_serialization=True) first."
        )
    model = empty_model(model_dir)
    widths = quantized_layer_widths(model)
    chosen = choose_group_size(widths.values(), group_size)
    left = layers_gptq_leaves(model)
    ids = calibration_input_ids(dataset_dir, samples)
    echo(
        f"GPTQ {bits}-bit, groups of {chosen} ({'as asked' if group_size else 'the largest of 128/64/32 dividing every'}"
        f"{'' if group_size else ' layer input width: ' + ', '.join(map(str, sorted(set(widths.values()))))}), "
        f"{len(widths)} layers, calibrated on {len(ids)} training examples of {dataset_dir} "
        f"({sum(map(len, ids))} tokens), on the {device}."
    )
    environment = ensure_environment(env_dir, wheels, echo)
    work = Path(tempfile.mkdtemp(prefix="textsql-gptq-"))
    staged = work / "model"
    staged.mkdir()
    (work / "calibration.json").write_text(json.dumps({"input_ids": ids}))
    log = work / "llmcompressor.log"
    run_job(
        environment,
        [
            "--model_dir",
            str(Path(model_dir).resolve()),
            "--calibration",
            str(work / "calibration.json"),
            "--output_dir",
            str(staged),
            "--bits",
            str(bits),
            "--group_size",
            str(chosen),
            "--device",
            device,
        ],
        log,
    )
    job = check_job_output(staged)
    output.mkdir(parents=True, exist_ok=True)
    for path in staged.iterdir():
        shutil.move(str(path), output / path.name)
    shutil.rmtree(work)  # kept on failure: the log and the inputs say what went wrong
    return {**job, "layers": len(widths), "environment": str(environment), "layers_left_unquantized": left}


def check_job_output(folder: Path) -> dict:
    """The job's record, after checking that the folder holds a compressed-tensors model as safetensors and JSON only."""
    files = sorted(path.name for path in folder.iterdir())
    foreign = [name for name in files if not name.endswith((".json", ".safetensors"))]
    try:
        config = json.loads((folder / "config.json").read_text())
        job = json.loads((folder / JOB_RECORD).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise TextsqlError(
            f"The GPTQ job's output in {folder} is incomplete ({error}); run the command again."
        ) from None
    method = (config.get("quantization_config") or {}).get("quant_method")
    if foreign or method != "compressed-tensors" or not any(name.endswith(".safetensors") for name in files):
        raise TextsqlError(
            f"The GPTQ job's output in {folder} is not what textsql loads (files {', '.join(files)}; quantization "
            f"method {method!r}): expected config.json with a compressed-tensors quantization_config and safetensors "
            "weights only. Delete the GPTQ environment's folder and run the command again."
        )
    (folder / JOB_RECORD).unlink()  # its content goes into textsql's record
    return job
