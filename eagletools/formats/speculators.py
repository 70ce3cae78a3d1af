"""The `speculators` layout: what vLLM reads (package `speculators`, pinned to 0.9.0 here).

Same tensors as `eagle` with `layers.0.*` for `midlayer.*` (and `layers.{i}.*` for a
later layer's `layer{i}.*`); `config.json` has
`speculators_model_type` (the draft's kind: `eagle3`, or `peagle` with
`mask_token_id` and the tensor `mask_hidden` [1, 1, A*Ht]), the decoder layer as a nested
`transformer_layer_config` (llama, or qwen3 with q/k norms) whose `vocab_size`
is the target's, and top-level `eagle_aux_hidden_state_layer_ids` in Hugging
Face indexing. Facts pinned from speculators 0.9.0 and vLLM (tests/test_formats.py):
- `norm_before_residual` defaults to False in speculators but to True in vLLM
  (False for `peagle`): always written; when absent we follow vLLM, the engine
  this format is for.
- vLLM serves `peagle` as `eagle3` with `parallel_drafting` (one forward over the
  block); its mapping (configs/speculators/algos.py `update_peagle`) copies no
  `fc_norm` (such a draft does not load) and no `norm_output`.
- speculators sizes `fc` as `num_aux * hidden_size` (it ignores
  `target_hidden_size`), so only vLLM loads drafts whose widths differ.
- with draft vocab == target vocab it has no `d2t`/`t2d` buffers: not written.
- `speculators_config.verifier.name_or_path` null: speculators cannot load it
  (it asks the hub for the config of None); vLLM does not need it.
- EAGLE-3.1 (speculators >= 0.7): top-level `fc_norm` (tensors `fc_norm.{i}.weight`),
  `norm_before_fc` (one norm over the concatenation, tensor `input_norm.weight`;
  the package's training default; it refuses both together) and `norm_output`
  are read and written; vLLM reads them top-level too (configs/speculators/algos.py).
- without `embed_tokens.weight` in the file, speculators 0.9.0 (transformers 5)
  keeps uninitialised memory: its NaN sentinel for "copy the verifier's" is
  lost in meta-device loading (seen in tests/interop), so write them for it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from eagletools.draft import DraftConfig, later_layer_name, split_later_layer_key
from eagletools.errors import UserError
from eagletools.formats import hfconfig
from eagletools.formats.registry import WriteOptions
from eagletools.formats.tensors import cast_floats, read_tensors, write_tensors
from eagletools.kinds import KINDS

log = logging.getLogger(__name__)

NAME = "speculators"
ONE_FILE = False
CONFIG = "config.json"
# speculators_model_type -> vLLM's norm_before_residual when the field is absent
# (configs/speculators/algos.py: update_eagle3 True, update_peagle False)
MODEL_TYPES = {"eagle3": True, "peagle": False, "dflash": False}
SPECULATORS_VERSION = "0.9.0"
LAYER_PREFIX = ("midlayer.", "layers.0.")
LAYER_TYPES = {"llama": False, "qwen3": True}  # transformer_layer_config.model_type -> qk_norm
IGNORED_PREFIXES = ("verifier_",)  # verifier copies some versions keep; never the draft's own


def matches(folder: Path) -> bool:
    cfg = folder / CONFIG
    return cfg.is_file() and "speculators_model_type" in hfconfig.read_json(cfg)


def draft_kind(folder: Path) -> str:
    """The draft kind a speculators folder holds (`speculators_model_type`), read from its
    config alone: what a server is started for, without reading the weights."""
    return hfconfig.read_json(folder / CONFIG)["speculators_model_type"]


def block_tokens(folder: Path) -> int:
    """The tokens a `dflash` draft proposes a step (its block but the bonus token), from its
    config alone."""
    return int(hfconfig.read_json(folder / CONFIG).get("block_size") or 8) - 1


def to_eagle_key(key: str) -> str:
    """A file's tensor name as `Eagle3Draft` has it: `layers.0.` is `midlayer.`, a
    later `layers.{i}.` is `layer{i}.`."""
    ours, theirs = LAYER_PREFIX
    if key.startswith(theirs):
        return ours + key.removeprefix(theirs)
    if key.startswith("layers."):
        _, i, rest = key.split(".", 2)
        return f"{later_layer_name(int(i))}.{rest}"
    return key


def from_eagle_key(key: str) -> str:
    ours, theirs = LAYER_PREFIX
    if key.startswith(ours):
        return theirs + key.removeprefix(ours)
    later = split_later_layer_key(key)
    return f"layers.{later[0]}.{later[1]}" if later else key


def read(folder: Path, allow_pickle: bool = False) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    source = str(folder / CONFIG)
    cfg = hfconfig.read_json(folder / CONFIG)
    kind = cfg["speculators_model_type"]
    if kind not in MODEL_TYPES:
        raise UserError(
            f"{source}: field 'speculators_model_type' is {kind!r}; eagletools reads "
            f"{' and '.join(map(repr, MODEL_TYPES))} speculators"
        )
    if kind == "peagle" and not isinstance(cfg.get("mask_token_id"), int):
        raise UserError(
            f"{source}: field 'mask_token_id' is {cfg.get('mask_token_id')!r}; a peagle draft "
            "needs the id of the token its parallel slots take (vLLM fails to load it without)"
        )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UserError(f"{source}: missing field 'transformer_layer_config' (the decoder layer)")
    layer_type = layer.get("model_type", "qwen3")  # speculators' own default class
    if layer_type not in LAYER_TYPES:
        raise UserError(
            f"{source}: field 'transformer_layer_config.model_type' is {layer_type!r}; "
            f"supported: {sorted(LAYER_TYPES)}"
        )
    rename = (lambda key: key) if kind == "dflash" else to_eagle_key  # DFlash's are ours
    tensors = {
        rename(k): v
        for k, v in read_tensors(folder, allow_pickle).items()
        if not k.startswith(IGNORED_PREFIXES)
    }
    fields = hfconfig.read_layer_fields(layer, f"{source}: transformer_layer_config")
    if kind == "dflash":
        return DraftConfig(**fields, **dflash_fields(cfg, layer, source)), tensors
    if "norm_before_residual" not in cfg:
        log.warning(
            "%s: no 'norm_before_residual'; assuming %s as vLLM does for %s drafts: "
            "re-export with the field set",
            source, str(MODEL_TYPES[kind]).lower(), kind,
        )  # fmt: skip
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or None
    fields.update(
        draft_vocab_size=cfg.get("draft_vocab_size") or fields["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size") or fields["hidden_size"],
        aux_layer_ids=list(ids) if ids else None,
        norm_before_residual=bool(cfg.get("norm_before_residual", MODEL_TYPES[kind])),
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        norm_output=bool(cfg.get("norm_output", False)),
        qk_norm=LAYER_TYPES[layer_type],
        kind=kind,
        mask_token_id=cfg.get("mask_token_id") if kind == "peagle" else None,
    )
    hfconfig.check_input_norm(
        fields["norm_before_fc"], tensors, "norm_before_fc", source, "vLLM and speculators"
    )
    fields["num_aux_states"] = hfconfig.aux_count(ids)
    spec = cfg.get("speculators_config") or {}
    extra = {}
    if spec.get("verifier"):
        extra["verifier"] = spec["verifier"]
    methods = spec.get("proposal_methods") or []
    if methods and methods[0].get("speculative_tokens"):
        extra["speculative_tokens"] = methods[0]["speculative_tokens"]
    return DraftConfig(**fields, extra=extra), tensors


def dflash_fields(cfg: dict[str, Any], layer: dict[str, Any], source: str) -> dict[str, Any]:
    """A `dflash` config's fields beyond its layer, refusing a draft that eagletools or an
    engine would compute otherwise than it was trained (docs/design.md 3.7)."""
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise UserError(
            f"{source}: field 'transformer_layer_config.layer_types' has sliding-window "
            "layers (speculators' default); eagletools runs DFlash drafts with full attention "
            "in every layer: train with --full-attention-indices covering every layer"
        )
    if not cfg.get("sliding_window_non_causal", False):
        raise UserError(
            f"{source}: field 'sliding_window_non_causal' is not true: speculators trains "
            "full-attention blocks bidirectionally whatever it says, but vLLM reads it as "
            "causal=true for every layer and computes another draft; set it to true"
        )
    if cfg.get("sample_from_anchor"):
        raise UserError(
            f"{source}: field 'sample_from_anchor' is true; eagletools' DFlash drafts propose "
            "from the mask slots only (the anchor is the bonus token): set it to false"
        )
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not ids or not isinstance(cfg.get("mask_token_id"), int):
        raise UserError(
            f"{source}: fields 'aux_hidden_state_layer_ids' and 'mask_token_id' are required "
            "for a dflash draft (vLLM refuses it without them)"
        )
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    extra = {"speculative_tokens": methods[0].get("speculative_tokens")}
    verifier = (cfg.get("speculators_config") or {}).get("verifier")
    return dict(
        draft_vocab_size=cfg.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size") or layer["hidden_size"],
        aux_layer_ids=list(ids),
        num_aux_states=len(ids),
        qk_norm=True,  # Qwen3 layers, whatever the layer's model_type
        kind="dflash",
        mask_token_id=cfg["mask_token_id"],
        block_size=cfg.get("block_size") or 8,  # speculators' default
        extra={k: v for k, v in (extra | {"verifier": verifier}).items() if v},
    )


def dflash_config_fields(c: DraftConfig) -> dict[str, Any]:
    """What a `dflash` config says beyond the layer, as speculators 0.9.0 writes it."""
    return {
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": c.aux_layer_ids,
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": True,  # vLLM: causal = not this, for every layer
        "sample_from_anchor": False,
    }


def config_dict(
    c: DraftConfig, dtype: str | None, verifier: dict[str, Any] | None
) -> dict[str, Any]:
    layer = {
        "model_type": "qwen3" if c.qk_norm else "llama",
        **hfconfig.write_layer_fields(c),
    }
    verifier = verifier or c.extra.get("verifier") or {"name_or_path": None, "architectures": []}
    kind = KINDS[c.kind]
    if c.kind == "dflash":
        own = dflash_config_fields(c)
    else:
        own = {
            **({"mask_token_id": c.mask_token_id} if c.kind == "peagle" else {}),
            "norm_before_residual": c.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": c.aux_layer_ids,
            "norm_before_fc": c.norm_before_fc,
            "fc_norm": c.fc_norm,
            "norm_output": c.norm_output,
            "embed_requires_grad": False,
        }
    default_tokens = c.block_size - 1 if c.block_size else 3
    return {
        "architectures": [kind.architectures[NAME][0]],
        "speculators_model_type": c.kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        **own,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "speculators_config": {
            "algorithm": c.kind,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": c.extra.get("speculative_tokens", default_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
    }


def write(
    config: DraftConfig,
    tensors: dict[str, torch.Tensor],
    folder: Path,
    options: WriteOptions,
) -> None:
    """Write into an existing (temporary) folder, recording `options.verifier` as the verifier."""
    if config.aux_layer_ids is None and config.kind == "dflash":
        raise UserError(
            "a dflash draft needs its aux layer ids in the speculators format (vLLM refuses "
            "it without them); convert with --target to record the defaults"
        )
    if config.aux_layer_ids is None and config.num_aux_states != 3:
        raise UserError(
            f"a draft fusing {config.num_aux_states} aux states needs its aux layer ids in the "
            "speculators format (vLLM assumes 3 without them); convert with --target to "
            "record the defaults, or retrain with explicit ids"
        )
    tensors = cast_floats(tensors, options.dtype)
    if config.draft_vocab_size == config.vocab_size:
        tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    if config.target_hidden_size != config.hidden_size:
        log.warning(
            "target_hidden_size %d != hidden_size %d: vLLM loads this, the speculators "
            "package (0.9.0) sizes fc from hidden_size and does not",
            config.target_hidden_size,
            config.hidden_size,
        )
    if "embed_tokens.weight" not in tensors:
        log.warning(
            "no embed_tokens: vLLM uses the target's, but the speculators package (0.9.0, "
            "transformers 5) leaves them uninitialised instead of copying the verifier's; "
            "write them (--with-embeddings) for it"
        )
    cfg = config_dict(config, hfconfig.dtype_name(tensors), options.verifier)
    if cfg["speculators_config"]["verifier"]["name_or_path"] is None:
        log.warning(
            "no verifier recorded: vLLM takes the target from its command line, but the "
            "speculators package cannot load the draft without one (it looks up a config for "
            "None on the hub); pass --verifier or --target"
        )
    hfconfig.write_json(folder / CONFIG, cfg)
    rename = (lambda key: key) if config.kind == "dflash" else from_eagle_key
    write_tensors({rename(k): v for k, v in tensors.items()}, folder, options.max_shard_bytes)
