"""The `eagle` layout: SafeAILab EAGLE, SpecForge, SGLang, ModelOpt export, TensorRT-LLM.

`config.json` is a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`
plus `draft_vocab_size`; tensors are `midlayer.*`, `fc`, `norm`, `lm_head`,
`d2t`, `t2d` (the `Eagle3Draft` keys as they are). Aux layer ids, when
present, sit in `eagle_config.eagle_aux_hidden_state_layer_ids` as decoder-
layer OUTPUT indices (SGLang adds 1), i.e. Hugging Face index - 1.
EAGLE-3.1 drafts set top-level `fc_norm` (tensors `fc_norm.{i}.weight`, one
per aux state) and `norm_output`, as SpecForge, SGLang, vLLM and TensorRT-LLM
read them; the SafeAILab code has neither. `norm_before_fc` (one norm over all aux
states, tensor `input_norm.weight`) is written twice: top-level, where llama.cpp's
converter reads it, and in `eagle_config`, the one TensorRT-LLM reads (vLLM reads
`eagle_config` first, then top-level; models/llama_eagle3.py:184-188).
A draft of several layers (`num_hidden_layers` > 1) is laid out as TensorRT-LLM's
Eagle3DraftModel reads it: `midlayer` becomes a list, `midlayer.0.*` the EAGLE-3
layer and `midlayer.{i}.*` the plain ones, whose one norm before attention is
named `hidden_norm` there (`layer{i}.input_layernorm` in `Eagle3Draft`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagletools.draft import DraftConfig, later_layer_name, split_later_layer_key
from eagletools.errors import UserError
from eagletools.formats import hfconfig
from eagletools.formats.registry import WriteOptions
from eagletools.formats.tensors import cast_floats, read_tensors, write_tensors

NAME = "eagle"
ONE_FILE = False
ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG = "config.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old releases saved RoPE tables; rebuilt on load


def matches(folder: Path) -> bool:
    cfg = folder / CONFIG
    if not cfg.is_file():
        return False
    data = hfconfig.read_json(cfg)
    archs = data.get("architectures") or []
    # some exports keep a plain Llama architecture but carry draft_vocab_size
    return "speculators_model_type" not in data and (
        any("Eagle3" in a for a in archs) or "draft_vocab_size" in data
    )


def file_key(key: str, layers: int) -> str:
    """An `Eagle3Draft` tensor name (`midlayer.*`, `layer{i}.*`) as a file of `layers`
    layers names it (`midlayer.{i}.*` beyond one layer)."""
    if layers == 1:
        return key
    if key.startswith("midlayer."):
        return "midlayer.0." + key.removeprefix("midlayer.")
    later = split_later_layer_key(key)
    if later is None:
        return key
    i, rest = later
    return f"midlayer.{i}." + rest.replace("input_layernorm.", "hidden_norm.", 1)


def draft_key(key: str, layers: int) -> str:
    """`file_key` undone."""
    if layers == 1 or not key.startswith("midlayer."):
        return key
    _, i, rest = key.split(".", 2)
    if i == "0":
        return "midlayer." + rest
    return f"{later_layer_name(int(i))}." + rest.replace("hidden_norm.", "input_layernorm.", 1)


def to_hf_ids(eagle_ids: list[int]) -> list[int]:
    return [i + 1 for i in eagle_ids]


def from_hf_ids(hf_ids: list[int]) -> list[int]:
    return [i - 1 for i in hf_ids]


def read(folder: Path, allow_pickle: bool = False) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    source = str(folder / CONFIG)
    cfg = hfconfig.read_json(folder / CONFIG)
    tensors = {
        k: v
        for k, v in read_tensors(folder, allow_pickle).items()
        if not k.endswith(IGNORED_SUFFIXES)
    }
    fields = hfconfig.read_layer_fields(cfg, source)
    tensors = {draft_key(k, fields["num_hidden_layers"]): v for k, v in tensors.items()}
    eagle_cfg = cfg.get("eagle_config") or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise UserError(
            f"{source}: field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be a list of ints"
        )
    lm_head = tensors.get("lm_head.weight")
    fields.update(
        draft_vocab_size=cfg.get("draft_vocab_size")
        or (lm_head.shape[0] if lm_head is not None else fields["vocab_size"]),
        target_hidden_size=cfg.get("target_hidden_size") or fields["hidden_size"],
        aux_layer_ids=to_hf_ids(ids) if ids else None,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        fc_norm=bool(cfg.get("fc_norm", False)),
        # as vLLM reads it: eagle_config's, else the top-level field
        norm_before_fc=bool(eagle_cfg.get("norm_before_fc", cfg.get("norm_before_fc", False))),
        norm_output=bool(cfg.get("norm_output", False)),
        qk_norm="midlayer.self_attn.q_norm.weight" in tensors,
    )
    nbf = "eagle_config.norm_before_fc" if "norm_before_fc" in eagle_cfg else "norm_before_fc"
    hfconfig.check_input_norm(fields["norm_before_fc"], tensors, nbf, source, "vLLM")
    fields["num_aux_states"] = hfconfig.aux_count(ids, cfg.get("num_aux_hidden_states"))
    return DraftConfig(**fields), tensors


def config_dict(c: DraftConfig, dtype: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **hfconfig.write_layer_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "num_aux_hidden_states": c.num_aux_states,
        "norm_before_residual": c.norm_before_residual,
        "fc_norm": c.fc_norm,
        "norm_before_fc": c.norm_before_fc,
        "norm_output": c.norm_output,
        "torch_dtype": dtype,
    }
    if c.aux_layer_ids is not None:
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": from_hf_ids(c.aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    if c.norm_before_fc:  # TensorRT-LLM reads it here only
        out.setdefault("eagle_config", {})["norm_before_fc"] = True
    return out


def write(
    config: DraftConfig,
    tensors: dict[str, torch.Tensor],
    folder: Path,
    options: WriteOptions,
) -> None:
    """Write into an existing (temporary) folder. The eagle layout has no verifier field."""
    tensors = cast_floats(tensors, options.dtype)
    hfconfig.write_json(folder / CONFIG, config_dict(config, hfconfig.dtype_name(tensors)))
    layers = config.num_hidden_layers
    write_tensors(
        {file_key(k, layers): v for k, v in tensors.items()}, folder, options.max_shard_bytes
    )
