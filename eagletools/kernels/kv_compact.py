"""KV compaction: after verification, move the accepted nodes' K/V entries to
contiguous slots so the cache stays a dense prefix (docs/design.md 3.6)."""

from __future__ import annotations

import torch

from eagletools.kernels.dispatch import lazy_jit, next_pow2, use_triton

tl = None  # triton.language, bound by lazy_jit at the first launch


def compact_kv_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int
) -> None:
    """In place, `cache[..., b, :, dst_start + i] = cache[..., b, :, src_slots[b, i]]`.

    Caches are `[B,Hkv,S_max,D]`, or every layer's stacked `[L,B,Hkv,S_max,D]`
    (contiguous over L and B): all layers move by the same slots, in one op
    rather than one per layer. `src_slots [B,n]` int64. A negative slot
    leaves its destination unchanged (rows of a batch accept different
    lengths). Sources are read before any destination is written; the kernel
    copies in order of i, which agrees whenever `src_slots[b, i] >= dst_start + i`
    for increasing sources (an accepted path always is).
    """
    k, v = _rows(k_cache), _rows(v_cache)
    rows, h, _, d = k.shape
    src = src_slots.repeat(rows // src_slots.shape[0], 1)  # row r = (layer, r % B)
    n = src.shape[1]
    keep = (src >= 0)[:, None, :, None]
    idx = src.clamp(min=0)[:, None, :, None].expand(rows, h, n, d)
    for cache in (k, v):
        moved = cache.gather(2, idx)
        dst = cache[:, :, dst_start : dst_start + n]
        dst.copy_(torch.where(keep, moved, dst))


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """`[..., B, Hkv, S, D]` as `[rows, Hkv, S, D]`, a view (a copy would lose the writes)."""
    return cache.view(-1, *cache.shape[-3:])


def compact_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int
) -> None:
    """`compact_kv_reference`, as one Triton launch on CUDA."""
    if use_triton(k_cache, v_cache, src_slots):
        compact_kv_triton(k_cache, v_cache, src_slots, dst_start)
    else:
        compact_kv_reference(k_cache, v_cache, src_slots, dst_start)


def _compact_kv_kernel(
    K, V, SRC, n, batch, dst_start,
    s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd, s_src,
    D, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per (layer x batch row, kv head), copying in order of i: a source
    # is never a destination written earlier, since src_slots[i] >= dst_start + i.
    # int64: with every layer stacked, b * s_kb passes 2^31 at 8B-70B cache sizes
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    src_row = SRC + (b % batch) * s_src
    d = tl.arange(0, BLOCK_D)
    k_row = K + b * s_kb + h * s_kh + d * s_kd
    v_row = V + b * s_vb + h * s_vh + d * s_vd
    for i in range(n):
        src = tl.load(src_row + i)
        m = d < tl.where(src >= 0, D, 0)  # a negative slot copies nothing
        dst = dst_start + i
        tl.store(k_row + dst * s_ks, tl.load(k_row + src * s_ks, mask=m), mask=m)
        tl.store(v_row + dst * s_vs, tl.load(v_row + src * s_vs, mask=m), mask=m)


_compact_kv_jit = lazy_jit(_compact_kv_kernel)


def compact_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int
) -> None:
    k, v = _rows(k_cache), _rows(v_cache)
    rows, h, _, d = k.shape
    _compact_kv_jit()[(rows, h)](
        k, v, src_slots, src_slots.shape[1], src_slots.shape[0], dst_start,
        *k.stride(), *v.stride(), src_slots.stride(0),
        d, BLOCK_D=next_pow2(d),
    )  # fmt: skip
