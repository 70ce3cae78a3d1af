"""Random tree inputs shared by the kernel tests."""

from __future__ import annotations

import math

import torch


def random_tree(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """`parents [B,N]`: root -1, every other node a random earlier parent."""
    parents = torch.empty(batch, n, dtype=torch.long)
    parents[:, 0] = -1
    for j in range(1, n):
        parents[:, j] = torch.randint(0, j, (batch,), generator=gen)
    return parents


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """`[N,N]` ancestor-or-self mask of one tree."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for j in range(1, n):
        mask[j] |= mask[parents[j]]
    return mask


def greedy_inputs(batch: int, n: int, vocab: int, gen: torch.Generator):
    """Trees whose argmax often picks one of a node's children, so paths get long."""
    parents = random_tree(batch, n, gen)
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    target_argmax = torch.randint(0, vocab, (batch, n), generator=gen)
    follow = torch.rand(batch, n, generator=gen) < 0.8
    for b in range(batch):
        for j in range(n):
            kids = (parents[b] == j).nonzero().flatten()
            if len(kids) and follow[b, j]:
                pick = kids[torch.randint(0, len(kids), (1,), generator=gen)]
                target_argmax[b, j] = tokens[b, pick]
    return tokens, parents, target_argmax


def sampling_inputs(batch: int, n: int, vocab: int, gen: torch.Generator, dtype=torch.float32):
    """Peaked target distributions where drafted children carry most of the mass."""
    tokens, parents, _ = greedy_inputs(batch, n, vocab, gen)
    logits = torch.randn(batch, n, vocab, generator=gen) * 2
    for j in range(n):
        kids = parents == j
        boost = torch.zeros(batch, vocab).scatter_add_(
            1, tokens, kids.float() * (2 + math.log(vocab))
        )
        logits[:, j] += boost
    probs = logits.softmax(-1).to(dtype)
    uniforms = torch.rand(batch, n + 1, generator=gen)
    return tokens, parents, probs, uniforms
