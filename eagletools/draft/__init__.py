"""The EAGLE-3 draft head and its configuration."""

from eagletools.draft.config import DraftConfig
from eagletools.draft.model import (
    DraftKVCache,
    Eagle3Draft,
    later_layer_name,
    split_later_layer_key,
)

__all__ = [
    "DraftConfig", "DraftKVCache", "Eagle3Draft", "later_layer_name", "split_later_layer_key",
]  # fmt: skip
