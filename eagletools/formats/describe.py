"""What `eagletools inspect` reports about a checkpoint, as plain data."""

from __future__ import annotations

from collections import Counter
from typing import Any

from eagletools.formats.checkpoint import EMBED, Checkpoint
from eagletools.formats.eagle import from_hf_ids
from eagletools.formats.validate import target_problems


def describe(ckpt: Checkpoint, target: Any = None) -> dict[str, Any]:
    """Format, config, sizes, dtypes, vocabulary invariants, aux layers, target fit."""
    t = ckpt.tensors
    floats = {k: v for k, v in t.items() if v.is_floating_point()}
    ids = ckpt.config.aux_layer_ids
    vocab = ckpt.vocab
    checks = [{"check": n, "ok": ok, "detail": d} for n, ok, d in vocab.checks()]
    out: dict[str, Any] = {
        "path": ckpt.source,
        "format": ckpt.format,
        "config": ckpt.config.to_dict(),
        "parameters": sum(v.numel() for k, v in floats.items() if k != EMBED),
        "embedding_parameters": t[EMBED].numel() if EMBED in t else 0,
        "dtypes": dict(Counter(str(v.dtype).removeprefix("torch.") for v in t.values())),
        "vocab": {
            "draft_vocab_size": vocab.draft_vocab_size,
            "target_vocab_size": vocab.target_vocab_size,
            "identity": vocab.is_identity,
            "checks": checks,
        },
        "aux_layer_ids": None
        if ids is None
        else {"hf_hidden_states": ids, "decoder_layer_outputs": from_hf_ids(ids)},
        "problems": [],
    }
    if target is not None:
        out["target"] = target.info.name_or_path
        out["problems"] = [p.to_dict() for p in target_problems(ckpt.config, t, target)]
    out["ok"] = all(c["ok"] for c in checks) and not any(p["error"] for p in out["problems"])
    return out
