"""Batches: T5's padded pairs; a causal LM's prompt and answer in one sequence, padded on the right with the padding
masked by position, or packed into one row without padding (--packing)."""

from __future__ import annotations

from dataclasses import dataclass

from textsql.errors import TextsqlError
from textsql.families import Family, family_of, pad_token_id

IGNORE_INDEX = -100  # labels the loss skips
# The attention implementations that keep packed examples apart (transformers' own names). sdpa and eager get a
# block-diagonal mask built from the position ids (measured here on the CPU: loss and gradient equal to padding's);
# flex_attention a BlockMask from the same segments, whose blocks between examples it skips (its loss equal to
# padding's: tests/unit/test_packing.py); flash-attention reads the position ids as the examples' boundaries
# (transformers' padding-free path; GPU only, not run here). Others (kernels from the hub) are not checked, so refused.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# The batch's token counts (textsql.train.speed.TOKEN_COUNTS), counted on the host by CountTokens.
TOKEN_COUNTS_KEY = "textsql_token_counts"


@dataclass
class CausalLMCollator:
    """Pads `input_ids` with `pad_token_id` on the right; the attention mask is 0 and the label -100 on the padded
    positions, by position and never by token id: where pad == EOS (Qwen2, GPT-2 with EOS as pad) masking by id would
    also mask the real EOS, and the model would never learn to stop. Each example's own labels (-100 on its prompt,
    as prep wrote them) are kept as they are."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict:
        import torch

        longest = max(len(feature["input_ids"]) for feature in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": torch.full((len(features), longest), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(features), longest), dtype=torch.long),
            "labels": torch.full((len(features), longest), IGNORE_INDEX, dtype=torch.long),
        }
        for row, feature in enumerate(features):
            length = len(feature["input_ids"])
            batch["input_ids"][row, :length] = torch.as_tensor(feature["input_ids"])
            batch["attention_mask"][row, :length] = 1
            batch["labels"][row, :length] = torch.as_tensor(feature["labels"])
        return batch


class PackedCausalLMCollator:
    """The batch's examples end to end in one row of shape (1, total tokens), no padding: transformers'
    `DataCollatorWithFlattening`, with `position_ids` restarting at 0 at each example, from which the model builds a
    mask that keeps each example's attention within itself, and no attention mask (given one, the model would not look
    at the position ids). Labels as prep wrote them (-100 on the prompt, the SQL and its EOS learned); each example's
    first label is -100, so no example learns to predict the next one's first token (its first label is the prompt's,
    -100 already: the loss counts exactly the tokens the padded batch counts). `use_cache=False` goes with the batch:
    with a cache the model never looks for packed examples either (transformers 5.23 and 5.24, masking_utils).

    `pad_to_multiple_of`: the row is filled up to a multiple of it with one more segment of padding (its own
    positions from 0, labels -100), so that rows come in a few lengths: a compiled model and FlexAttention's blocks
    (128 positions) see the same shapes again instead of a new one per batch."""

    def __init__(self, pad_to_multiple_of: int | None = None, pad_token_id: int = 0):
        self.pad_to_multiple_of, self.pad_token_id = pad_to_multiple_of, pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        from transformers import DataCollatorWithFlattening

        rows = [{"input_ids": feature["input_ids"], "labels": feature["labels"]} for feature in features]
        total = sum(len(row["input_ids"]) for row in rows)
        fill = -total % self.pad_to_multiple_of if self.pad_to_multiple_of else 0
        if fill:
            rows.append({"input_ids": [self.pad_token_id] * fill, "labels": [IGNORE_INDEX] * fill})
        batch = DataCollatorWithFlattening(separator_id=IGNORE_INDEX, return_tensors="pt")(rows)
        batch["use_cache"] = False
        return batch


@dataclass
class CountTokens:
    """The wrapped collator's batch with its token counts (textsql.train.speed.TOKEN_COUNTS) under TOKEN_COUNTS_KEY,
    counted from the examples' lengths on the host while the batch is made: the source (a causal LM's whole sequence,
    T5's question) and target (the label tokens) of each example, their squares and products. The Trainer takes them
    out before the model sees the batch (textsql.train.sft.SupervisedTraining._prepare_inputs)."""

    collator: object

    def __call__(self, features: list[dict]) -> dict:
        batch = self.collator(features)
        counts = [0, 0, 0, 0, 0]
        for feature in features:
            source = len(feature["input_ids"])
            target = sum(1 for label in feature["labels"] if label != IGNORE_INDEX)
            for i, value in enumerate((source, target, source * source, target * target, source * target)):
                counts[i] += value
        batch[TOKEN_COUNTS_KEY] = counts
        return batch


def packing_refusal(family: Family, attn_implementation: str | None) -> str:
    """Why a model of `family` with this attention implementation cannot train on packed batches; empty where it can.
    `attn_implementation` None (not decided before the model loads) is judged by the family alone."""
    if family.packing_refusal:
        return f"the {family.name} family cannot: {family.packing_refusal}"
    if attn_implementation is not None and attn_implementation not in PACKING_ATTENTION:
        return (
            f"the model's attention implementation is '{attn_implementation}', and textsql packs only with "
            f"{', '.join(PACKING_ATTENTION)}, whose masks keep the packed examples apart"
        )
    return ""


def check_packing(config) -> None:
    """Refuse `--packing True` for a model (its config: the family, and the attention implementation once loaded) that
    would let packed examples attend to each other."""
    reason = packing_refusal(family_of(config), getattr(config, "_attn_implementation", None))
    if reason:
        raise TextsqlError(
            f"--packing True was asked for, but {reason}. Train this model with padded batches (--packing False, the "
            "default); docs/causal-lm.md lists the families that pack."
        )


def make_collator(family: Family, tokenizer, model, *, packing: bool = False, pad_to_multiple_of: int | None = None):
    """The batches a family trains on: T5's padded source and target; a causal LM's padded sequence, or packed."""
    if packing:
        check_packing(model.config)
        return PackedCausalLMCollator(pad_to_multiple_of, pad_token_id(tokenizer))
    if family.causal:
        return CausalLMCollator(pad_token_id(tokenizer), pad_to_multiple_of=pad_to_multiple_of)
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=IGNORE_INDEX, pad_to_multiple_of=pad_to_multiple_of
    )


def padding_fraction(batch: dict) -> float:
    """The share of a batch's positions that are padding (none in a packed batch, which has no attention mask)."""
    mask = batch.get("attention_mask")
    return 0.0 if mask is None else 1.0 - float(mask.sum()) / mask.numel()
