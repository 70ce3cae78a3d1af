"""The draft heads (EAGLE-3, P-EAGLE, DFlash) and their configuration."""

from eagletools.draft.config import DraftConfig
from eagletools.draft.dflash import DFlashDraft
from eagletools.draft.model import (
    DraftKVCache,
    Eagle3Draft,
    later_layer_name,
    split_later_layer_key,
)
from eagletools.draft.parallel import PEagleDraft

__all__ = [
    "DFlashDraft", "DraftConfig", "DraftKVCache", "Eagle3Draft", "PEagleDraft", "later_layer_name",
    "split_later_layer_key",
]  # fmt: skip
