"""Checkpoint formats: one reader/writer per ecosystem, detection, validation.

`load_checkpoint` reads any of them into a `Checkpoint` (a `DraftConfig` and
tensors under the `eagle` key names); `save_checkpoint` writes one in any.
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
]
