"""A batch of samples and the source class every sample source derives from.

Online (token lists) and offline (the hidden-state cache) training read their
samples through `SampleSource`, so the trainer does not know which it has. A
batch row holds one sample, right-padded, or several packed end to end
(`training.pack_tokens`), each then marked by its document id.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One sample's tensors, [T] or [T, width]; the states offline only."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None

    def truncated(self, limit: int | None) -> Sample:
        """The first `limit` tokens, as data.max_length cuts a conversation."""
        if limit is None:
            return self
        return Sample(*(None if x is None else x[:limit] for x in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.input_ids, self.loss_mask, self.aux, self.last_hidden


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B,T] right-padded
    loss_mask: torch.Tensor  # [B,T]
    attention_mask: torch.Tensor  # [B,T]
    aux: torch.Tensor | None = None  # [B,T,A*Ht] offline only
    last_hidden: torch.Tensor | None = None  # [B,T,Ht] offline only
    indices: list[int] | None = None  # the samples' indices in their source, row by row
    # [B,T] packed rows only: which of its row's samples (0, 1, ...) a token belongs to,
    # -1 at padding; None when every row holds one sample
    documents: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def spans(self) -> list[tuple[int, int, int]]:
        """(row, start, end) of each sample, in the order of `indices`."""
        docs = self.attention_mask.long() - 1 if self.documents is None else self.documents
        out = []
        for row, ids in enumerate(docs.tolist()):
            start = 0
            for doc, run in itertools.groupby(ids):
                end = start + len(list(run))
                if doc >= 0:
                    out.append((row, start, end))
                start = end
        return out


class SampleSource(ABC):
    """What the trainer needs from online (token lists) or offline (cache) data."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def length(self, index: int) -> int: ...

    @abstractmethod
    def loss_mask(self, index: int) -> torch.Tensor: ...

    @abstractmethod
    def sample(self, index: int) -> Sample: ...

    def batch(self, indices: list[int]) -> Batch:
        """One sample a row, right-padded to the longest."""
        return self.pack([[i] for i in indices])

    def pack(self, rows: list[list[int]], limit: int | None = None) -> Batch:
        """Each row's samples end to end (each cut to `limit` tokens), right-padded to the
        longest row; `documents` marks the samples when a row holds more than one."""
        samples = [[self.sample(i).truncated(limit) for i in row] for row in rows]
        fields = [_concat(row) for row in samples]
        t = max(row[0].numel() for row in fields)
        ids, masks, *states = (pad_right(list(x), t) for x in zip(*fields, strict=True))
        documents = None
        if any(len(row) > 1 for row in rows):
            marks = [torch.cat([torch.full_like(s.input_ids, d) for d, s in enumerate(row)])
                     for row in samples]  # fmt: skip
            documents = pad_right(marks, t, value=-1)
        attention = pad_right([torch.ones_like(row[0]) for row in fields], t)
        aux, last_hidden = states or (None, None)
        indices = [i for row in rows for i in row]
        return Batch(ids, masks, attention, aux, last_hidden, indices, documents)


def _concat(samples: list[Sample]) -> list[torch.Tensor]:
    """Samples end to end, field by field (the states only where present)."""
    columns = zip(*(s.tensors() for s in samples), strict=True)
    return [torch.cat(c) for c in columns if c[0] is not None]


def pad_right(rows: list[torch.Tensor], length: int, value: float = 0) -> torch.Tensor:
    """Stack rows of different lengths (dim 0) into one tensor, padded at the end."""
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), value)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out
