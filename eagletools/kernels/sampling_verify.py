"""Lossless tree verification for sampling (temperature > 0), docs/design.md 3.6.

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

from eagletools.kernels.dispatch import lazy_jit, next_pow2, use_triton, verify_outputs

tl = None  # triton.language, bound by lazy_jit at the first launch


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
    if use_triton(tokens, parents, target_probs, uniforms):
        return verify_sampling_triton(tokens, parents, target_probs, uniforms)
    return verify_sampling_reference(tokens, parents, target_probs, uniforms)


def _verify_sampling_kernel(
    TOK, PAR, P, U, PATH, LEN, NEXT, n, V,
    s_tok, s_par, s_pb, s_pn, s_pv, s_u, s_path,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, SUB_V: tl.constexpr,
):  # fmt: skip
    # One program per tree. Each step reads the current node's row once (its
    # mass) and tries all its children in one vector op; the final draw finds
    # the block where the residual CDF crosses u * mass, then the token in it.
    b = tl.program_id(0).to(tl.int64)  # base offsets in int64 (docs/design.md)
    j = tl.arange(0, BLOCK_N)
    valid = j < n
    tok = tl.load(TOK + b * s_tok + j, mask=valid, other=-1)
    par = tl.load(PAR + b * s_par + j, mask=valid, other=-2)
    u = tl.load(U + b * s_u + j, mask=valid, other=1.0).to(tl.float64)
    same = (tok[:, None] == tok[None, :]) & (par[:, None] == par[None, :])
    dup = tl.max((same & (j[None, :] < j[:, None])).to(tl.int32), 1) > 0
    vv = tl.arange(0, BLOCK_V)
    cur = b * 0
    length = cur
    path = tl.where(j == 0, 0, -1).to(tl.int64)
    child = j < 0
    px = tl.zeros([BLOCK_N], tl.float64)
    total = tl.zeros([], tl.float64)
    go = cur == 0
    while go:
        row = P + b * s_pb + cur * s_pn
        total = tl.zeros([], tl.float64)
        for start in range(0, V, BLOCK_V):
            idx = start + vv
            total += tl.sum(tl.load(row + idx * s_pv, mask=idx < V, other=0.0).to(tl.float64))
        child = (par == cur) & valid
        px = tl.load(row + tok * s_pv, mask=child & ~dup, other=0.0).to(tl.float64)
        accept = child & (u * (total - (tl.cumsum(px, 0) - px)) < px)
        nxt = tl.min(tl.where(accept, j, BLOCK_N)).to(tl.int64)
        go = nxt < BLOCK_N
        length += go.to(tl.int64)
        path = tl.where(j == length, tl.where(go, nxt, path), path)
        cur = tl.where(go, nxt, cur)
    # every child of `cur` was rejected: draw from the rest of its row
    row = P + b * s_pb + cur * s_pn
    threshold = tl.load(U + b * s_u + n).to(tl.float64) * (total - tl.sum(px))
    seen = tl.zeros([], tl.float64)
    base = seen
    found = cur * 0 - 1
    for start in range(0, V, BLOCK_V):
        idx = start + vv
        mass = tl.sum(tl.load(row + idx * s_pv, mask=idx < V, other=0.0).to(tl.float64))
        mass -= tl.sum(tl.where((tok >= start) & (tok < start + BLOCK_V), px, 0.0))
        cross = (seen + mass > threshold) & (found < 0)
        found = tl.where(cross, start, found)
        base = tl.where(cross, seen, base)
        seen += mass
    sv = tl.arange(0, SUB_V)
    hit = found * 0 + V
    for s in range(0, BLOCK_V, SUB_V):
        idx = found + s + sv
        ok = idx < tl.where(found >= 0, V, 0)
        x = tl.load(row + idx * s_pv, mask=ok, other=0.0).to(tl.float64)
        rejected = tl.max(((idx[:, None] == tok[None, :]) & child[None, :]).to(tl.int32), 1) > 0
        x = tl.where(rejected, 0.0, x)
        cdf = base + tl.cumsum(x, 0)
        hit = tl.minimum(hit, tl.min(tl.where((cdf > threshold) & ok, idx, V)))
        base += tl.sum(x)
    tl.store(PATH + b * s_path + j, path, mask=valid)
    tl.store(LEN + b, length)
    tl.store(NEXT + b, tl.minimum(hit, V - 1))


_verify_sampling_jit = lazy_jit(_verify_sampling_kernel)


def verify_sampling_triton(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel; `out` = preallocated `(path, accept_len, next_token)`."""
    b, n = tokens.shape
    v = target_probs.shape[2]
    if out is None:
        out = verify_outputs(b, n, tokens.device)
    path, accept_len, next_token = out
    block_v = min(1024, next_pow2(v))
    _verify_sampling_jit()[(b,)](
        tokens, parents, target_probs, uniforms, path, accept_len, next_token, n, v,
        tokens.stride(0), parents.stride(0), *target_probs.stride(), uniforms.stride(0),
        path.stride(0), BLOCK_N=next_pow2(n), BLOCK_V=block_v, SUB_V=min(128, block_v),
    )  # fmt: skip
    return out
