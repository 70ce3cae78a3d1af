"""Draft top-k over the draft vocabulary, then the `d2t` offset to target ids
(docs/design.md 3.6: map after the top-k, never scatter into the target vocab)."""

from __future__ import annotations

import torch

from eagletools.kernels.dispatch import lazy_jit, next_pow2, use_triton

tl = None  # triton.language, bound by lazy_jit at the first launch


def topk_d2t_reference(
    logits: torch.Tensor, d2t: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `log_softmax(logits [M,Vd])` with ids mapped `i + d2t[i]`.

    Returns `logprobs [M,k]` (fp32, descending) and `target_ids [M,k]` int64;
    `d2t=None` is the identity (draft vocab = target vocab).
    """
    values, ids = logits.topk(k, dim=-1)
    # log-sum-exp around the top-1 we already have (torch.logsumexp's own max
    # pass is slow on CPU for one row), exp in place: one [M,Vd] buffer fewer
    top = values[:, :1].float()
    logprobs = values.float() - top - (logits.float() - top).exp_().sum(-1, keepdim=True).log()
    if d2t is not None:
        ids = ids + d2t[ids]
    return logprobs, ids


def topk_d2t(
    logits: torch.Tensor, d2t: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_d2t_reference`, as one Triton launch on CUDA."""
    if use_triton(logits, *([] if d2t is None else [d2t])):
        return topk_d2t_triton(logits, d2t, k)
    return topk_d2t_reference(logits, d2t, k)


def _topk_d2t_kernel(
    X, D2T, LP, IDS, V, k, s_x, s_lp, s_ids,
    HAS_D2T: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # One program per row, k passes over it: pass r finds the largest logit
    # ordered after the previous pick (value descending, then index ascending),
    # so k small (draft top-k, or the argmax) costs k reads from L2, no sort.
    # The first pass also folds the log-sum-exp in, online.
    m = tl.program_id(0).to(tl.int64)  # row offsets pass 2^31 at 128k-vocab sizes
    row = X + m * s_x
    offs = tl.arange(0, BLOCK_V)
    kk = tl.arange(0, K_PAD)
    top_v = tl.full([K_PAD], float("-inf"), tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int32)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.zeros([], tl.float32)
    for r in range(k):
        best_v = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 2147483647, tl.int32)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            if r == 0:
                new_max = tl.maximum(run_max, tl.max(x))
                run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max))
                run_max = new_max
            after = (idx < V) & ((x < prev_v) | ((x == prev_v) & (idx > prev_i)))
            cand = tl.where(after, x, float("-inf"))
            bv = tl.max(cand)
            bi = tl.min(tl.where(after & (cand == bv), idx, 2147483647))
            better = (bv > best_v) | ((bv == best_v) & (bi < best_i))
            best_v = tl.where(better, bv, best_v)
            best_i = tl.where(better, bi, best_i)
        top_v = tl.where(kk == r, best_v, top_v)
        top_i = tl.where(kk == r, best_i, top_i)
        prev_v = best_v
        prev_i = best_i
    keep = kk < k
    ids = top_i.to(tl.int64)
    if HAS_D2T:
        ids += tl.load(D2T + top_i, mask=keep, other=0)
    tl.store(LP + m * s_lp + kk, top_v - (run_max + tl.log(run_sum)), mask=keep)
    tl.store(IDS + m * s_ids + kk, ids, mask=keep)


_topk_d2t_jit = lazy_jit(_topk_d2t_kernel)


def topk_d2t_triton(
    logits: torch.Tensor,
    d2t: torch.Tensor | None,
    k: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; ties go to the lower draft id. `out` = `(logprobs, target_ids)`."""
    m, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = (
            torch.empty(m, k, dtype=torch.float32, device=logits.device),
            torch.empty(m, k, dtype=torch.long, device=logits.device),
        )
    logprobs, ids = out
    _topk_d2t_jit()[(m,)](
        logits, logits if d2t is None else d2t, logprobs, ids, v, k,
        logits.stride(0), logprobs.stride(0), ids.stride(0),
        HAS_D2T=d2t is not None, K_PAD=next_pow2(k), BLOCK_V=min(4096, next_pow2(v)),
    )  # fmt: skip
    return out
