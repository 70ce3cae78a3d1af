"""Training samples, length-bucketed batches and the target features per batch.

The batch plan of an epoch is a pure function of (seed, epoch, lengths,
batch size, world size), so a resumed run skips to the exact global batch it
stopped at, and a run on W processes sees the same global batches as a run
on one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagletools.data.batch import Batch, SampleSource, pad_right
from eagletools.errors import UserError


class TokenSamples:
    """Tokenised samples (a prepared dataset) for online training."""

    def __init__(self, dataset: Any):
        self.ids = [torch.as_tensor(x, dtype=torch.long) for x in dataset["input_ids"]]
        self.masks = [torch.as_tensor(x, dtype=torch.long) for x in dataset["loss_mask"]]

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, index: int) -> int:
        return self.ids[index].numel()

    def loss_mask(self, index: int) -> torch.Tensor:
        return self.masks[index]

    def batch(self, indices: list[int]) -> Batch:
        t = max(self.length(i) for i in indices)
        ids = pad_right([self.ids[i] for i in indices], t)
        attention = pad_right([torch.ones_like(self.ids[i]) for i in indices], t)
        masks = pad_right([self.masks[i] for i in indices], t)
        return Batch(ids, masks, attention, indices=list(indices))


class ArgmaxMemo:
    """The target's full-vocab argmax per sample, kept from its first computation.

    Offline, a sample's hidden states are the same in every epoch, but its argmax
    takes a [T, V] product (the teacher's larger half; docs/lab.md, Part 3).
    Later epochs and held-out evaluations reuse it at 4 bytes
    per token.
    """

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def lookup(self, batch: Batch) -> torch.Tensor | None:
        """[B,T] argmax when every sample of the batch is known, else None."""
        if batch.indices is None or any(i not in self.rows for i in batch.indices):
            return None
        rows = [self.rows[i] for i in batch.indices]
        return pad_right(rows, batch.input_ids.shape[1]).long()

    def store(self, batch: Batch, argmax: torch.Tensor) -> None:
        for row, index in enumerate(batch.indices or []):
            n = int(batch.attention_mask[row].sum())
            self.rows[index] = argmax[row, :n].to(torch.int32).cpu()


def trainable(source: SampleSource, indices: list[int]) -> tuple[list[int], int]:
    """Indices with at least one position to learn (a masked token at t >= 2), and
    how many were skipped because every token is masked out of the loss."""
    keep = [i for i in indices if bool(source.loss_mask(i)[2:].any())]
    return keep, len(indices) - len(keep)


def split_indices(n: int, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices: a seeded permutation, the first `eval_samples` held out."""
    if eval_samples >= n:
        raise UserError(
            f"data.eval_samples={eval_samples} leaves no training samples out of {n}; "
            "lower data.eval_samples or add data"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[eval_samples:]), sorted(order[:eval_samples])


def plan_epoch(
    lengths: list[int], global_batch: int, seed: int, epoch: int, bucket_size: int
) -> list[list[int]]:
    """Global batches (lists of positions into `lengths`) for one epoch.

    Shuffle, cut into buckets of `bucket_size` global batches, sort each bucket
    by length so a batch pads little, then shuffle the batch order. The last
    incomplete global batch is dropped so every step has the same sample count.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    span = global_batch * bucket_size
    batches = []
    for start in range(0, len(order), span):
        bucket = sorted(order[start : start + span], key=lambda i: -lengths[i])
        batches += [bucket[i : i + global_batch] for i in range(0, len(bucket), global_batch)]
    batches = [b for b in batches if len(b) == global_batch]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


def steps_per_epoch(num_samples: int, global_batch: int, grad_accum: int) -> int:
    return (num_samples // global_batch) // grad_accum


def total_steps(num_samples: int, global_batch: int, grad_accum: int, epochs: float) -> int:
    per_epoch = steps_per_epoch(num_samples, global_batch, grad_accum)
    if per_epoch == 0:
        raise UserError(
            f"{num_samples} training samples do not fill one optimizer step of "
            f"{global_batch * grad_accum} samples (batch_size x processes x grad_accum); "
            "lower training.batch_size or training.grad_accum, or add data"
        )
    return max(1, math.ceil(per_epoch * epochs))
