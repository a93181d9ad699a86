"""A step's packed inputs: what every backend executes, and what a tensor-parallel rank receives."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """A step's packed inputs, as plain CPU tensors: what a tensor-parallel rank needs to run the same step."""
    ids: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each token's k/v
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_of: torch.Tensor  # [T] row of block_tables each token belongs to
    kv_len: torch.Tensor  # [T] a token sees its sequence's positions [0, kv_len)
    keep: torch.Tensor  # rows whose logits are returned
    tree_base: torch.Tensor | None = None  # [T] int32, when the step holds a token tree
    tree_mask: torch.Tensor | None = None  # [T] int64
