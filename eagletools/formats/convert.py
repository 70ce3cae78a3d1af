"""Convert a checkpoint into another format, fitted to its target when one is given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eagletools.errors import UserError
from eagletools.formats import gguf
from eagletools.formats.checkpoint import (
    EMBED,
    Checkpoint,
    fit_to_target,
    load_checkpoint,
    parse_dtype,
    save_checkpoint,
)
from eagletools.formats.engines import check_engine


def convert(
    src: str | Path,
    out: str | Path,
    to: str,
    *,
    target: str | None = None,
    dtype: str | None = None,
    with_embeddings: bool = False,
    verifier: str | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    engine: str | None = None,
    log: Callable[[str], Any] = print,
) -> Path:
    """Read `src` (any format), check it, write it to `out` as `to`; returns the folder.

    With `target`, RoPE, max positions and default aux layers come from the
    target, and the speculators verifier defaults to it. `to="gguf"` writes
    one file for llama.cpp and needs `target` (its tokenizer and config).
    With `engine`, a draft that engine would compute differently is refused
    before anything is written (`formats.engines`).
    """
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out}: already exists; pass --force to replace it")
    if to == gguf.NAME:
        if not target:
            raise UserError(
                "--to gguf needs --target: the GGUF draft carries the target's tokenizer and "
                "takes its config (RoPE, context length, default aux layers)"
            )
        target_files = gguf.TargetFiles.resolve(target)  # before any slow load
    ckpt = load_checkpoint(src, allow_pickle=allow_pickle)
    log(f"read {ckpt.source} ({ckpt.format})")
    if to == gguf.NAME:
        gguf.check_supported(ckpt.config)
        loaded = _target_for_gguf(target, with_embeddings, ckpt)
        ckpt, notes = fit_to_target(ckpt, loaded)
        for note in notes:
            log(f"  from target: {note}")
        if engine:
            check_engine(ckpt.config, engine, ckpt.source, loaded.info.num_layers)
        tensors = dict(ckpt.tensors)
        if not with_embeddings:
            tensors.pop(EMBED, None)  # llama.cpp uses the target's
        path = gguf.save_gguf(
            ckpt.config, tensors, out, target_files, dtype=parse_dtype(dtype) if dtype else None
        )
        log(f"wrote {path} (gguf, llama.cpp {gguf.LLAMACPP_BUILD} eagle3)")
        return path
    verifier_spec: str | dict | None = verifier
    if target:
        from eagletools.target import load_target_summary, resolve_spec

        cast = parse_dtype(dtype) if dtype else ckpt.tensors["fc.weight"].dtype
        loaded = load_target_summary(target, dtype=cast)  # config + embeddings, no weights
        ckpt, notes = fit_to_target(ckpt, loaded)
        for note in notes:
            log(f"  from target: {note}")
        if verifier_spec is None:
            location, extra = resolve_spec(target)
            local = "gguf_file" not in extra and Path(location).is_dir()
            name = str(Path(location).resolve()) if local else target
            verifier_spec = {"name_or_path": name, "architectures": [loaded.info.architecture]}
    if engine:
        check_engine(ckpt.config, engine, ckpt.source, loaded.info.num_layers if target else None)
    path = save_checkpoint(
        ckpt,
        out,
        to,
        dtype=dtype,
        with_embeddings=with_embeddings,
        verifier=verifier_spec,
        overwrite=force,
    )
    log(f"wrote {path} ({to})")
    return path


def _target_for_gguf(spec: str, with_embeddings: bool, ckpt: Checkpoint) -> Any:
    """The target to fit to: its config and, when they are to be written, its input
    embeddings read alone (a 70B target's other weights are never loaded), else its
    config alone.

    Without weights its embedding is an empty [0, hidden] stand-in, so the
    checks compare widths and nothing is copied. It answers both ways checks
    ask a target for it (`.embeddings`, `.model.get_input_embeddings()`).
    """
    from eagletools.target import TargetInfo, load_config, load_target_summary

    if with_embeddings and EMBED not in ckpt.tensors:
        return load_target_summary(spec, dtype=ckpt.tensors["fc.weight"].dtype)
    info = TargetInfo.from_config(load_config(spec), spec)
    embedding = torch.nn.Embedding(0, info.hidden_size)
    model = SimpleNamespace(get_input_embeddings=lambda: embedding)
    return SimpleNamespace(model=model, info=info, embeddings=embedding.weight)
