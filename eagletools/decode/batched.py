"""Batched generation in the decoding runtime, for regenerating training data.

Throughput, not latency: many prompts at once, left-padded to one width. The
rows share RoPE positions, so a row padded by p tokens sees its prompt at
positions p..; RoPE attention depends only on distances, so that shift
changes nothing but rounding, and each row's padding is masked out as keys.
Rows that stop early keep stepping (their tokens are dropped) until every row
is done: one forward per step for the whole batch.

The same forwards can return hidden states at chosen layers: what the
offline cache would otherwise compute in a second pass over the replies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagletools.decode.model import Transformer
from eagletools.decode.sampling import GREEDY, Sampling, choose


@dataclass
class Generated:
    tokens: list[list[int]]  # each row's new tokens, up to and including its first EOS
    # with `state_layer_ids`: each row's states [n, len(state_layer_ids)*H] over its prompt and
    # the new tokens the model read back; n is len(prompt) + len(tokens), or one less when
    # the row's last token ended the loop before it was read
    states: list[torch.Tensor] | None = None


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling = GREEDY,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    state_layer_ids: Sequence[int] = (),
    prefill_chunk: int = 512,
) -> Generated:
    """Continue each prompt (token ids) until EOS (kept) or `max_new_tokens`; with
    `state_layer_ids` (HF indexing, as `Transformer.forward`), keep those hidden states
    in bf16 on the way.

    The prompts are read `prefill_chunk` columns a forward: a padded batch needs its
    own [B, T, S] attention mask, which for 48 prompts of 4k tokens read at once
    (S = T + 256 new tokens) would be 850 MB (more where SDPA widens it), and
    110 MB in chunks of 512."""
    device = model.device
    b, width = len(prompts), max(len(p) for p in prompts)
    total = width + max_new_tokens
    model.setup_caches(b, total)  # a batch-1 decoder must prefill again (a new cache version)
    ids = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    key_mask = torch.ones(b, total, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), device=device)
        key_mask[row, : width - len(prompt)] = False
    kept = []
    for start in range(0, width, prefill_chunk):
        end = min(start + prefill_chunk, width)
        logits, states = model(ids[:, start:end], torch.arange(start, end, device=device),
                               start, last_only=True, key_mask=key_mask,
                               aux_layer_ids=state_layer_ids)  # fmt: skip
        if states is not None:
            kept.append(states.to(torch.bfloat16))
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    steps: list[torch.Tensor] = []
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        tokens = choose(logits[:, -1], sampling, generator)
        steps.append(tokens)
        done |= torch.isin(tokens, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        pos = width + step
        positions = torch.tensor([pos], device=device)
        logits, states = model(tokens[:, None], positions, pos, key_mask=key_mask,
                               aux_layer_ids=state_layer_ids)  # fmt: skip
        if states is not None:
            kept.append(states.to(torch.bfloat16))
    tokens = [_cut_at_eos(row, eos_ids) for row in torch.stack(steps, dim=1).tolist()]
    if not kept:
        return Generated(tokens)
    every = torch.cat(kept, dim=1).cpu()  # [B, width + steps read, A*H], one copy
    return Generated(tokens, [
        every[row, width - len(prompt) : width + len(new)].clone()
        for row, (prompt, new) in enumerate(zip(prompts, tokens, strict=True))
    ])  # fmt: skip


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """A row's tokens up to and including its first EOS."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens
