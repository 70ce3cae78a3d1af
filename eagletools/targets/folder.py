"""Write a target as a Hugging Face folder that every engine loads as a causal LM.

`save_pretrained` on a model with tied embeddings keeps one of the two tied
tensors, and a model read from GGUF has no `architectures` in its config. vLLM
then builds a headless model with an empty embedding and emits token 0
forever (docs/deploy.md). So the folder written here names its model class,
stores every state-dict tensor under its own name (the tied embedding twice),
and carries the tokenizer, chat template and generation config beside the
weights, in the dtype asked for. It reads alike under both transformers
generations: transformers 5 writes only `rope_parameters`, and a reader on
transformers 4 then assumes `rope_theta` 10000 without a word; it names the
tokenizer class `TokenizersBackend`, which transformers 4 refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagletools.atomic import atomic_dir
from eagletools.targets.anatomy import rope_of


def rope_spellings(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """One RoPE as both generations' config fields: `rope_parameters` (transformers 5)
    beside `rope_theta`/`rope_scaling` (transformers 4), which 4 reads and 5 accepts."""
    return {
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
        "rope_theta": theta,
        "rope_scaling": scaling,
    }


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], bool]) -> None:
    data = json.loads(path.read_text())
    if edit(data):
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def add_legacy_rope(data: dict[str, Any]) -> bool:
    """Give a config that spells RoPE as `rope_parameters` the legacy fields too."""
    section = data.get("text_config") or data
    if "rope_theta" not in (section.get("rope_parameters") or {}):  # flat, not per layer type
        return False
    section.update(rope_spellings(*rope_of(section)))
    return True


def legacy_tokenizer_class(data: dict[str, Any]) -> bool:
    """transformers 5 names a tokenizer.json-backed tokenizer `TokenizersBackend`, a class
    transformers 4 lacks (it refuses the folder); `PreTrainedTokenizerFast` is the same
    tokenizer in both."""
    if data.get("tokenizer_class") != "TokenizersBackend":
        return False
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    return True


def folder_tensors(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every state-dict entry by its own name, tied ones as separate copies."""
    tensors, seen = {}, set()
    for name, value in model.state_dict().items():
        value = value.detach().to(dtype=dtype if value.is_floating_point() else value.dtype)
        key = (value.untyped_storage().data_ptr(), value.storage_offset())
        tensors[name] = value.clone().contiguous() if key in seen else value.contiguous()
        seen.add(key)
    return tensors


def save_target_folder(
    model: Any, tokenizer: Any, folder: str | Path, dtype: torch.dtype, overwrite: bool = False
) -> Path:
    """`folder` (written atomically): config, generation config, weights, tokenizer."""
    from safetensors.torch import save_file

    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written below are plain floats
    config.dtype = dtype
    with atomic_dir(Path(folder), overwrite=overwrite) as tmp:
        config.save_pretrained(tmp)
        _edit_json(tmp / "config.json", add_legacy_rope)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_file(folder_tensors(model, dtype), str(tmp / "model.safetensors"), {"format": "pt"})
        tokenizer.save_pretrained(tmp)
        if (tmp / "tokenizer_config.json").is_file():
            _edit_json(tmp / "tokenizer_config.json", legacy_tokenizer_class)
    return Path(folder)
