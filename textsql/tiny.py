"""Tokenizers trained on local text and tiny models built from scratch (T5, causal LMs), so tests and demos download
nothing."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.prompts import (
    HEADER_LEAD,
    HEADER_SEPARATOR,
    PROMPT_COLUMNS,
    PROMPT_VALUES,
    VALUE_LINK,
    VALUES_LEAD,
    source_text,
)
from textsql.vocabulary import WORD_START
from textsql.wikisql.format import render_sql

SOURCE_PREFIX = "translate English to SQL: "
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in every T5 checkpoint
# A word's units: letter runs, digit runs and single other characters ("(millions)" -> "(", "millions", ")").
UNIT_PATTERN = re.compile(r"[^\W\d_]+|\d+|\S")
# Score offsets keep the fallbacks last: a known unit beats fragments, fragments beat single characters.
DIGIT_PAIR_PENALTY = 2.0
FRAGMENT_PENALTY = 10.0
CHARACTER_PENALTY = 20.0
FRAGMENT_LENGTHS = (2, 3)


def corpus_for_tokenizer(
    questions: Iterable[dict], tables: Iterable[dict], *, prefix: str = SOURCE_PREFIX, layout: str = "seq2seq"
) -> Iterator[str]:
    """Texts to train a tokenizer on: each question as the model reads it (T5's: after `prefix`; a causal LM's, with
    layout "causal": in its prompt, `### Question: ...` then `### SQL:`), its human-readable SQL, every header (as
    question+header sources list them), each table's first row as a values section (`values: a = x | b = y`, the
    fixed words of question+header+values sources) and every cell. A tokenizer that never saw the prompt's fixed words spells them
    in bytes: 17 tokens of the demo's 53 per example, where a pretrained one takes about 6.

    `questions` and `tables` are release-format records (see textsql.wikisql.synthetic); the cells make sure every
    character of the tables is in the vocabulary, so SQL copied from a table always round-trips.
    """

    headers = {}
    lead = PROMPT_COLUMNS if layout == "causal" else HEADER_LEAD
    values_lead = PROMPT_VALUES if layout == "causal" else VALUES_LEAD
    for table in tables:
        headers[table["id"]] = table["header"]
        yield lead + HEADER_SEPARATOR.join(table["header"])  # the column list of question+header sources
        if table["rows"]:  # the values section of question+header+values sources: `column = cell` pairs
            yield values_lead + HEADER_SEPARATOR.join(
                f"{name}{VALUE_LINK}{cell}" for name, cell in zip(table["header"], table["rows"][0])
            )
        yield from (" ".join(str(cell) for cell in row) for row in table["rows"])
    for question in questions:
        if question["table_id"] not in headers:
            raise TextsqlError(
                f"Question {question['question']!r} refers to table {question['table_id']!r}, which is not among the tables passed."
            )
        yield source_text(question["question"], None, prefix, "question", layout)
        yield render_sql(question["sql"], headers[question["table_id"]])


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 4000, extra_ids: int = 100):
    """A T5TokenizerFast whose Unigram vocabulary is built from `texts` by counting, not by UnigramTrainer.

    Pieces: the units of words (letter runs, digit runs, punctuation) by frequency, in word-start ("▁word") and
    continuation ("word") forms; every two-digit number; frequent 2-3 letter fragments to fill the budget; and
    every character seen, in both forms, as the last resort. Scores are log-frequencies, so a known unit is one
    token. `vocab_size` counts everything (specials and the `extra_ids` sentinels too); the result may be smaller.
    Decoding gives back the text with runs of whitespace collapsed to one space, for any text made of seen characters.
    """
    from transformers import T5TokenizerFast

    unit_counts, character_counts = _count_units(texts)
    if not character_counts:
        raise TextsqlError(
            "The tokenizer needs training text: pass a non-empty list of sentences (see corpus_for_tokenizer)."
        )
    pieces = _character_pieces(character_counts)
    budget = vocab_size - len(SPECIAL_TOKENS) - 1 - extra_ids - len(pieces)  # 1 for the bare "▁"
    if budget < 0:
        raise TextsqlError(
            f"vocab_size={vocab_size} is too small: the {len(character_counts)} characters in the training text need "
            f"{len(pieces)} pieces besides {len(SPECIAL_TOKENS) + 1 + extra_ids} special ones. Use vocab_size >= "
            f"{vocab_size - budget + 500} or fewer extra_ids."
        )
    _add_best(pieces, _unit_pieces(unit_counts), budget - 2 * 100)  # room kept for the digit pairs
    _add_best(pieces, _digit_pair_pieces(sum(unit_counts.values())), budget - _added(pieces, character_counts))
    _add_best(pieces, _fragment_pieces(unit_counts), budget - _added(pieces, character_counts))
    vocab = (
        [(token, 0.0) for token in SPECIAL_TOKENS]
        + [(WORD_START, -CHARACTER_PENALTY * 2)]
        + sorted(pieces.items(), key=lambda item: -item[1])
        + [(f"<extra_id_{i}>", 0.0) for i in reversed(range(extra_ids))]  # T5 puts <extra_id_0> last
    )
    # clean_up_tokenization_spaces would turn "No . in" into "No. in" and break the round trip
    return T5TokenizerFast(vocab=vocab, extra_ids=extra_ids, clean_up_tokenization_spaces=False)


def _count_units(texts: Iterable[str]) -> tuple[Counter, Counter]:
    """Counts of pieces ("▁" + a word's first unit, later units bare) and of single characters."""
    units, characters = Counter(), Counter()
    for text in texts:
        for word in text.split():
            characters.update(word)
            for position, unit in enumerate(UNIT_PATTERN.findall(word)):
                units[WORD_START + unit if position == 0 else unit] += 1
    return units, characters


def _character_pieces(character_counts: Counter) -> dict[str, float]:
    total = sum(character_counts.values())
    pieces = {}
    for character, count in character_counts.items():
        score = math.log(count / total) - CHARACTER_PENALTY
        pieces[character] = score
        pieces[WORD_START + character] = score
    return pieces


def _unit_pieces(unit_counts: Counter) -> dict[str, float]:
    total = sum(unit_counts.values())
    return {unit: math.log(count / total) for unit, count in unit_counts.items()}


def _digit_pair_pieces(total_units: int) -> dict[str, float]:
    """'00'..'99' in both forms, so unseen numbers take about half as many tokens as digits."""
    score = math.log(0.5 / max(total_units, 1)) - DIGIT_PAIR_PENALTY
    return {form: score for number in range(100) for form in (f"{number:02d}", f"{WORD_START}{number:02d}")}


def _fragment_pieces(unit_counts: Counter) -> dict[str, float]:
    """Frequent letter fragments (continuation form) of lower-cased units: 'müller' as 'm'+'ül'+'ler', not 6 letters."""
    fragments = Counter()
    for unit, count in unit_counts.items():
        letters = unit.removeprefix(WORD_START).lower()
        if not letters.isalpha():
            continue
        for length in FRAGMENT_LENGTHS:
            for start in range(1, len(letters) - length + 1):
                fragments[letters[start : start + length]] += count
    total = sum(fragments.values())
    return {fragment: math.log(count / total) - FRAGMENT_PENALTY for fragment, count in fragments.items()}


def _add_best(pieces: dict[str, float], candidates: dict[str, float], budget: int) -> None:
    """Add the best-scored candidates not yet in `pieces` (at most `budget`); a piece already there keeps its best score."""
    for piece in candidates.keys() & pieces.keys():
        pieces[piece] = max(pieces[piece], candidates[piece])
    new = sorted((piece for piece in candidates if piece not in pieces), key=lambda piece: -candidates[piece])
    for piece in new[: max(budget, 0)]:
        pieces[piece] = candidates[piece]


def _added(pieces: dict[str, float], character_counts: Counter) -> int:
    """How many pieces beyond the character fallbacks are in the vocabulary so far."""
    return len(pieces) - 2 * len(character_counts)


def build_tiny_t5(
    tokenizer,
    *,
    d_model: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    d_ff: int = 256,
    dropout_rate: float = 0.1,
    seed: int = 0,
):
    """A randomly initialised T5ForConditionalGeneration sized for tests (about 0.5M parameters with the defaults)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    if d_model % num_heads:
        raise TextsqlError(
            f"d_model={d_model} must be a multiple of num_heads={num_heads} (each head gets d_model / num_heads)."
        )
    config = T5Config(
        vocab_size=len(tokenizer),
        dropout_rate=dropout_rate,
        d_model=d_model,
        d_kv=d_model // num_heads,
        d_ff=d_ff,
        num_layers=num_layers,
        num_decoder_layers=num_layers,
        num_heads=num_heads,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,  # T5 starts decoding from <pad>
    )
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's random state
        torch.manual_seed(seed)
        return T5ForConditionalGeneration(config)


def make_tiny_model(
    out_dir: str | Path, texts: Iterable[str], *, vocab_size: int = 4000, extra_ids: int = 100, **model_sizes
) -> Path:
    """Train a tokenizer on `texts`, build a tiny T5 for it, and save both into out_dir (loadable with Auto* classes).

    `model_sizes` go to build_tiny_t5 (d_model, num_layers, num_heads, d_ff, dropout_rate, seed). Returns out_dir.
    """
    out_dir = Path(out_dir)
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, extra_ids=extra_ids)
    model = build_tiny_t5(tokenizer, **model_sizes)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


# The tiny causal LM's tokenizer: byte-level BPE with Qwen2's normalizer and pre-tokenizer, so that transformers'
# Qwen2Tokenizer, which rebuilds both in code when a folder's config says qwen2, gives the ids the file gives.
END_OF_TEXT = "<|endoftext|>"  # EOS and pad, as in Qwen2: padding is masked by position, never by this id
QWEN2_SPLIT_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Widths of the tiny causal configs, in each family's own config names (read by tiny_causal_config).
CAUSAL_CONFIG_NAMES = {
    "llama": {"num_key_value_heads": 2, "intermediate_size": 4},
    "qwen2": {"num_key_value_heads": 2, "intermediate_size": 4},
    "mistral": {"num_key_value_heads": 2, "intermediate_size": 4},
    "opt": {"ffn_dim": 4, "word_embed_proj_dim": 1, "max_position_embeddings": 512},
    "bloom": {},
    "falcon": {},
    "gpt_bigcode": {"n_positions": 512},
    "codegen": {"n_positions": 512, "rotary_dim": 8},
    "gpt2": {"n_positions": 512},
}


def train_byte_level_tokenizer(texts: Iterable[str], *, vocab_size: int = 2000):
    """A byte-level BPE tokenizer trained on `texts` (a `tokenizers` BpeTrainer run), shaped like Qwen2's: NFC, Qwen2's
    split pattern, every byte in the vocabulary (so every character can be written), `<|endoftext|>` as EOS and pad."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT, clean_up_tokenization_spaces=False
    )


