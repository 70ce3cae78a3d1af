"""Sequence packing (training.pack_tokens): several conversations per row, each alone.

A packed row holds conversations end to end; `documents` [B,T] says which of
its row's conversations each token belongs to (0, 1, ...; -1 at padding).
Every consumer sees each conversation as if it were alone in its row: RoPE
positions restart at each document (`document_positions`), the draft attends
within a document only (`document_mask`), the target too (Hugging Face masks
each of its layers from the restarting positions, sliding windows included),
and the training-time test never teaches across a boundary (`within_document`).

The plan of an epoch is a pure function of (seed, epoch, lengths, sizes), as
`train.data.plan_epoch`'s is, so a resumed run skips to the exact global batch
it stopped at.
"""

from __future__ import annotations

import torch


def document_mask(documents: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Block-diagonal causal mask: documents [B,S] -> bool [B, S-start, S].

    Query t (start <= t < S) may see key s iff s <= t and both lie in one document.
    `start` gives the rows of a query chunk (the draft's chunked attention); the
    whole mask is `document_mask(documents)`. Padding (-1) sees the padding before
    it, so no query row is empty.
    """
    s = documents.shape[-1]
    rows = torch.arange(start, s, device=documents.device).unsqueeze(-1)
    causal = torch.arange(s, device=documents.device) <= rows  # [S-start, S]
    same = documents[:, start:].unsqueeze(-1) == documents.unsqueeze(-2)
    return causal & same


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """documents [B,T] -> each token's position within its document [B,T]."""
    t = documents.shape[-1]
    index = torch.arange(t, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def within_document(documents: torch.Tensor, n: int) -> torch.Tensor:
    """[B,T] true at t where token t+n lies in t's document (false past the row)."""
    out = torch.zeros_like(documents, dtype=torch.bool)
    out[:, : documents.shape[1] - n] = documents[:, n:] == documents[:, : documents.shape[1] - n]
    return out


def first_fit(order: list[int], lengths: list[int], pack_tokens: int) -> list[list[int]]:
    """Rows of at most `pack_tokens` tokens: the samples longest first (ties in `order`),
    each into the first row with room; a sample longer than a row fills one alone."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(order, key=lambda i: -min(lengths[i], pack_tokens)):
        n = min(lengths[i], pack_tokens)
        row = next((r for r, free in enumerate(room) if free >= n), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(pack_tokens)
        rows[row].append(i)
        room[row] -= n
    return rows


def plan_packed_epoch(
    lengths: list[int], global_batch: int, pack_tokens: int, seed: int, epoch: int,
    bucket_size: int,
) -> list[list[list[int]]]:  # fmt: skip
    """Global batches of `global_batch` rows (lists of positions into `lengths`).

    Shuffle, cut into buckets of `global_batch * bucket_size` samples, pack each
    bucket first-fit (so rows differ between epochs), then shuffle the rows. The
    last incomplete global batch is dropped, so every step has the same row count.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    span = global_batch * bucket_size
    rows = []
    for start in range(0, len(order), span):
        rows += first_fit(order[start : start + span], lengths, pack_tokens)
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    return [
        rows[i : i + global_batch] for i in range(0, len(rows) - global_batch + 1, global_batch)
    ]
