"""Tokenise and mask a conversation dataset once; `vocab` and `train` reuse the result.

The cache key covers everything the result depends on: the data (content
hash of a file, file sizes and times of a folder, or a hub id with its split
and revision), the tokenizer (its
serialised vocabulary and merges, special tokens and chat template), the max
length, the number of samples and this module's format version.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagletools import assets
from eagletools.atomic import atomic_dir
from eagletools.data.chat import (
    TemplateMismatch,
    check_tokenizer,
    read_chat_template,
    tokenize_conversation,
)
from eagletools.data.conversations import (
    HubOptions,
    LoadReport,
    Message,
    data_source,
    load_conversations,
)
from eagletools.errors import UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # bump when tokenisation or masking changes, to invalidate caches


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def data_identity(spec: str | Path, hub: HubOptions | None = None) -> str:
    """A string that changes whenever the data behind `spec` changes (for a hub dataset:
    its id, split and revision; only a commit revision pins what a branch name may move)."""
    spec = str(spec)
    if spec in assets.ASSETS:
        return f"asset:{spec}:{assets.ASSETS[spec].sha256}"
    path = data_source(spec)
    if isinstance(path, str):
        hub = hub or HubOptions()
        return f"hub:{path}:{hub.split}:{hub.revision or 'default'}"
    if path.is_file():
        return f"file:{_sha256_file(path)}"
    files = sorted(p for p in path.rglob("*") if p.is_file())
    stats = [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return "dir:" + hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def tokenizer_identity(tokenizer: Any, chat_template: str | None = None) -> str:
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(json.dumps(sorted(tokenizer.all_special_tokens)).encode())
    digest.update((chat_template or tokenizer.chat_template or "").encode())
    return digest.hexdigest()


def cache_key(**parts: Any) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass
class Prepared:
    dataset: Any  # datasets.Dataset with input_ids (int32) and loss_mask (int8) lists
    report: dict[str, Any]
    path: Path
    key: str

    def summary(self) -> str:
        r = self.report
        lines = [LoadReport.from_dict(r["load"]).summary()]
        for reason, n in r["dropped_after_tokenising"].items():
            lines.append(f"  dropped after tokenising: {reason}: {n}")
        lines.append(
            f"prepared {r['num_samples']} samples, {r['num_tokens']} tokens "
            f"({r['num_loss_tokens']} in replies), max length {r['max_length']}: {self.path}"
        )
        return "\n".join(lines)


def _tokenize_fn(tokenizer: Any, max_length: int, chat_template: str | None):
    def fn(row: dict) -> dict:
        conv = [Message(m["role"], m["content"]) for m in row["messages"]]
        try:
            ids, mask = tokenize_conversation(tokenizer, conv, max_length, chat_template)
        except TemplateMismatch:
            return {"input_ids": [], "loss_mask": [], "status": "template_changes_text"}
        status = "ok" if any(mask) else "no_reply_within_max_length"
        return {"input_ids": ids, "loss_mask": mask, "status": status}

    return fn


def _build(
    out: Path,
    tokenizer: Any,
    data_spec: str,
    max_length: int,
    num_samples: int | None,
    chat_template: str | None,
    num_proc: int,
    hub: HubOptions | None,
) -> dict[str, Any]:
    import datasets

    conversations, load_report = load_conversations(data_spec, num_samples, hub)
    log.debug(load_report.summary())
    rows = {
        "messages": [[{"role": m.role, "content": m.content} for m in c] for c in conversations]
    }
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "status": datasets.Value("string"),
        }
    )
    ds = datasets.Dataset.from_dict(rows).map(
        _tokenize_fn(tokenizer, max_length, chat_template),
        remove_columns=["messages"],
        features=features,
        num_proc=num_proc if num_proc > 1 else None,
        new_fingerprint="eagletools-prepare",
        load_from_cache_file=False,
        desc="tokenising",
    )
    status = Counter(ds["status"])
    ds = ds.filter(lambda s: s == "ok", input_columns="status").remove_columns("status")
    if len(ds) == 0:
        raise UserError(
            f"{data_spec}: no conversation has a reply token within --max-length {max_length} "
            f"({dict(status)})"
        )
    lengths = [len(x) for x in ds["input_ids"]]
    report = {
        "data": data_spec,
        "max_length": max_length,
        "num_samples": len(ds),
        "num_tokens": sum(lengths),
        "num_loss_tokens": int(sum(sum(m) for m in ds["loss_mask"])),
        "dropped_after_tokenising": {k: v for k, v in sorted(status.items()) if k != "ok"},
        "load": load_report.to_dict(),
    }
    ds.save_to_disk(str(out / "dataset"))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def prepare(
    target_spec: str | Path,
    data_spec: str | Path,
    max_length: int = 2048,
    num_samples: int | None = None,
    *,
    chat_template: str | Path | None = None,
    num_proc: int = 1,
    tokenizer: Any = None,
    cache_dir: str | Path | None = None,
    hub: HubOptions | None = None,
) -> Prepared:
    """The prepared dataset (from the cache when present), its report and cache folder.

    Pass `tokenizer` when it is already loaded; otherwise only the target's
    tokenizer is loaded (never its weights). `hub` says how a hub dataset id is read.
    """
    import datasets

    from eagletools.targets import load_tokenizer

    if max_length < 2:
        raise UserError(f"--max-length must be at least 2, got {max_length}")
    template = read_chat_template(chat_template)
    data_id = data_identity(data_spec, hub)  # a missing file fails before the tokenizer loads
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_spec)
    check_tokenizer(tokenizer, template, str(target_spec))
    key = cache_key(
        data=data_id,
        tokenizer=tokenizer_identity(tokenizer, template),
        max_length=max_length,
        num_samples=num_samples,
    )
    root = Path(cache_dir) if cache_dir else assets.cache_dir() / "prepared"
    path = root / key
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per key; the others wait and reuse
        if not path.is_dir():
            with atomic_dir(path) as tmp:
                _build(
                    tmp, tokenizer, str(data_spec), max_length, num_samples, template, num_proc, hub
                )
        else:
            log.info("prepared data from cache: %s", path)
    report = json.loads((path / "report.json").read_text())
    report["cache"] = str(path)
    return Prepared(datasets.load_from_disk(str(path / "dataset")), report, path, key)


def prepare_dataset(
    target_spec: str | Path,
    data_spec: str | Path,
    max_length: int = 2048,
    num_samples: int | None = None,
    **kwargs: Any,
):
    """A `datasets.Dataset` with `input_ids` and `loss_mask` columns; see `prepare`."""
    return prepare(target_spec, data_spec, max_length, num_samples, **kwargs).dataset
