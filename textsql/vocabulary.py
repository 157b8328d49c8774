"""Make every character of the data producible: find the characters a tokenizer cannot produce, and add them to it.

Real T5 vocabularies have no `<` (and lack a few other characters), so a query with a less-than condition can never be
generated exactly. Added tokens would not do: decoding drops the space before an added token ("Wins< 5"). Instead each
missing character goes into the Unigram model itself, as a piece of its own and as a word-start piece ("▁<"), so the
Metaspace decoder restores the spaces like for any other word. The extended tokenizer is saved with the prepared data
and, after training, with the model; the model's embeddings grow to match where needed. A vocabulary's fingerprint
tells which tokenizer prepared data and an adapter were made with.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from textsql.errors import TextsqlError


def byte_level(tokenizer) -> bool:
    """Whether the tokenizer is byte-level BPE (GPT-2's, Qwen2's, Llama 3's): its pre-tokenizer maps every byte to a
    symbol of its vocabulary, so it writes every character and has nothing to add. SentencePiece BPE (Llama 2's) and
    Unigram (T5's) vocabularies may lack characters."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())

    def has_byte_level(part) -> bool:
        if not isinstance(part, dict):
            return False
        return part.get("type") == "ByteLevel" or any(has_byte_level(p) for p in part.get("pretokenizers", []))

    return has_byte_level(state.get("pre_tokenizer")) and (state.get("decoder") or {}).get("type") == "ByteLevel"


def missing_characters(tokenizer, texts: Iterable[str]) -> dict[str, dict[str, int]]:
    """Characters of `texts` the tokenizer cannot give back, by kind, with how many texts hold each:
    "unknown" (no piece covers it: it becomes <unk>) and "normalized" (the tokenizer's normalizer rewrites it).

    A character the normalizer rewrites into one the vocabulary lacks (NFKC turns `½` into `1⁄2`, and T5 has no `⁄`)
    counts that one as unknown too: once it is added, the rewritten text (what scoring matches column names on) can be
    produced."""
    seen: Counter = Counter()
    for text in texts:
        seen.update(set(text))
    backend = tokenizer.backend_tokenizer
    unknown: Counter = Counter()
    normalized = {}
    for character, count in seen.most_common():
        if character.isspace():
            continue  # whitespace only separates words; targets collapse runs of it
        rewritten = backend.normalizer.normalize_str(character) if backend.normalizer is not None else character
        if rewritten != character:
            normalized[character] = count
            unknown.update({c: count for c in set(rewritten) if c != character and _unknown(tokenizer, c)})
        elif _unknown(tokenizer, character):
            unknown[character] += count
    return {"unknown": dict(unknown.most_common()), "normalized": normalized}


def _unknown(tokenizer, character: str) -> bool:
    """No piece covers `character` (whitespace never counts: it only separates words)."""
    if character.isspace():
        return False
    return tokenizer.unk_token_id in tokenizer.backend_tokenizer.encode(character, add_special_tokens=False).ids


def add_characters(tokenizer, characters: Iterable[str], save_dir: str | Path):
    """A copy of `tokenizer` whose Unigram vocabulary also has each character (alone and as "▁c"), saved in `save_dir`.

    New pieces get ids after every existing one, with the lowest score, so the segmentation of all other text stays
    the same. Returns the tokenizer loaded back from `save_dir`.
    """
    from transformers import AutoTokenizer

    characters = [c for c in dict.fromkeys(characters) if len(c) == 1]
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state.get("model", {})
    if model.get("type") != "Unigram":
        raise TextsqlError(
            f"Cannot add characters to a {model.get('type')} tokenizer: textsql extends SentencePiece "
            "Unigram vocabularies (T5's), and byte-level BPE ones (GPT-2, Qwen2, Llama 3) need nothing added. Use "
            "one of those tokenizers, or remove the characters it lacks from the data."
        )
    vocab = model["vocab"]
    beyond = [t["content"] for t in state.get("added_tokens", []) if t["id"] >= len(vocab)]
    if beyond:
        raise TextsqlError(
            f"The tokenizer has added tokens beyond its vocabulary ({', '.join(beyond[:3])}...), where new "
            "pieces would go; textsql cannot extend it."
        )
    lowest = min(score for _, score in vocab) - 1.0
    known = {piece for piece, _ in vocab}
    for character in characters:
        for piece in (character, WORD_START + character):
            if piece not in known:
                vocab.append([piece, lowest])
                known.add(piece)
    save_dir = Path(save_dir)
    with tempfile.TemporaryDirectory(prefix="textsql-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(state, ensure_ascii=False))
        extended = AutoTokenizer.from_pretrained(tmp)
    extended.save_pretrained(save_dir)
    return extended


def fit_embeddings(model, tokenizer) -> bool:
    """Grow the model's (tied) embeddings to the tokenizer's size when it has more ids; True when it did.

    A real T5 checkpoint has 32128 embedding rows for 32100 ids, so a few added characters fit without growing.
    """
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 keeps a placeholder
    if len(tokenizer) <= rows:
        return False
    model.resize_token_embeddings(len(tokenizer))
    return True


def added_token_ids(tokenizer, base_tokenizer) -> list[int]:
    """Ids of the pieces `tokenizer` has and the model's own `base_tokenizer` lacks: the characters prep added, whose
    embedding rows the base model never trained."""
    base = base_tokenizer.get_vocab()
    return sorted(i for piece, i in tokenizer.get_vocab().items() if piece not in base)


WORD_START = "▁"  # SentencePiece's word-start marker, as T5's Metaspace pre-tokenizer writes it


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary, so training can refuse data tokenized with another tokenizer (the prepared
    data's metadata records it), and an adapter a tokenizer other than its run's (its record does)."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
