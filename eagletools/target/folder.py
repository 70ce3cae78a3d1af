"""Write a target as a Hugging Face folder that every engine loads as a causal LM.

`save_pretrained` on a model with tied embeddings keeps one of the two tied
tensors, and a model read from GGUF has no `architectures` in its config. vLLM
then builds a headless model with an empty embedding and emits token 0
forever (docs/deploy.md). So the folder written here names its model class,
stores every state-dict tensor under its own name (the tied embedding twice),
and carries the tokenizer, chat template and generation config beside the
weights, in the dtype asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagletools.atomic import atomic_dir


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
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_file(folder_tensors(model, dtype), str(tmp / "model.safetensors"), {"format": "pt"})
        tokenizer.save_pretrained(tmp)
    return Path(folder)


def export_target(
    spec: str, folder: str | Path, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False
) -> Path:
    """Any target spec (built-in, .gguf, folder, hub id) as a complete HF folder."""
    from eagletools.target.load import load_target

    target = load_target(spec, dtype=dtype)
    return save_target_folder(target.model, target.tokenizer, folder, dtype, overwrite)
