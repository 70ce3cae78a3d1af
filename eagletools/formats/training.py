"""Our own training checkpoint: the draft part of a trainer's checkpoint folder.

Layout (docs/internals.md): `draft_config.json` (`DraftConfig.to_dict()`,
aux ids in HF indexing, lossless) and `model.safetensors` (or shards + index)
with the `eagle` tensor keys, beside whatever the trainer keeps for resuming
(optimizer, scheduler, RNG, `trainer_state.json`), which formats ignores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagletools.draft import DraftConfig
from eagletools.formats import hfconfig
from eagletools.formats.tensors import DEFAULT_MAX_SHARD_BYTES, read_tensors, write_tensors

NAME = "training"
CONFIG = "draft_config.json"


def matches(folder: Path) -> bool:
    return (folder / CONFIG).is_file()


def read(folder: Path, allow_pickle: bool = False) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    config = DraftConfig.from_dict(hfconfig.read_json(folder / CONFIG), str(folder / CONFIG))
    return config, read_tensors(folder, allow_pickle)


def write(
    config: DraftConfig,
    tensors: dict[str, torch.Tensor],
    folder: Path,
    *,
    verifier: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write the draft part into `folder` (the trainer's temp checkpoint folder)."""
    data = config.to_dict()
    if verifier:
        data["extra"] = {**data["extra"], "verifier": verifier}
    hfconfig.write_json(folder / CONFIG, data)
    write_tensors(tensors, folder, max_shard_bytes)
