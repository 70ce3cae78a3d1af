"""Aux hidden states for EAGLE-3, captured with forward hooks.

Layer ids use Hugging Face `output_hidden_states` indexing (docs/design.md 3.1):
0 is the embedding output, k is the output of decoder layer k-1 (the input of
layer k), and N (the number of layers) is the final-norm output, as in
`hidden_states[N]`; the decode runtime returns the same state for every id.
Hooks keep only the requested states instead of all N+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagletools.errors import UserError
from eagletools.targets.anatomy import decoder, resolve_aux_layer_ids


@dataclass
class AuxOutput:
    aux: torch.Tensor  # [B, T, A*H], states concatenated in layer-id order
    last_hidden: torch.Tensor  # [B, T, H], after the final norm


@torch.no_grad()
def capture_aux(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layer_ids: list[int] | None = None,
    position_ids: torch.Tensor | None = None,
) -> AuxOutput:
    """One forward; `attention_mask` is [B,T] (padding), or None with `position_ids`
    that restart at each document of a packed row (Hugging Face masks each alone)."""
    base = decoder(model)
    n = len(base.layers)
    layer_ids = resolve_aux_layer_ids(layer_ids, n)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        raise UserError(
            f"aux layer ids {bad} out of range: a target with {n} layers has HF hidden-state "
            f"indices 0..{n} (0 = embeddings, k = output of decoder layer k-1)"
        )
    captured: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    modules = {0: base.embed_tokens, n: base.norm}  # N: the final norm's output
    handles = [
        (modules[i] if i in modules else base.layers[i - 1]).register_forward_hook(keep(i))
        for i in sorted(set(layer_ids))
    ]
    try:
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return AuxOutput(aux=aux, last_hidden=out.last_hidden_state)
