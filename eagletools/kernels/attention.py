"""Tree attention for verification: N tree nodes attend over the cached prefix
and their own ancestors (docs/design.md 3.6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagletools.kernels.dispatch import (
    cdiv,
    interpreting,
    lazy_jit,
    next_pow2,
    target_arch,
    use_triton,
)

tl = None  # triton.language, bound by lazy_jit at the first launch


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int | torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of `q [B,Hq,N,D]` over cache slots `< prefix_len + N`.

    The nodes' own K/V already sit at slots `prefix_len..prefix_len+N-1` of
    `k_cache`/`v_cache [B,Hkv,S_max,D]`; the prefix is fully visible, the tree
    part follows `tree_mask [N,N]` (True = query may see key: ancestor-or-self).
    GQA maps query head h to KV head `h // (Hq // Hkv)`. SDPA accumulates in
    fp32 for half inputs. `prefix_len` may be a 0-d device tensor, which the
    kernel reads on the device so that a captured CUDA graph replays with new
    lengths.
    """
    prefix_len = int(prefix_len)
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
    prefix_len: int | torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`tree_attention_reference`, by the Triton kernel on CUDA."""
    on_device = (prefix_len,) if isinstance(prefix_len, torch.Tensor) else ()
    if use_triton(q, k_cache, v_cache, tree_mask, *on_device):
        return tree_attention_triton(q, k_cache, v_cache, prefix_len, tree_mask, scale)
    return tree_attention_reference(q, k_cache, v_cache, prefix_len, tree_mask, scale)


def _tree_attention_kernel(
    Q, K, V, MASK, OUT, WS_O, WS_L, PREFIX, n, split_keys, scale_log2e,
    s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd, s_ob, s_oh, s_on, s_od, s_mq, s_mk,
    H_KV, GROUP: tl.constexpr, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    PREFIX_IN_MEMORY: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    # Flash attention with the GQA group's query heads stacked as rows
    # (row r = head offset r // n, node r % n), so each K/V block is read once
    # per group; online softmax in fp32, exp2 with the scale folded in. With
    # SPLIT, program axis 2 takes one range of split_keys keys and leaves its
    # partial output and log2-sum-exp for _combine_kernel (flash-decoding).
    # a prefix length read on the device lets CUDA graphs replay with new lengths
    prefix_len = tl.load(PREFIX).to(tl.int32) if PREFIX_IN_MEMORY else PREFIX
    pid_m = tl.program_id(0)
    # int64 base offsets: b * s_kb passes 2^31 on large caches (docs/design.md)
    b = tl.program_id(1).to(tl.int64) // H_KV
    hk = tl.program_id(1).to(tl.int64) % H_KV
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    node = r % n
    head = hk * GROUP + r // n
    row_ok = r < GROUP * n
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_ptr = Q + b * s_qb + head[:, None] * s_qh + node[:, None] * s_qn + d[None, :] * s_qd
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.program_id(2) * split_keys
    hi = tl.minimum(prefix_len + n, lo + split_keys)
    for start in range(lo, hi, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        c_ok = c < hi
        k = tl.load(
            k_base + c[None, :] * s_ks + d[:, None] * s_kd,
            mask=c_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2e
        t = c - prefix_len  # index of the key in the tree, < 0 in the prefix
        in_tree = (t >= 0) & c_ok
        tree_ok = tl.load(
            MASK + node[:, None] * s_mq + t[None, :] * s_mk,
            mask=row_ok[:, None] & in_tree[None, :],
            other=0,
        )
        visible = ((t < 0)[None, :] | (tree_ok != 0)) & c_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + c[:, None] * s_vs + d[None, :] * s_vd,
            mask=c_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        p = p.to(V.dtype.element_ty)
        if DOT_F32:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:
        ws = ((tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * GROUP * n + r).to(
            tl.int64
        )
        seen = l_i > 0  # a key range may hold only tree nodes a row cannot see
        l_safe = tl.where(seen, l_i, 1.0)
        tl.store(WS_L + ws, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)
        tl.store(
            WS_O + ws[:, None] * BLOCK_D + d[None, :], acc / l_safe[:, None], mask=row_ok[:, None]
        )
    else:
        out = acc / l_i[:, None]
        o_ptr = OUT + b * s_ob + head[:, None] * s_oh + node[:, None] * s_on + d[None, :] * s_od
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _combine_kernel(
    WS_O, WS_L, OUT, n, splits, s_ob, s_oh, s_on, s_od,
    H_KV, GROUP: tl.constexpr, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Merge the key ranges' partial outputs, weighted by their sum-exp.
    b = tl.program_id(1).to(tl.int64) // H_KV
    hk = tl.program_id(1).to(tl.int64) % H_KV
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < GROUP * n
    d = tl.arange(0, BLOCK_D)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(splits):
        ws = (split * tl.num_programs(1) + tl.program_id(1)) * GROUP * n + r
        top = tl.maximum(top, tl.load(WS_L + ws, mask=row_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for split in range(splits):
        ws = ((split * tl.num_programs(1) + tl.program_id(1)) * GROUP * n + r).to(tl.int64)
        w = tl.exp2(tl.load(WS_L + ws, mask=row_ok, other=float("-inf")) - top)
        part = tl.load(WS_O + ws[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None], other=0.0)
        acc += w[:, None] * part
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    node = r % n
    head = hk * GROUP + r // n
    o_ptr = OUT + b * s_ob + head[:, None] * s_oh + node[:, None] * s_on + d[None, :] * s_od
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (d < D)[None, :])


_tree_attention_jit = lazy_jit(_tree_attention_kernel)
_combine_jit = lazy_jit(_combine_kernel)


def _num_splits(programs: int, keys: int, device: torch.device) -> int:
    """Key ranges per row block: enough programs for every SM, >= 512 keys each."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(cdiv(2 * sms, programs), keys // 512))


