"""What checking or converting a draft needs of a target, without its weights.

`convert --target`, `inspect --target` and `fit_to_target` need the target's
config and its input embedding only. Loading the whole model for them costs
the model's size in memory (twice that in fp32 for a bf16 8B target); this
reads config.json and the one embedding tensor from the safetensors files,
so the cost is the embedding's size. A GGUF target is read from its
dequantised cache folder (written once, by `target.load.dequantised_folder`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eagletools.errors import UserError
from eagletools.targets.load import TargetInfo, dequantised_folder, load_config, resolve_spec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class TargetSummary:
    info: TargetInfo
    embeddings: torch.Tensor  # [V, H], the target's input embedding; [0, H] when not read


def load_target_summary(
    spec: str | Path, dtype: torch.dtype | None = None, with_embeddings: bool = True
) -> TargetSummary:
    """The target's `TargetInfo` and input embedding (in `dtype`, default as stored).

    With `with_embeddings=False` only the config is read and the embedding is an
    empty [0, H] tensor: checks then compare widths and nothing is copied
    (converting without --with-embeddings needs no more).
    """
    source = str(dequantised_folder(spec) or spec)
    config = load_config(source)
    info = TargetInfo.from_config(config, str(spec))
    if not with_embeddings:
        return TargetSummary(info, torch.empty(0, info.hidden_size, dtype=dtype))
    weight = _read_embeddings(source, tied=info.tie_word_embeddings)
    return TargetSummary(info, weight.to(dtype) if dtype is not None else weight)


def _read_embeddings(source: str, tied: bool) -> torch.Tensor:
    from safetensors import safe_open

    index = _file(source, INDEX)
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        key = _embedding_key(weight_map, tied, index)
        path = _file(source, weight_map[key])
    else:
        path = _file(source, SINGLE)
        if path is None:
            raise UserError(
                f"target {source}: no {SINGLE} or {INDEX}; checking a draft reads the target's "
                "embeddings from safetensors (convert a pytorch_model.bin target with "
                "transformers' save_pretrained first)"
            )
        with safe_open(str(path), framework="pt") as f:
            key = _embedding_key(list(f.keys()), tied, path)
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def _embedding_key(keys, tied: bool, source: Path) -> str:
    """The input embedding's name (`model.embed_tokens.weight` in Llama-family
    files); a tied target stored under `lm_head.weight` alone has it there."""
    found = sorted(k for k in keys if k.endswith("embed_tokens.weight"))
    if len(found) == 1:
        return found[0]
    if not found and tied and "lm_head.weight" in keys:
        return "lm_head.weight"
    raise UserError(
        f"{source}: expected one '*embed_tokens.weight' tensor, found {found or 'none'}; "
        "give a Llama-family target folder"
    )


def _file(source: str, name: str) -> Path | None:
    """`name` in a local folder, or fetched from a hub repo; None where it is absent."""
    location, _ = resolve_spec(source)
    folder = Path(location)
    if folder.is_dir():
        path = folder / name
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(location, name))
    except EntryNotFoundError:
        return None
