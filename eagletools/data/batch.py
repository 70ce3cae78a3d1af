"""A batch of samples and the protocol every sample source serves it by.

Online (token lists) and offline (the hidden-state cache) training read their
samples through `SampleSource`, so the trainer does not know which it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B,T] right-padded
    loss_mask: torch.Tensor  # [B,T]
    attention_mask: torch.Tensor  # [B,T]
    aux: torch.Tensor | None = None  # [B,T,A*Ht] offline only
    last_hidden: torch.Tensor | None = None  # [B,T,Ht] offline only
    indices: list[int] | None = None  # the samples' indices in their source

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


class SampleSource(Protocol):
    """What the trainer needs from online (token lists) or offline (cache) data."""

    def __len__(self) -> int: ...
    def length(self, index: int) -> int: ...
    def loss_mask(self, index: int) -> torch.Tensor: ...
    def batch(self, indices: list[int]) -> Batch: ...


def pad_right(rows: list[torch.Tensor], length: int, value: float = 0) -> torch.Tensor:
    """Stack rows of different lengths (dim 0) into one tensor, padded at the end."""
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), value)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out
