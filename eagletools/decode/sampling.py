"""How the next token is drawn from the target's logits: greedy, or sampled after
temperature, top-k and top-p. One type for every generator (the decoders,
batched generation, regeneration), so a setting means the same everywhere."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from eagletools.cpu_ops import argmax
from eagletools.errors import UserError


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.

    `seed` and `max_new_tokens` are for callers that are handed the whole
    setting (regeneration); a decoder's `generate` takes its length and its
    random generator per call.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    _: KW_ONLY  # positional calls of the old regeneration order fail instead of misreading
    seed: int = 0
    max_new_tokens: int = 512

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UserError(
                f"sampling: need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1, got "
                f"{self.temperature}, {self.top_k}, {self.top_p}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] -> fp32 distribution after temperature, top-k, top-p (HF order)."""
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            probs = probs.masked_fill(probs < nucleus_floor(probs, self.top_p), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


GREEDY = Sampling()


def choose(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token of each row of logits [..., V]: [...] ids."""
    if sampling.greedy:
        return argmax(logits)
    probs = sampling.probs(logits)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.view(probs.shape[:-1])


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] -> [..., 1]: the least probability top-p keeps.

    In descending order a token is kept while the mass before it is at most
    `top_p`; ties of the last kept one are kept too, whatever their order.
    Tokens under (1 - top_p) / 2V hold less than 1 - top_p together, so the
    others reach past `top_p` and only they are sorted: a few hundred for a
    peaked distribution instead of the vocabulary. Should rounding leave a row
    short of `top_p`, the whole vocabulary is sorted.
    """
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    for least in ((1 - top_p) / (2 * vocab), 0.0):
        top = _descending_at_least(rows, least)
        past = top.cumsum(-1) - top > top_p  # mass before it already enough
        if least == 0 or bool(past.any(-1).all()):
            break
    # first dropped position; none (everything kept) points at the zero padding
    kept = torch.where(past.any(-1, keepdim=True), past.int().argmax(-1, keepdim=True), -1)
    return top.gather(-1, kept - (kept > 0).long()).view(*probs.shape[:-1], 1)


def _descending_at_least(rows: torch.Tensor, least: float) -> torch.Tensor:
    """[R, V] -> [R, n+1]: each row's values >= `least` in descending order, zero-padded."""
    keep = rows >= least
    counts = keep.sum(-1)
    values = rows[keep]
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=rows.device), counts)
    order = values.sort(descending=True, stable=True).indices
    order = order[row_of[order].sort(stable=True).indices]  # by row, descending within
    values, row_of = values[order], row_of[order]
    column = torch.arange(len(values), device=rows.device) - (counts.cumsum(0) - counts)[row_of]
    out = rows.new_zeros(len(rows), int(counts.max()) + 1)
    out[row_of, column] = values
    return out
