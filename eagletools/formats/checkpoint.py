"""Read any draft checkpoint into one form, check it, write it in any format.

In memory a checkpoint is a `DraftConfig` plus tensors under the `eagle` key
names, `d2t`/`t2d` always present (rebuilt when a file omits them). Every
reader's output goes through `check_tensors` before anything uses or writes it.
`FORMATS` holds every format (`formats.registry.Format`), `gguf` write-only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagletools.atomic import atomic_dir, atomic_file
from eagletools.draft import DraftConfig
from eagletools.dtypes import parse_dtype
from eagletools.errors import UserError
from eagletools.formats import eagle, gguf, hfconfig, speculators, training
from eagletools.formats.registry import Format, WriteOptions
from eagletools.formats.tensors import DEFAULT_MAX_SHARD_BYTES
from eagletools.formats.validate import check_tensors, target_problems
from eagletools.kinds import kind_of
from eagletools.targets import default_aux_layer_ids, normalize_rope_scaling
from eagletools.vocab import DraftVocab

if TYPE_CHECKING:
    from eagletools.targets.summary import TargetSummary

log = logging.getLogger(__name__)

FORMATS: dict[str, Format] = {m.NAME: m for m in (training, speculators, eagle, gguf)}  # order
EMBED = "embed_tokens.weight"


@dataclass
class Checkpoint:
    format: str
    config: DraftConfig
    tensors: dict[str, torch.Tensor]  # `eagle` key names
    source: str

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.tensors["d2t"], self.tensors["t2d"])


def sniff_format(path: str | Path) -> str | None:
    """The registered format at `path` (a folder, or a file such as a GGUF draft), read
    from its content (config fields, GGUF magic) rather than its name; None if none."""
    path = Path(path).expanduser()
    return next((name for name, module in FORMATS.items() if module.matches(path)), None)


def detect_format(path: str | Path) -> str:
    """`sniff_format`, or a UserError saying what is at `path` and what was expected."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UserError(f"{folder}: no such checkpoint folder")
    found = sniff_format(folder)
    if found is not None:
        return found
    if not folder.is_dir():
        raise UserError(
            f"{folder}: a file, and not a GGUF draft; give the checkpoint folder (the one "
            f"holding config.json), e.g. {folder.parent}"
        )
    inside = sorted(
        str(p.parent)
        for pattern in ("*/config.json", "*/" + training.CONFIG, "*/*/" + training.CONFIG)
        for p in folder.glob(pattern)
    )
    if inside:
        raise UserError(
            f"{folder}: holds checkpoints rather than being one; give one of: " + ", ".join(inside)
        )
    if (folder / "config.json").is_file():
        cfg = hfconfig.read_json(folder / "config.json")
        seen = f"architectures={cfg.get('architectures')}, model_type={cfg.get('model_type')!r}"
    else:
        seen = f"files {sorted(p.name for p in folder.iterdir())}"
    raise UserError(
        f"{folder}: unknown checkpoint format ({seen}); expected config.json with "
        f"'speculators_model_type' (speculators), config.json with architectures "
        f"[{eagle.ARCHITECTURE!r}] (eagle), or {training.CONFIG} (an eagletools training "
        "checkpoint)"
    )


def load_checkpoint(path: str | Path, allow_pickle: bool = False) -> Checkpoint:
    """Read and check a draft checkpoint of any readable format."""
    path = Path(path).expanduser()
    fmt = detect_format(path)
    read = FORMATS[fmt].read
    if read is None:
        readable = "/".join(name for name, module in FORMATS.items() if module.read)
        raise UserError(
            f"{path}: a {fmt} draft, which eagletools writes but does not read; give the "
            f"checkpoint it was converted from (a {readable} folder)"
        )
    config, tensors = read(path, allow_pickle)
    vocab = check_tensors(config, tensors, str(path))
    tensors["d2t"], tensors["t2d"] = vocab.d2t, vocab.t2d
    return Checkpoint(fmt, config, tensors, str(path))


def _verifier(name: str | dict | None) -> dict[str, Any] | None:
    """{name_or_path, architectures}; the architectures read from a local folder's config."""
    if name is None or isinstance(name, dict):
        return name
    cfg = Path(name).expanduser() / "config.json"
    archs = (hfconfig.read_json(cfg).get("architectures") or []) if cfg.is_file() else []
    return {"name_or_path": str(name), "architectures": archs}