def _tiles(arch: int, element_size: int, rows: int, d: int) -> tuple[int, int, int, int]:
    """`(BLOCK_M, BLOCK_N, BLOCK_D, num_warps)` on `sm_<arch>` (0: the interpreter).

    Checked per arch by `kernels.aot` (docs/design.md 3.7). fp32 at 64 rows x 64 keys
    x 128 needs 180,736 B of shared memory, over every block limit but sm_90/100's:
    32 x 32. bf16/fp16 at 64 x 64 need 245-255 registers a thread: sm_90/100 hold
    them, sm_80 and sm_120 spill 8-40 B; 32 keys a step take ~180 there.
    """
    wide = element_size > 2
    block_m = min(32 if wide else 64, next_pow2(rows, floor=16))
    block_d = next_pow2(d, floor=16)
    block_n = 64 if not wide and arch in (90, 100) else 32
    # 4 warps spill at the largest tiles
    warps = 8 if block_m * block_d * element_size >= 64 * 128 * 2 else 4
    return block_m, block_n, block_d, warps


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int | torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The Triton kernel; `out` = a preallocated `[B,Hq,N,D]` output (CUDA graphs).

    Long prefixes at small batch split the keys over more programs (a second,
    small launch merges them); `num_splits` overrides the choice.
    """
    b, hq, n, d = q.shape
    h_kv = k_cache.shape[1]
    group = hq // h_kv
    if out is None:
        out = torch.empty_like(q)
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    rows = group * n
    block_m, block_n, block_d, warps = _tiles(target_arch(), q.element_size(), rows, d)
    grid = (cdiv(rows, block_m), b * h_kv)
    # a device prefix is unknown here: split the cache's capacity, empty ranges cost nothing
    keys = k_cache.shape[2] if isinstance(prefix_len, torch.Tensor) else prefix_len + n
    splits = num_splits or _num_splits(grid[0] * grid[1], keys, q.device)
    split_keys = cdiv(cdiv(keys, splits), block_n) * block_n
    splits = cdiv(keys, split_keys)
    if splits == 1:
        split_keys = k_cache.shape[2]  # >= prefix_len + n, whatever its value on the device
        ws_o = ws_l = out
    else:
        ws_o = torch.empty(splits, b * h_kv, rows, block_d, device=q.device)
        ws_l = torch.empty(splits, b * h_kv, rows, device=q.device)
    _tree_attention_jit()[(*grid, splits)](
        q, k_cache, v_cache, mask, out, ws_o, ws_l, prefix_len, n, split_keys,
        scale * 1.4426950408889634,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *mask.stride(),
        h_kv, group, d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 or interpreting() else "tf32",
        DOT_F32=interpreting(),
        PREFIX_IN_MEMORY=isinstance(prefix_len, torch.Tensor), SPLIT=splits > 1,
        num_warps=warps,
    )  # fmt: skip
    if splits > 1:
        _combine_jit()[grid](
            ws_o, ws_l, out, n, splits, *out.stride(), h_kv, group, d,
            BLOCK_M=block_m, BLOCK_D=block_d,
        )  # fmt: skip
    return out
