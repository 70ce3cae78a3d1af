"""Convert a checkpoint into another format, fitted to its target when one is given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagletools.errors import UserError
from eagletools.formats.checkpoint import EMBED, fit_to_target, load_checkpoint, save_checkpoint
from eagletools.formats.checks import refuse_or_repair
from eagletools.formats.engines import check_engine
from eagletools.formats.record import RECORD, find_record, record_text


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
    repair: bool = False,
    log: Callable[[str], Any] = print,
) -> Path:
    """Read `src` (any readable format), check it, write it to `out` as `to`; returns the path.

    With `target`, RoPE, max positions and default aux layers come from the
    target, and the speculators verifier defaults to it. `to="gguf"` writes
    one file for llama.cpp and needs `target` (its tokenizer and config).
    With `engine`, a draft that engine would compute differently is refused
    before anything is written (`formats.engines`). A source that fails doctor's
    static checks is refused rather than laundered into a clean config; `repair`
    fixes the unambiguous faults and logs each (`formats.checks.refuse_or_repair`).
    The training record (`formats.record`) goes along into a folder layout.
    """
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out}: already exists; pass --force to replace it")
    ckpt = load_checkpoint(src, allow_pickle=allow_pickle)
    log(f"read {ckpt.source} ({ckpt.format})")
    record = _record_files(src, ckpt.config)  # as trained, before any fitting
    ckpt, repairs = refuse_or_repair(src, ckpt, repair, bool(target), allow_pickle)
    for line in repairs:
        log(f"  {line}")
    summary, verifier_spec = None, verifier
    if target:
        from eagletools.targets import load_target_summary

        # its embeddings only when they are to be copied: a 70B target's are gigabytes
        copy = with_embeddings and EMBED not in ckpt.tensors
        summary = load_target_summary(target, with_embeddings=copy)
        ckpt, notes = fit_to_target(ckpt, summary)
        for note in notes:
            log(f"  from target: {note}")
        if verifier is None:
            verifier_spec = _verifier_of(target, summary.info.architecture)
    if engine:
        check_engine(ckpt.config, engine, ckpt.source, summary.info.num_layers if summary else None)
    path = save_checkpoint(
        ckpt,
        out,
        to,
        dtype=dtype,
        with_embeddings=with_embeddings,
        verifier=verifier_spec,
        target=summary,
        overwrite=force,
        extra_files=record,
    )
    log(f"wrote {path} ({to})")
    return path


def _verifier_of(target: str, architecture: str) -> dict[str, Any]:
    """The speculators verifier for `target`: a local folder by its absolute path."""
    from eagletools.targets import resolve_spec

    location, extra = resolve_spec(target)
    local = "gguf_file" not in extra and Path(location).is_dir()
    name = str(Path(location).resolve()) if local else target
    return {"name_or_path": name, "architectures": [architecture]}


def _record_files(src: str | Path, config: Any) -> dict[str, str]:
    """The source's training record, carried into the output (`formats.record`)."""
    record = find_record(Path(src).expanduser(), config)
    return {RECORD: record_text(record)} if record else {}
