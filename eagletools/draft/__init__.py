"""The EAGLE-3 draft head and its configuration."""

from eagletools.draft.config import DraftConfig
from eagletools.draft.model import DraftKVCache, Eagle3Draft

__all__ = ["DraftConfig", "DraftKVCache", "Eagle3Draft"]