def tiny_causal_config(model_type: str, tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4):
    """A tiny config of a causal LM family (textsql.families): `hidden_size` wide, `num_layers` deep, the feed-forward
    4x wider, grouped-query attention where the family has it, the tokenizer's size and special ids."""
    from transformers import AutoConfig

    if model_type not in CAUSAL_CONFIG_NAMES:
        raise TextsqlError(
            f"No tiny config for '{model_type}'; textsql builds tiny {', '.join(CAUSAL_CONFIG_NAMES)} models."
        )
    if hidden_size % num_heads:
        raise TextsqlError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}.")
    extra = {
        name: value * hidden_size if name in ("intermediate_size", "ffn_dim", "word_embed_proj_dim") else value
        for name, value in CAUSAL_CONFIG_NAMES[model_type].items()
    }
    eos = tokenizer.eos_token_id
    return AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def build_tiny_causal(tokenizer, model_type: str = "qwen2", *, seed: int = 0, **sizes):
    """A randomly initialised causal LM of `model_type` sized for tests (tiny_causal_config's sizes)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_causal_config(model_type, tokenizer, **sizes)
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's random state
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def make_tiny_causal_model(
    out_dir: str | Path,
    texts: Iterable[str],
    *,
    model_type: str = "qwen2",
    vocab_size: int = 2000,
    tokenizer=None,
    **sizes,
) -> Path:
    """Train a byte-level BPE tokenizer on `texts` (or take `tokenizer`), build a tiny causal LM for it, and save both
    into out_dir; the tokenizer is loaded back from there as AutoTokenizer loads it and refused when its ids differ.
    `sizes` go to build_tiny_causal (hidden_size, num_layers, num_heads, seed). Returns out_dir."""
    from transformers import AutoTokenizer

    texts = list(texts)
    tokenizer = tokenizer or train_byte_level_tokenizer(texts, vocab_size=vocab_size)
    model = build_tiny_causal(tokenizer, model_type, **sizes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    sample = texts[:200]
    differ = sum(reloaded(text)["input_ids"] != tokenizer(text)["input_ids"] for text in sample)
    if differ:
        raise TextsqlError(
            f"The tokenizer saved in '{out_dir}' gives other ids once loaded back ({type(reloaded).__name__}: {differ} "
            f"of {len(sample)} texts differ); transformers rebuilds some families' pre-tokenizers in code. Use another "
            "model_type, or a tokenizer shaped like that family's."
        )
    return out_dir
