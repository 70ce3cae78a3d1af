"""Tensor files of a checkpoint folder: safetensors (single or sharded + index), pickle on request.

Every ecosystem writes the Hugging Face layout: `model.safetensors`, or shards
named in `model.safetensors.index.json`; old releases ship `pytorch_model.bin`
(a pickle, which can run code when loaded: read only with the user's consent
and only through `torch.load(weights_only=True)`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagletools.errors import UserError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def tensor_files(folder: Path) -> tuple[list[Path], bool]:
    """(the files holding the tensors, whether they are pickles), by HF precedence."""
    for index, pickled in ((SAFETENSORS_INDEX, False), (PICKLE_INDEX, True)):
        if (folder / index).is_file():
            return _shards(folder / index), pickled
    for name, pickled in ((SAFETENSORS, False), (PICKLE, True)):
        if (folder / name).is_file():
            return [folder / name], pickled
    found = sorted(p.name for p in folder.iterdir())
    raise UserError(
        f"{folder}: no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX} with its shards, "
        f"or {PICKLE}; found {found}"
    )


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise UserError(
            f"{index}: not a valid index ({err!r}); it needs a 'weight_map' of tensor name -> "
            "shard file; re-export the checkpoint"
        ) from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise UserError(f"{index}: shard file(s) {missing} listed in 'weight_map' do not exist")
    return [index.parent / n for n in names]


def read_tensors(folder: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    files, pickled = tensor_files(folder)
    if pickled and not allow_pickle:
        raise UserError(
            f"{files[0]}: a pickle file, which can run code when loaded; pass --allow-pickle "
            "(allow_pickle=True) if you trust its source, or use a safetensors export"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        part = _read_pickle(f) if pickled else _read_safetensors(f)
        dup = sorted(set(part) & set(tensors))
        if dup:
            raise UserError(f"{f}: tensor(s) {dup} also appear in another shard")
        tensors.update(part)
    index = folder / (PICKLE_INDEX if pickled else SAFETENSORS_INDEX)
    if index.is_file():
        listed = set(json.loads(index.read_text())["weight_map"])
        if listed != set(tensors):
            raise UserError(
                f"{index}: 'weight_map' lists {sorted(listed - set(tensors))} missing from the "
                f"shards and omits {sorted(set(tensors) - listed)}; re-export the checkpoint"
            )
    return tensors


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(
            f"{path}: unreadable safetensors file ({err}); it is truncated or corrupt: "
            "download or export it again"
        ) from None


def _read_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler raises many types for a bad file
        raise UserError(
            f"{path}: could not load with torch.load(weights_only=True) ({err}); the file is "
            "corrupt or holds objects other than tensors"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dict of tensors (a state_dict)")
    return state


def cast_floats(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """`tensors` with the float ones in `dtype` (None: unchanged); the vocab maps stay ints."""
    if dtype is None:
        return tensors
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def write_tensors(
    tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Write `model.safetensors`, or HF-named shards + index beyond `max_shard_bytes`."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / SAFETENSORS), metadata={"format": "pt"})
        return [SAFETENSORS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, SAFETENSORS_INDEX]
