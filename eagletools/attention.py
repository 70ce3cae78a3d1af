"""Causal attention over a long run of new tokens through SDPA's fused kernels,
shared by the target runtime and the draft (docs/design.md 3.7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The T queries as the last T of the S keys, each seeing the keys up to itself,
    through SDPA's fused kernels at any length.

    A boolean mask keeps flash attention out, and with `enable_gqa` CUDA's
    memory-efficient kernel too, leaving the math kernel and its full [Hq,T,S]
    scores (8.6 GB a layer for an 8k prompt at 8B widths). An empty prefix needs
    no mask (`is_causal`); after a prefix, queries go in chunks whose masks stay
    small, with K/V expanded to the query heads where GQA would block the kernel.
    """
    t, s = q.shape[2], k.shape[2]
    if t == 1 or s == t:  # one query sees every key; no prefix: plain causal
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
    k, v = heads_for_mask(q, k), heads_for_mask(q, v)
    out = torch.empty_like(q)
    for r0 in range(0, t, CAUSAL_CHUNK):
        r1 = min(t, r0 + CAUSAL_CHUNK)
        end = s - t + r1
        mask = torch.ones(r1 - r0, end, dtype=torch.bool, device=q.device).tril(s - t + r0)
        out[:, :, r0:r1] = F.scaled_dot_product_attention(
            q[:, :, r0:r1], k[:, :, :end], v[:, :, :end], attn_mask=mask,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
    return out


CAUSAL_CHUNK = 1024  # queries a masked SDPA call takes after a prefix: its mask is [1024, S]


def heads_for_mask(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """K or V with one head per query head where a long masked call needs it (CUDA: the
    memory-efficient kernel takes a mask but not GQA); CPU's flash kernel takes both, and
    a few queries' scores are small (decoding steps keep the cache unexpanded)."""
    group = q.shape[1] // kv.shape[1]
    if group == 1 or q.device.type == "cpu" or q.shape[2] <= 64:
        return kv
    return kv.repeat_interleave(group, dim=1)
