"""Training samples, length-bucketed batches and the target features per batch.

The batch plan of an epoch is a pure function of (seed, epoch, lengths,
batch size, world size), so a resumed run skips to the exact global batch it
stopped at, and a run on W processes sees the same global batches as a run
on one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from eagletools.data.batch import Batch, Sample, SampleSource
from eagletools.errors import UserError
from eagletools.train.packing import plan_packed_epoch

if TYPE_CHECKING:
    from eagletools.train.recipe import TrainingSection


class TokenSamples(SampleSource):
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

    def sample(self, index: int) -> Sample:
        return Sample(self.ids[index], self.masks[index])


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
        out = torch.zeros(batch.input_ids.shape, dtype=torch.long)
        for (row, start, end), index in zip(batch.spans(), batch.indices, strict=True):
            out[row, start:end] = self.rows[index]
        return out

    def store(self, batch: Batch, argmax: torch.Tensor) -> None:
        for (row, start, end), index in zip(batch.spans(), batch.indices or [], strict=True):
            self.rows[index] = argmax[row, start:end].to(torch.int32).cpu()


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


def epoch_rows(
    lengths: list[int], global_batch: int, pack_tokens: int, seed: int, epoch: int,
    bucket_size: int,
) -> list[list[list[int]]]:  # fmt: skip
    """The epoch's global batches of rows (positions into `lengths`): packed up to
    `pack_tokens` (training.pack_tokens), or one sample a row when it is 0."""
    if pack_tokens:
        return plan_packed_epoch(lengths, global_batch, pack_tokens, seed, epoch, bucket_size)
    plan = plan_epoch(lengths, global_batch, seed, epoch, bucket_size)
    return [[[i] for i in batch] for batch in plan]


class EpochBatches:
    """Every epoch's global batches of training rows (`epoch_rows`), each epoch planned
    once, and the micro-batches a rank reads from them."""

    def __init__(self, source: SampleSource, train_idx: list[int], world: int, t: TrainingSection):
        self.source, self.train_idx, self.t = source, train_idx, t
        self.global_batch = t.batch_size * world
        self._plan: tuple[int, list[list[list[int]]]] | None = None  # (epoch, its batches)

    def epoch(self, epoch: int) -> list[list[list[int]]]:
        """The epoch's global batches of rows (positions into `train_idx`: one per row, or
        packed)."""
        if self._plan is None or self._plan[0] != epoch:
            t = self.t
            lengths = [self.source.length(i) for i in self.train_idx]
            plan = epoch_rows(lengths, self.global_batch, t.pack_tokens, t.seed, epoch,
                              t.bucket_size)  # fmt: skip
            self._plan = (epoch, plan)
        return self._plan[1]

    def micro_batches(self, epoch: int, start: int, rank: int) -> list[Batch]:
        """`rank`'s share of the epoch's global batches `start` to `start + grad_accum`."""
        t, out = self.t, []
        for global_batch in self.epoch(epoch)[start : start + t.grad_accum]:
            mine = global_batch[rank * t.batch_size : (rank + 1) * t.batch_size]
            rows = [[self.train_idx[i] for i in row] for row in mine]
            batch = self.source.pack(rows, t.pack_tokens or None)
            if t.loss_on == "all":  # the teacher is the target's distribution there too
                batch = dataclasses.replace(batch, loss_mask=batch.attention_mask)
            out.append(batch)
        return out


def steps_per_epoch(num_batches: int, grad_accum: int) -> int:
    """Optimizer steps an epoch of `num_batches` global batches fills."""
    if num_batches < grad_accum:
        raise UserError(
            f"an epoch holds {num_batches} global batches, fewer than one optimizer step "
            f"takes ({grad_accum}, training.grad_accum); lower training.batch_size, "
            "training.grad_accum or training.pack_tokens, or add data"
        )
    return num_batches // grad_accum


def even_shards(items: list[Any], rank: int, world: int) -> list[tuple[Any, bool]]:
    """This rank's share of `items` as (item, counted), every rank the same length: under
    FSDP2 each forward all-gathers the weights on every rank, so a rank with one forward
    fewer would leave the others waiting. A short share repeats the first item, uncounted."""
    mine = [(item, True) for item in items[rank::world]]
    short = -(-len(items) // world) - len(mine)
    return mine + [(items[0], False)] * short if short else mine