def save_checkpoint(
    ckpt: Checkpoint,
    path: str | Path,
    fmt: str,
    *,
    dtype: str | torch.dtype | None = None,
    with_embeddings: bool = False,
    verifier: str | dict | None = None,
    target: TargetSummary | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Check `ckpt`, then write it as `fmt` atomically; nothing is written on any error.

    `target` is the target `ckpt` was fitted to, for formats that carry some of
    it (gguf: its tokenizer). `extra_files` (name -> text) go into a folder
    layout in the same atomic write (the training record); a one-file format drops them.
    """
    if fmt not in FORMATS:
        raise UserError(f"format {fmt!r}: choose one of {sorted(FORMATS)}")
    kind = kind_of(ckpt.config, ckpt.source)
    if fmt != training.NAME and fmt not in kind.layouts:
        raise UserError(
            f"{ckpt.source}: a {kind.title} draft has no {fmt} form (no engine that reads "
            f"{fmt} serves {kind.title}); write it as {' or '.join(kind.layouts)}"
        )
    path = Path(path).expanduser()
    if path.exists() and not overwrite:
        raise UserError(f"{path}: already exists; pass --force (overwrite=True) to replace it")
    check_tensors(ckpt.config, ckpt.tensors, ckpt.source)
    tensors = dict(ckpt.tensors)
    if with_embeddings and EMBED not in tensors:
        raise UserError(
            f"{ckpt.source}: has no {EMBED} to write; pass --target to copy the target's"
        )
    if not with_embeddings and tensors.pop(EMBED, None) is not None:
        log.info("dropping %s (engines use the target's); keep them with --with-embeddings", EMBED)
    options = WriteOptions(
        dtype=parse_dtype(dtype) if dtype is not None else None,
        verifier=_verifier(verifier),
        target=target,
        name=path.stem,
        max_shard_bytes=max_shard_bytes,
    )
    module = FORMATS[fmt]
    with atomic_file(path) if module.ONE_FILE else atomic_dir(path, overwrite=overwrite) as tmp:
        module.write(ckpt.config, tensors, tmp, options)
        for name, text in ({} if module.ONE_FILE else extra_files or {}).items():
            (tmp / name).write_text(text)
    return path


def fit_to_target(ckpt: Checkpoint, target: Any) -> tuple[Checkpoint, list[str]]:
    """Take RoPE, max positions, default aux ids and missing embeddings from `target`
    (a `Target`, or a `TargetSummary`: its config and embeddings, no weights).

    Returns the fitted checkpoint and a line per change; raises a UserError
    naming every problem the target cannot fix (widths, vocab, layers).
    """
    info = target.info
    notes, changes = [], {}
    scaling = normalize_rope_scaling(info.rope_scaling)
    if (ckpt.config.rope_theta, ckpt.config.rope_scaling) != (info.rope_theta, scaling):
        changes.update(rope_theta=info.rope_theta, rope_scaling=scaling)
        notes.append(
            f"RoPE: rope_theta {ckpt.config.rope_theta} -> {info.rope_theta}, "
            f"rope_scaling {ckpt.config.rope_scaling} -> {scaling}"
        )
    if ckpt.config.max_position_embeddings != info.max_position_embeddings:
        changes["max_position_embeddings"] = info.max_position_embeddings
        notes.append(
            f"max_position_embeddings {ckpt.config.max_position_embeddings} -> "
            f"{info.max_position_embeddings}"
        )
    if ckpt.config.aux_layer_ids is None and ckpt.config.num_aux_states == 3:
        changes["aux_layer_ids"] = default_aux_layer_ids(info.num_layers)
        notes.append(f"aux_layer_ids (HF indexing) set to the default {changes['aux_layer_ids']}")
    config = dataclasses.replace(ckpt.config, **changes)
    tensors = dict(ckpt.tensors)
    embed = target.embeddings
    if EMBED not in tensors and tuple(embed.shape) == (config.vocab_size, config.hidden_size):
        tensors[EMBED] = embed.detach().cpu().to(tensors["fc.weight"].dtype, copy=True)
    errors = [p for p in target_problems(config, tensors, target) if p.error]
    if errors:
        raise UserError(
            f"{ckpt.source} does not fit target {info.name_or_path}:\n  "
            + "\n  ".join(map(str, errors))
        )
    return Checkpoint(ckpt.format, config, tensors, ckpt.source), notes


def load_draft(
    path: str | Path,
    target: Any = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
) -> nn.Module:
    """The draft module of its kind (`Eagle3Draft`, ...) from any checkpoint; with a target, fitted to it (see `fit_to_target`)."""
    ckpt = load_checkpoint(path, allow_pickle)
    if target is not None:
        ckpt, notes = fit_to_target(ckpt, target)
        for note in notes:
            log.info("%s: %s", ckpt.source, note)
    if EMBED not in ckpt.tensors:
        raise UserError(
            f"{ckpt.source}: has no {EMBED}; pass the target so its embeddings are used"
        )
    model = kind_of(ckpt.config, ckpt.source).build(ckpt.config)
    model.load_state_dict(ckpt.tensors, strict=True)
    return model.to(device=device, dtype=dtype).eval()
