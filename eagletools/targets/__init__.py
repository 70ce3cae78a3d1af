"""Targets: load one (built-in name, HF folder, hub id, .gguf), read its config and
module tree (`anatomy`), and capture its aux hidden states."""

from eagletools.targets.anatomy import (
    decoder_layers,
    default_aux_layer_ids,
    embed_tokens,
    final_norm,
    lm_head,
    normalize_rope_scaling,
    resolve_aux_layer_ids,
    rope_of,
)
from eagletools.targets.aux_states import AuxOutput, capture_aux
from eagletools.targets.load import (
    Target,
    TargetInfo,
    load_config,
    load_target,
    load_tokenizer,
    resolve_spec,
)
from eagletools.targets.summary import TargetSummary, load_target_summary

__all__ = [
    "AuxOutput",
    "Target",
    "TargetInfo",
    "TargetSummary",
    "capture_aux",
    "decoder_layers",
    "default_aux_layer_ids",
    "embed_tokens",
    "final_norm",
    "lm_head",
    "load_config",
    "load_target",
    "load_target_summary",
    "load_tokenizer",
    "normalize_rope_scaling",
    "resolve_aux_layer_ids",
    "resolve_spec",
    "rope_of",
]
