"""Checkpoint formats: one reader/writer per ecosystem, detection, validation.

`load_checkpoint` reads any readable one into a `Checkpoint` (a `DraftConfig`
and tensors under the `eagle` key names); `save_checkpoint` writes one in any,
`gguf` (llama.cpp) included, which is write-only. `sniff_format` tells which
format a folder or file holds, by content.
"""

from eagletools.formats.checkpoint import (
    FORMATS,
    Checkpoint,
    detect_format,
    fit_to_target,
    load_checkpoint,
    load_draft,
    parse_dtype,
    save_checkpoint,
    sniff_format,
)
from eagletools.formats.validate import Problem

__all__ = [
    "FORMATS",
    "Checkpoint",
    "Problem",
    "detect_format",
    "fit_to_target",
    "load_checkpoint",
    "load_draft",
    "parse_dtype",
    "save_checkpoint",
    "sniff_format",
]
