"""Convert a checkpoint into another format, fitted to its target when one is given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagletools.errors import UserError
from eagletools.formats.checkpoint import (
    fit_to_target,
    load_checkpoint,
    parse_dtype,
    save_checkpoint,
)


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
    log: Callable[[str], Any] = print,
) -> Path:
    """Read `src` (any format), check it, write it to `out` as `to`; returns the folder.

    With `target`, RoPE, max positions and default aux layers come from the
    target, and the speculators verifier defaults to it.
    """
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out}: already exists; pass --force to replace it")
    ckpt = load_checkpoint(src, allow_pickle=allow_pickle)
    log(f"read {ckpt.source} ({ckpt.format})")
    verifier_spec: str | dict | None = verifier
    if target:
        from eagletools.target import load_target, resolve_spec

        cast = parse_dtype(dtype) if dtype else ckpt.tensors["fc.weight"].dtype
        loaded = load_target(target, dtype=cast)  # its embeddings in the output's dtype
        ckpt, notes = fit_to_target(ckpt, loaded)
        for note in notes:
            log(f"  from target: {note}")
        if verifier_spec is None:
            location, extra = resolve_spec(target)
            local = "gguf_file" not in extra and Path(location).is_dir()
            name = str(Path(location).resolve()) if local else target
            verifier_spec = {"name_or_path": name, "architectures": [loaded.info.architecture]}
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
