"""Aux hidden states for EAGLE-3, captured with forward hooks.

Layer ids use Hugging Face `output_hidden_states` indexing (docs/design.md 3.1):
0 is the embedding output, k is the output of decoder layer k-1, and N (the
number of layers) is the final-norm output, as in `hidden_states[N]`. Hooks
keep only the requested states instead of all N+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagletools.errors import UserError


@dataclass
class AuxOutput:
    aux: torch.Tensor  # [B, T, A*H], states concatenated in layer-id order
    last_hidden: torch.Tensor  # [B, T, H], after the final norm


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low, mid and high states: `[2, N//2, N-3]` (SGLang's default, HF indexing)."""
    if num_layers < 4:
        raise UserError(f"a target needs at least 4 decoder layers for EAGLE-3, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(f"{type(model).__name__}: expected a decoder with .model.layers and .norm")
    return base


@torch.no_grad()
def capture_aux(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layer_ids: list[int] | None = None,
) -> AuxOutput:
    base = _base_model(model)
    n = len(base.layers)
    layer_ids = list(layer_ids) if layer_ids is not None else default_aux_layer_ids(n)
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

    modules = {0: base.embed_tokens, n: base.norm}
    handles = [
        (modules[i] if i in modules else base.layers[i - 1]).register_forward_hook(keep(i))
        for i in sorted(set(layer_ids))
    ]
    try:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return AuxOutput(aux=aux, last_hidden=out.last_hidden_state)
