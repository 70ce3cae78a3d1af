"""Batched generation in the decoding runtime, for regenerating training data.

Throughput, not latency: many prompts at once, left-padded to one width. The
rows share RoPE positions, so a row padded by p tokens sees its prompt at
positions p..; RoPE attention depends only on distances, so that shift
changes nothing but rounding, and each row's padding is masked out as keys.
Rows that stop early keep stepping (their tokens are dropped) until every row
is done: one forward per step for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagletools.cpu_ops import argmax
from eagletools.decode.engine import Sampling
from eagletools.decode.model import Transformer

GREEDY = Sampling()


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling = GREEDY,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue each prompt (token ids) until EOS (kept) or `max_new_tokens`."""
    device = model.device
    b, width = len(prompts), max(len(p) for p in prompts)
    total = width + max_new_tokens
    model.setup_caches(b, total)
    model.cache_owner = None  # a batch-1 decoder must reallocate and prefill again
    ids = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    key_mask = torch.ones(b, total, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), device=device)
        key_mask[row, : width - len(prompt)] = False
    logits, _ = model(ids, torch.arange(width, device=device), 0, last_only=True, key_mask=key_mask)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    steps: list[torch.Tensor] = []
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        last = logits[:, -1]
        if sampling.greedy:
            tokens = argmax(last)
        else:
            tokens = torch.multinomial(sampling.probs(last), 1, generator=generator)[:, 0]
        steps.append(tokens)
        done |= torch.isin(tokens, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        pos = width + step
        positions = torch.tensor([pos], device=device)
        logits, _ = model(tokens[:, None], positions, pos, key_mask=key_mask)
    return [_cut_at_eos(row, eos_ids) for row in torch.stack(steps, dim=1).tolist()]


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """A row's tokens up to and including its first EOS."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens
