"""Greedy tree verification: the longest root path whose every token is the
target's argmax at its parent, plus the bonus token (docs/design.md 3.6)."""

from __future__ import annotations

import torch

from eagletools.kernels.dispatch import lazy_jit, next_pow2, use_triton, verify_outputs

tl = None  # triton.language, bound by lazy_jit at the first launch


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
    if use_triton(tokens, parents, target_argmax):
        return verify_greedy_triton(tokens, parents, target_argmax)
    return verify_greedy_reference(tokens, parents, target_argmax)


def _verify_greedy_kernel(
    TOK, PAR, AM, PATH, LEN, BONUS, n, s_tok, s_par, s_am, s_path, BLOCK_N: tl.constexpr
):
    # One program per tree; the walk is sequential but each step is one vector op.
    b = tl.program_id(0).to(tl.int64)  # base offsets in int64 (docs/design.md)
    j = tl.arange(0, BLOCK_N)
    valid = j < n
    tok = tl.load(TOK + b * s_tok + j, mask=valid, other=-1)
    par = tl.load(PAR + b * s_par + j, mask=valid, other=-2)
    cur = b * 0
    length = cur
    path = tl.where(j == 0, 0, -1).to(tl.int64)
    for _ in range(1, n):
        want = tl.load(AM + b * s_am + cur)
        hit = (par == cur) & (tok == want)
        nxt = tl.min(tl.where(hit, j, BLOCK_N)).to(tl.int64)
        # once a step finds no child, none after it can (cur stays put)
        found = nxt < BLOCK_N
        length += found.to(tl.int64)
        path = tl.where(j == length, tl.where(found, nxt, path), path)
        cur = tl.where(found, nxt, cur)
    tl.store(PATH + b * s_path + j, path, mask=valid)
    tl.store(LEN + b, length)
    tl.store(BONUS + b, tl.load(AM + b * s_am + cur))


_verify_greedy_jit = lazy_jit(_verify_greedy_kernel)


def verify_greedy_triton(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_argmax: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel; `out` = preallocated `(path, accept_len, bonus)` (CUDA graphs)."""
    b, n = tokens.shape
    if out is None:
        out = verify_outputs(b, n, tokens.device)
    path, accept_len, bonus = out
    _verify_greedy_jit()[(b,)](
        tokens, parents, target_argmax, path, accept_len, bonus, n,
        tokens.stride(0), parents.stride(0), target_argmax.stride(0), path.stride(0),
        BLOCK_N=next_pow2(n),
    )  # fmt: skip
    return out
