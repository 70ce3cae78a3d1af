"""Checks a checkpoint's tensors against its config, and a draft against a target.

The expected keys and shapes come from the draft module of its kind itself (built on the
meta device), so the format code never restates the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagletools.draft import DraftConfig
from eagletools.draft.model import meta_device
from eagletools.errors import UserError
from eagletools.kinds import kind_of
from eagletools.targets import default_aux_layer_ids, normalize_rope_scaling
from eagletools.vocab import DraftVocab

OPTIONAL = {"embed_tokens.weight"}
VOCAB_KEYS = {"d2t", "t2d"}


def expected_tensors(config: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`eagle` key -> (shape, dtype) of a draft with this config."""
    with meta_device():
        model = kind_of(config).build(config)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def check_tensors(config: DraftConfig, tensors: dict[str, torch.Tensor], source: str) -> DraftVocab:
    """Raise on a missing, unexpected or misshapen tensor; return the checked vocabulary.

    `tensors` use `eagle` key names; `d2t`/`t2d` may be absent (an identity
    vocabulary) and `t2d` alone may be absent (rebuilt from `d2t`).
    """
    expected = expected_tensors(config)
    required = set(expected) - OPTIONAL - VOCAB_KEYS
    missing = sorted(required - set(tensors))
    if missing:
        raise UserError(f"{source}: missing tensor(s) {missing}; the checkpoint is incomplete")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise UserError(
            f"{source}: unexpected tensor(s) {unexpected}: this draft layout is not an EAGLE-3 "
            "head eagletools can load (biases, extra layers or norms?)"
        )
    for name, t in tensors.items():
        shape, dtype = expected[name]
        if tuple(t.shape) != shape:
            raise UserError(
                f"{source}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                "from the config; the config and the weights disagree"
            )
        if dtype.is_floating_point and not t.dtype.is_floating_point:
            raise UserError(f"{source}: tensor {name!r} is {t.dtype}, expected a float dtype")
    return _vocab(config, tensors, source)


def _vocab(config: DraftConfig, tensors: dict[str, torch.Tensor], source: str) -> DraftVocab:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if t2d is not None:
            raise UserError(f"{source}: has t2d but no d2t; engines read d2t: re-export with it")
        if config.draft_vocab_size != config.vocab_size:
            raise UserError(
                f"{source}: no d2t, but draft_vocab_size {config.draft_vocab_size} < vocab_size "
                f"{config.vocab_size}: which target ids the draft predicts is unknown"
            )
        return DraftVocab.identity(config.vocab_size)
    if t2d is None:
        return DraftVocab.from_d2t(d2t, config.vocab_size, source=f"{source}: d2t")
    if t2d.dtype != torch.bool:
        raise UserError(f"{source}: t2d is {t2d.dtype}, expected bool; re-export it as bool")
    vocab = DraftVocab(d2t.long() if d2t.dtype == torch.int32 else d2t, t2d)
    vocab.validate(source)
    return vocab


@dataclass
class Problem:
    """One incompatibility: what, why, and the fix. `error` ones stop `convert`."""

    field: str
    message: str
    fix: str
    error: bool = True

    def __str__(self) -> str:
        return f"{self.field}: {self.message}; fix: {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "message": self.message, "fix": self.fix, "error": self.error}


def target_problems(
    config: DraftConfig, tensors: dict[str, torch.Tensor], target: Any
) -> list[Problem]:
    """Everything that keeps this draft from working with `target` (a `Target` or a
    `TargetSummary`: its `info` and `embeddings`)."""
    info = target.info
    spec = info.name_or_path
    out = []
    if config.target_hidden_size != info.hidden_size:
        out.append(Problem(
            "target_hidden_size",
            f"the draft fuses aux states of width {config.target_hidden_size}, the target "
            f"{spec} has hidden_size {info.hidden_size}",
            "use the target the draft was trained for, or retrain it for this one",
        ))  # fmt: skip
    if config.vocab_size != info.vocab_size:
        out.append(Problem(
            "vocab_size",
            f"the draft's target vocab is {config.vocab_size}, {spec} has {info.vocab_size}",
            "use the target the draft was trained for (same tokenizer)",
        ))  # fmt: skip
    ids = config.aux_layer_ids
    if ids is None:
        default = default_aux_layer_ids(info.num_layers)
        out.append(Problem(
            "aux_layer_ids",
            f"not recorded; engines assume the default {default} (HF indexing)",
            "convert with --target to write them explicitly, if the draft was trained on those",
            error=False,
        ))  # fmt: skip
    elif max(ids) > info.num_layers:
        out.append(Problem(
            "aux_layer_ids",
            f"{ids} (HF indexing) exceed the target's {info.num_layers} layers",
            "use the target the draft was trained for",
        ))  # fmt: skip
    embed = target.embeddings.detach().cpu()
    draft_embed = tensors.get("embed_tokens.weight")
    if draft_embed is None and config.hidden_size != embed.shape[1]:
        out.append(Problem(
            "embed_tokens",
            f"absent, and the target's embeddings are {embed.shape[1]} wide, the draft "
            f"{config.hidden_size}: engines fall back to the target's and fail",
            "ship the draft's own embeddings in the checkpoint",
        ))  # fmt: skip
    elif (
        draft_embed is not None
        and draft_embed.shape == embed.shape
        and not _equal_at_lower_precision(draft_embed, embed)
    ):
        out.append(Problem(
            "embed_tokens",
            f"differ from {spec}'s (max abs diff "
            f"{(draft_embed.float() - embed.float()).abs().max():.3g}); engines "
            "that reuse the target's embeddings run a different draft than the one shipped",
            "drop them (convert without --with-embeddings) if the draft was trained on the "
            "target's; keep them otherwise",
            error=False,
        ))  # fmt: skip
    if (config.rope_theta, config.rope_scaling) != (
        info.rope_theta,
        normalize_rope_scaling(info.rope_scaling),
    ):
        out.append(Problem(
            "rope",
            f"draft rope_theta={config.rope_theta}, rope_scaling={config.rope_scaling}; target "
            f"rope_theta={info.rope_theta}, rope_scaling={info.rope_scaling}",
            "convert with --target to take RoPE from the target",
        ))  # fmt: skip
    if config.max_position_embeddings < info.max_position_embeddings:
        out.append(Problem(
            "max_position_embeddings",
            f"{config.max_position_embeddings} < the target's {info.max_position_embeddings}: "
            "engines cap or mis-rotate long prompts and acceptance collapses",
            "convert with --target to take max_position_embeddings from the target",
        ))  # fmt: skip
    return out


def _equal_at_lower_precision(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal once both are in the coarser dtype: a bf16 copy of fp32 embeddings is theirs."""
    low = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
    return torch.equal(a.to(low), b.to(low))
