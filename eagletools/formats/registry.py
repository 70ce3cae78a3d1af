"""What a format module in `FORMATS` provides, and what its writer is given.

Each format is a module (`training`, `speculators`, `eagle`, `gguf`) with the
names of `Format`. A format may be write-only: `gguf` is llama.cpp's layout,
which eagletools writes for deployment but never reads back (its `read` is
None), so `load_checkpoint` refuses it naming the file and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from eagletools.draft import DraftConfig
from eagletools.formats.tensors import DEFAULT_MAX_SHARD_BYTES

if TYPE_CHECKING:
    from eagletools.targets.summary import TargetSummary

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class WriteOptions:
    """What a writer takes besides the draft; each format reads the fields it needs."""

    dtype: torch.dtype | None = None  # float tensors cast on write (gguf keeps 1-D ones F32)
    verifier: dict[str, Any] | None = None  # speculators, training: {name_or_path, architectures}
    target: TargetSummary | None = None  # gguf: the target whose tokenizer the file carries
    name: str | None = None  # gguf: `general.name`, the output's stem
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES  # folder formats: safetensors shard size


class Format(Protocol):
    """A checkpoint layout: detection, an optional reader, a writer."""

    NAME: str
    ONE_FILE: bool  # writes one file (gguf), else a folder

    def matches(self, path: Path) -> bool:
        """Whether `path` (a folder, or a file for ONE_FILE formats) holds this format."""
        ...

    # None for a write-only format; else (config, tensors under the `eagle` key names)
    read: Callable[[Path, bool], tuple[DraftConfig, Tensors]] | None

    def write(
        self, config: DraftConfig, tensors: Tensors, path: Path, options: WriteOptions
    ) -> None:
        """Write into `path`, a temporary folder (or file) the caller renames on success."""
        ...
