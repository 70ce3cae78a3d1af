"""KV compaction: after verification, move the accepted nodes' K/V entries to
contiguous slots so the cache stays a dense prefix (design notes 3.6)."""

from __future__ import annotations

import torch


def compact_kv_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int
) -> None:
    """In place, `cache[b, :, dst_start + i] = cache[b, :, src_slots[b, i]]`.

    Caches are `[B,Hkv,S_max,D]`, `src_slots [B,n]` int64. A negative slot
    leaves its destination unchanged (rows of a batch accept different
    lengths). Sources are read before any destination is written; the kernel
    copies in order of i, which agrees whenever `src_slots[b, i] >= dst_start + i`
    for increasing sources (an accepted path always is).
    """
    b, h, _, d = k_cache.shape
    n = src_slots.shape[1]
    keep = (src_slots >= 0)[:, None, :, None]
    idx = src_slots.clamp(min=0)[:, None, :, None].expand(b, h, n, d)
    for cache in (k_cache, v_cache):
        moved = cache.gather(2, idx)
        dst = cache[:, :, dst_start : dst_start + n]
        dst.copy_(torch.where(keep, moved, dst))


def compact_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int
) -> None:
    """`compact_kv_reference`, as one Triton launch on CUDA."""
    compact_kv_reference(k_cache, v_cache, src_slots, dst_start)
