"""Our own training checkpoint: the draft part of a trainer's checkpoint folder.

Layout (docs/internals.md): `draft_config.json` (`DraftConfig.to_dict()`,
aux ids in HF indexing, lossless) and `model.safetensors` (or shards + index)
with the `eagle` tensor keys, beside whatever the trainer keeps for resuming
(optimizer, scheduler, RNG, `trainer_state.json`), which formats ignores.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagletools.draft import DraftConfig
from eagletools.formats import hfconfig
from eagletools.formats.registry import WriteOptions
from eagletools.formats.tensors import cast_floats, read_tensors, write_tensors

NAME = "training"
ONE_FILE = False
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
    options: WriteOptions,
) -> None:
    """Write the draft part into `folder` (the trainer's temp checkpoint folder)."""
    data = config.to_dict()
    if options.verifier:
        data["extra"] = {**data["extra"], "verifier": options.verifier}
    hfconfig.write_json(folder / CONFIG, data)
    write_tensors(cast_floats(tensors, options.dtype), folder, options.max_shard_bytes)
