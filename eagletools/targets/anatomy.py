"""The one place that reads a target's config and module tree.

Every other module asks here for a target's RoPE, default aux layers,
decoder layers, final norm, embeddings and output head, so a new transformers
spelling or a new model layout is handled once.

RoPE is spelled two ways: transformers 5 keeps `rope_theta` and any scaling
in `rope_parameters` (and aliases `rope_scaling` to it on config objects);
transformers 4 and many config.json files have `rope_theta` beside an
optional `rope_scaling` whose type key may be the old `type`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from eagletools.errors import UserError

DEFAULT_ROPE_THETA = 10000.0  # what Llama-style configs assume when the field is absent


def text_config(config: Any) -> Any:
    """The language model's part of a config object or config.json dict."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def rope_of(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a config object or a raw config.json dict.

    Reads both spellings; the scaling comes back normalised (see
    `normalize_rope_scaling`), None for plain RoPE.
    """
    config = text_config(config)
    if isinstance(config, dict):
        get = config.get
    else:

        def get(key: str) -> Any:
            return getattr(config, key, None)

    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or get("rope_theta") or DEFAULT_ROPE_THETA
    return float(theta), normalize_rope_scaling(params)


def normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """`scaling` keyed `rope_type` (not the old `type`), without `rope_theta`; None
    for plain RoPE, so two spellings of one RoPE compare equal."""
    if not scaling:
        return None
    out = dict(scaling)
    if "type" in out:
        out.setdefault("rope_type", out.pop("type"))
    out.pop("rope_theta", None)
    return None if out.get("rope_type", "default") == "default" and len(out) <= 1 else out


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low, mid and high states: `[2, N//2, N-3]` (SGLang's default, HF indexing)."""
    if num_layers < 4:
        raise UserError(f"a target needs at least 4 decoder layers for EAGLE-3, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(chosen: Sequence[int] | None, num_layers: int) -> list[int]:
    """The layers a user chose, or the default for this depth when none (or an empty list)."""
    return list(chosen) if chosen else default_aux_layer_ids(num_layers)


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of a `*ForCausalLM` (or the stack itself): `.layers`, `.norm`."""
    base = getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(f"{type(model).__name__}: expected a decoder with .model.layers and .norm")
    return base


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return decoder(model).layers


def final_norm(model: nn.Module) -> nn.Module:
    """The norm after the last layer: HF hidden state N is its output."""
    return decoder(model).norm


def embed_tokens(model: nn.Module) -> nn.Embedding:
    return model.get_input_embeddings()


def lm_head(model: nn.Module) -> nn.Module:
    return model.get_output_embeddings()
