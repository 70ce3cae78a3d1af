"""The Llama-style decoder-layer fields both ecosystem configs share.

The `eagle` config is one at top level, the `speculators` config nests one as
`transformer_layer_config`; RoPE is either `rope_theta`/`rope_scaling`
(transformers 4) or `rope_parameters` (transformers 5): `target.rope_of` reads
both, and both are written, so either generation reads the same draft.
"""

from __future__ import annotations

import logging
from typing import Any

from eagletools.draft import DraftConfig
from eagletools.errors import UserError
from eagletools.targets import rope_of
from eagletools.targets.folder import rope_spellings

log = logging.getLogger(__name__)

LLAMA_DEFAULT_MAX_POSITIONS = 2048  # what LlamaConfig assumes when the field is absent


def read_layer_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """DraftConfig fields of the decoder layer, from a Llama-style config dict."""
    missing = [
        k
        for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        if cfg.get(k) is None
    ]
    if missing:
        raise UserError(f"{source}: missing field(s) {missing}")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise UserError(f"{source}: field {flag!r} is true; EAGLE-3 heads have no biases")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True):
        log.warning(
            "%s: field 'sliding_window' is %s: this draft attends to its last %s positions "
            "only, eagletools' drafts to the whole context, and what eagletools writes has no "
            "window; proposals past that length may differ (retrain without the window to "
            "match exactly)",
            source,
            window,
            window,
        )
    heads = cfg["num_attention_heads"]
    theta, scaling = rope_of(cfg)
    return dict(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        num_hidden_layers=cfg.get("num_hidden_layers", 1),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", LLAMA_DEFAULT_MAX_POSITIONS),
        hidden_act=cfg.get("hidden_act", "silu"),
    )


def write_layer_fields(c: DraftConfig) -> dict[str, Any]:
    """The Llama-style decoder-layer fields of `c` (vocab_size is the target's), RoPE in
    both spellings so that readers on either transformers generation get the same draft."""
    return dict(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        num_hidden_layers=c.num_hidden_layers,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        vocab_size=c.vocab_size,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        **rope_spellings(c.rope_theta, c.rope_scaling),
    )


def dtype_name(tensors: dict) -> str | None:
    """The float dtype of the weights, as configs spell it (`float16`, ...)."""
    for t in tensors.values():
        if t.dtype.is_floating_point:
            return str(t.dtype).removeprefix("torch.")
    return None


def aux_count(ids: list[int] | None, given: int | None = None) -> int:
    """How many aux states `fc` fuses: the ids, else a stated count, else 3 as engines assume.

    Never inferred from `fc`'s width: a checkpoint whose config leaves the
    engines to assume 3 must hold a 3-state `fc`, and the shape check says so.
    """
    return len(ids) if ids else given or 3


INPUT_NORM = "input_norm.weight"  # norm_before_fc's one norm (vLLM, speculators, llama.cpp)


def input_norm_problem(
    flag: bool, has_norm: bool, field: str, who: str = "vLLM"
) -> tuple[str, str] | None:
    """(what is wrong, the fix) when `norm_before_fc` as `who` reads it (from `field`) and
    its tensor disagree, else None. vLLM 0.32.0 drops `input_norm.*` unless the flag is on
    (models/llama_eagle3.py:464) and serves the draft without the norm, no error; the
    speculators package runs a missing `input_norm` at its initial ones."""
    if has_norm and not flag:
        return (
            f"the file holds {INPUT_NORM} but {field} is false or absent: read by {who}, "
            "it is a draft without the norm (vLLM serves it so, with no error)",
            f"set {field}: true (convert writes it for a draft trained with draft.norm_before_fc)",
        )
    if flag and not has_norm:
        return (
            f"{field} is true but the file has no {INPUT_NORM}: read by {who}, it needs a "
            "norm the file lacks (vLLM refuses to load it, the speculators package runs it at "
            "ones)",
            f"set {field}: false if the draft was trained without it, else re-export it "
            f"from the training checkpoint with its {INPUT_NORM}",
        )
    return None


def check_input_norm(flag: bool, tensors: dict, field: str, source: str, who: str) -> None:
    """Refuse a file whose `norm_before_fc` disagrees with its tensors (`input_norm_problem`)."""
    problem = input_norm_problem(flag, INPUT_NORM in tensors, field, who)
    if problem:
        raise UserError(f"{source}: {problem[0]}; {problem[1]}")


def read_json(path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_json(path, data: dict[str, Any]) -> None:
    import json

    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
