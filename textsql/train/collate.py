"""Batches for a causal LM: prompt and answer in one sequence, padded on the right, padding masked by position."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100  # labels the loss skips


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
