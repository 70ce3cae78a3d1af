"""Lossless tree verification for sampling (temperature > 0), design notes 3.6.

Drafts are deterministic top-k, so each child is a point mass: at a node with
target distribution p, children are tried in index order (the tree builder
puts siblings in score order), child x is accepted with probability
p(x) / (mass left), a rejected x gets p(x) = 0; when no child is accepted the
next token is drawn from what is left. The output is distributed exactly as
plain sampling from the target. The randoms are inputs, so the reference and
the kernel make the same draws; decisions are taken in fp64 so that summation
order does not flip them.
"""

from __future__ import annotations

import torch


def _child_probs(tokens, parents, probs_rows, cur, dup_earlier):
    """Children of `cur [B]` and their target probability (0 for repeated tokens)."""
    child = parents == cur[:, None]
    px = torch.where(child & ~dup_earlier, probs_rows.gather(1, tokens), 0.0)
    return child, px


def verify_sampling_reference(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a root path of each tree `[B,N]` by rejection sampling.

    `target_probs [B,N,V]` is the target's (temperature / top-k / top-p
    processed) distribution after each node; `uniforms [B,N+1]` in [0, 1):
    column j (1 <= j < N) decides node j, column N draws the final token,
    column 0 is unused. Returns `path [B,N]` (padded -1), `accept_len [B]`
    (drafts accepted) and `next_token [B]` (drawn at the last accepted node).
    """
    b, n = tokens.shape
    idx = torch.arange(n, device=tokens.device)
    rows = torch.arange(b, device=tokens.device)
    u = uniforms.double()
    # a child repeating an earlier sibling's token has p = 0 once that one is rejected
    same = (tokens[:, :, None] == tokens[:, None, :]) & (idx[None, :] < idx[:, None])
    dup_earlier = (same & (parents[:, :, None] == parents[:, None, :])).any(-1)
    cur = torch.zeros(b, dtype=torch.long, device=tokens.device)
    accept_len = torch.zeros(b, dtype=torch.long, device=tokens.device)
    path = torch.full((b, n), -1, dtype=torch.long, device=tokens.device)
    path[:, 0] = 0
    active = torch.ones(b, dtype=torch.bool, device=tokens.device)
    while True:
        p = target_probs[rows, cur].double()
        child, px = _child_probs(tokens, parents, p, cur, dup_earlier)
        mass_left = p.sum(-1, keepdim=True) - (px.cumsum(1) - px)
        accept = child & (u[:, :n] * mass_left < px) & active[:, None]
        advanced = accept.any(1)
        if not advanced.any():
            break
        first = torch.where(accept, idx, n).argmin(1)
        accept_len += advanced
        path[rows[advanced], accept_len[advanced]] = first[advanced]
        cur = torch.where(advanced, first, cur)
        active &= advanced
    residual = target_probs[rows, cur].double()
    child, _ = _child_probs(tokens, parents, residual, cur, dup_earlier)
    rejected = torch.zeros(residual.shape, dtype=torch.int32, device=tokens.device)
    rejected.scatter_add_(1, tokens, child.int())
    cdf = residual.masked_fill(rejected > 0, 0.0).cumsum(-1)
    threshold = u[:, n : n + 1] * cdf[:, -1:]
    next_token = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    return path, accept_len, next_token.clamp(max=residual.shape[1] - 1)


def verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_sampling_reference`, as one Triton launch on CUDA."""
    return verify_sampling_reference(tokens, parents, target_probs, uniforms)
