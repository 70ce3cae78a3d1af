"""Targets: load one (built-in name, HF folder, hub id, .gguf) and capture its aux hidden states."""

from eagletools.target.aux import AuxOutput, capture_aux, default_aux_layer_ids
from eagletools.target.load import (
    Target,
    TargetInfo,
    load_config,
    load_target,
    load_tokenizer,
    resolve_spec,
)

__all__ = [
    "AuxOutput",
    "Target",
    "TargetInfo",
    "capture_aux",
    "default_aux_layer_ids",
    "load_config",
    "load_target",
    "load_tokenizer",
    "resolve_spec",
]
