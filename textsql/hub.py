"""Load tokenizers, configs and models (seq2seq or causal, by the model family) from a hub name or a local folder, with
an offline-aware error."""

from __future__ import annotations

import difflib
import os
import socket
import urllib.parse
from contextlib import contextmanager
from pathlib import Path

from textsql.checkpoints import verify_model_folder
from textsql.errors import TextsqlError
from textsql.families import Family, auto_model_class, family_of
from textsql.paths import project_root


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE turns the hub off, read now (not at import) and by huggingface_hub's own rule: 1, true,
    yes or on (any case) mean offline; 0, false, no, off, empty or unset mean online. Every textsql reader asks here."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ENV_VARS_TRUE_VALUES


HUB_PROBE_SECONDS = 3.0
_hub_reachability: dict[str, str | None] = {}  # endpoint -> why it cannot be reached (None: it can); asked once


def hub_unreachable(timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """Why the Hugging Face hub cannot be reached from here, or None when it can: one TCP connection to the endpoint
    (HF_ENDPOINT, else huggingface.co) within `timeout` seconds, asked once per process. Without it, an air-gapped
    machine waits 40-70 s through huggingface_hub's retries before any message."""
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if endpoint not in _hub_reachability:
        address = urllib.parse.urlsplit(endpoint)
        port = address.port or (443 if address.scheme == "https" else 80)
        try:
            socket.create_connection((address.hostname, port), timeout=timeout).close()
            _hub_reachability[endpoint] = None
        except OSError as error:
            _hub_reachability[endpoint] = f"{address.hostname}:{port} did not answer within {timeout:g} s ({error})"
    return _hub_reachability[endpoint]


def _hub_kwargs(name: str) -> dict:
    """from_pretrained's arguments for `name`: the local cache only when the hub cannot be reached (checked once,
    quickly), so a missing model is reported at once instead of after minutes of retries."""
    if Path(name).expanduser().exists() or hub_offline() or hub_unreachable() is None:
        return {}
    return {"local_files_only": True}


def download_command(repo_id: str, *files: str, local_dir: str, repo_type: str | None = None) -> str:
    """The Hugging Face CLI command that fetches repo_id (or some of its files) into local_dir, as a hint to print."""
    parts = ["hf", "download", repo_id, *files]
    if repo_type:
        parts += ["--repo-type", repo_type]
    return " ".join(parts + ["--local-dir", local_dir])


def _not_found(name: str, error: Exception) -> TextsqlError:
    """The message for a model `name` from_pretrained could not load: a folder that is not a model folder, a folder
    that does not exist (a typo: the closest existing folders named), or a hub id that is neither cached nor fetched."""
    path = Path(name).expanduser()
    if path.exists():
        return TextsqlError(
            f"'{name}' ({path.absolute()}) is not a usable model folder ({str(error).splitlines()[0]}). It must hold config.json, "
            "the weights (model.safetensors) and the tokenizer files, as written by save_pretrained."
        )
    closest = closest_folders(name)
    parts = path.parts
    # A path rather than a hub id: written as one, under a folder that exists here, or a typo of a folder here. A hub
    # id's owner is no folder here (`Qwen/Qwen2.5-0.5B`), and one without an owner (`t5-small`) has no close folder.
    if (
        name.startswith((".", "/", "~"))
        or (len(parts) > 1 and _local_folder(parts[0]))
        or (len(parts) == 1 and closest)
    ):
        nearest = f"The closest existing: {', '.join(closest)}." if closest else "No existing folder has a close name."
        return TextsqlError(
            f"There is no folder '{name}' ({path.absolute()}). {nearest} Pass the folder of a model: config.json, "
            "the weights and the tokenizer files, as written by save_pretrained."
        )
    local = f"models/{name.split('/')[-1]}"
    if hub_offline():
        where = f"HF_HUB_OFFLINE is set and '{name}' is not in the local Hugging Face cache."
    elif hub_unreachable():
        where = f"The Hugging Face hub cannot be reached from here ({hub_unreachable()}) and '{name}' is not in the local cache."
    else:
        where = f"'{name}' could not be fetched from the hub ({str(error).splitlines()[0]})."
    folders = f" If you meant a local folder, the closest existing: {', '.join(closest)}." if closest else ""
    return TextsqlError(
        f"{where} On a machine with internet access run `{download_command(name, local_dir=local)}`, "
        f"copy the folder '{local}' into the project, and pass --model_id {local}.{folders}"
    )


def _search_roots() -> list[Path]:
    """Where a relative model folder is looked for: the working directory (from_pretrained's), then the project root."""
    return list(dict.fromkeys([Path.cwd(), project_root()]))


def _local_folder(name: str) -> bool:
    return any((root / name).is_dir() for root in _search_roots())


def closest_folders(name: str, limit: int = 3) -> list[str]:
    """Existing folders closest to the missing path `name`, as the user would write them: each part that exists is
    kept and each that does not is replaced by its closest sibling folders (difflib), for `textsql-demo/tiny-qwen2-rael`
    `textsql-demo/tiny-qwen2-real`."""
    path = Path(name).expanduser()
    # (folder on disk, the same as written): from the filesystem root for an absolute path, else from each root
    found = [(Path(path.anchor), path.anchor)] if path.is_absolute() else [(root, "") for root in _search_roots()]
    for part in path.parts[1:] if path.is_absolute() else path.parts:
        following = []
        for folder, written in found:
            if (folder / part).is_dir():
                following.append((folder / part, f"{written}{part}/"))
                continue
            try:
                siblings = sorted(child.name for child in folder.iterdir() if child.is_dir())
            except OSError:
                continue
            for close in difflib.get_close_matches(part, siblings, n=limit, cutoff=0.6):
                following.append((folder / close, f"{written}{close}/"))
        found = following[:limit]
    return list(dict.fromkeys(written.rstrip("/") for _, written in found))


@contextmanager
def _from_hub(name: str):
    """from_pretrained's arguments for `name` (_hub_kwargs), and what it raises when `name` cannot be had (OSError,
    ValueError) turned into the message that says why and what to do (_not_found)."""
    try:
        yield _hub_kwargs(name)
    except (OSError, ValueError) as error:
        raise _not_found(name, error) from None


def load_tokenizer(name: str):
    """A fast tokenizer for `name` (hub id or folder)."""
    from transformers import AutoTokenizer

    with _from_hub(name) as hub_kwargs:
        return AutoTokenizer.from_pretrained(name, **hub_kwargs)


def load_config(name: str):
    """The model's config (config.json) for `name` (hub id or folder)."""
    from transformers import AutoConfig

    with _from_hub(name) as hub_kwargs:
        return AutoConfig.from_pretrained(name, **hub_kwargs)


def model_family(name: str) -> Family:
    """The family of the model `name` (textsql.families), decided from its config."""
    return family_of(load_config(name))


def load_model(name: str, **kwargs):
    """The language model `name` (hub id or folder) with its family's Auto class (seq2seq or causal); kwargs go to
    from_pretrained. A folder's own pickles are checked first (textsql.checkpoints): every load of a model folder,
    for training, GRPO, inference, quantizing or merging, comes through here, and the folder may be writable by others."""
    with _from_hub(name) as hub_kwargs:
        config = load_config(name)
        verify_model_folder(name)
        return auto_model_class(family_of(config)).from_pretrained(name, **hub_kwargs, **kwargs)
