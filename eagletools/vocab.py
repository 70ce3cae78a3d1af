"""The draft vocabulary: which target ids the draft's lm_head predicts (docs/design.md 3.2).

`d2t[i]` is an offset: draft id i is target id `i + d2t[i]`; `t2d` marks the
selected target ids. Selection counts assistant tokens only, takes the top
`Vd` by (count desc, id asc), pads with the smallest unused ids and sorts
ascending, so the result depends on the counts alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagletools.atomic import atomic_file, write_text
from eagletools.errors import UserError

if TYPE_CHECKING:
    from eagletools.data.batch import SampleSource

RUN_VOCAB, RUN_VOCAB_REPORT = "vocab.safetensors", "vocab_report.json"  # in a training run


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [Vd]
    t2d: torch.Tensor  # bool [V]

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def selected(self) -> torch.Tensor:
        """The target ids of draft ids 0..Vd-1."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def is_identity(self) -> bool:
        return self.draft_vocab_size == self.target_vocab_size

    @classmethod
    def identity(cls, vocab_size: int) -> DraftVocab:
        return cls(
            torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)
        )

    @classmethod
    def from_selected(cls, ids: Any, vocab_size: int) -> DraftVocab:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().unique(sorted=True)
        if ids.numel() and (ids[0] < 0 or ids[-1] >= vocab_size):
            raise UserError(f"selected token ids must lie in [0, {vocab_size}), got {ids.tolist()}")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return cls(ids - torch.arange(ids.numel()), t2d)

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int, source: str = "d2t") -> DraftVocab:
        """From the offsets alone (SGLang and vLLM read only `d2t`)."""
        d2t = torch.as_tensor(d2t).cpu()
        if d2t.dtype not in (torch.int32, torch.int64) or d2t.dim() != 1:
            raise UserError(
                f"{source}: d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}"
            )
        d2t = d2t.long()
        ids = torch.arange(d2t.numel()) + d2t
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        inside = ids[(ids >= 0) & (ids < vocab_size)]
        t2d[inside] = True
        vocab = cls(d2t, t2d)
        vocab.validate(source)
        return vocab

    def checks(self) -> list[tuple[str, bool, str]]:
        """Every invariant of docs/design.md 3.2 as (name, holds, detail)."""
        d2t, t2d = self.d2t.cpu(), self.t2d.cpu()
        vd, v = d2t.numel(), t2d.numel()
        out = [
            (
                "d2t is int64 [Vd]",
                d2t.dtype == torch.int64 and d2t.dim() == 1,
                f"{d2t.dtype} {tuple(d2t.shape)}",
            ),
            (
                "t2d is bool [V]",
                t2d.dtype == torch.bool and t2d.dim() == 1,
                f"{t2d.dtype} {tuple(t2d.shape)}",
            ),
            ("1 <= Vd <= V", 1 <= vd <= v, f"Vd={vd}, V={v}"),
        ]
        if not all(ok for _, ok, _ in out):
            return out
        ids = torch.arange(vd) + d2t
        out += [
            ("d2t is non-decreasing", bool((d2t[1:] >= d2t[:-1]).all()), ""),
            ("target ids i + d2t[i] lie in [0, V)", bool(((ids >= 0) & (ids < v)).all()),
             f"range [{int(ids.min())}, {int(ids.max())}]"),
            ("t2d.sum() == Vd", int(t2d.sum()) == vd, f"t2d.sum()={int(t2d.sum())}"),
            ("nonzero(t2d) == arange(Vd) + d2t",
             int(t2d.sum()) == vd and torch.equal(t2d.nonzero().flatten(), ids), ""),
        ]  # fmt: skip
        return out

    def validate(self, source: str = "draft vocabulary") -> None:
        failed = [
            f"{name} ({detail})" if detail else name for name, ok, detail in self.checks() if not ok
        ]
        if failed:
            raise UserError(f"{source}: invalid d2t/t2d: " + "; ".join(failed))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids: `id + d2t[id]`."""
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        self.validate(str(path))
        with atomic_file(path) as tmp:
            save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, str(tmp))

    @classmethod
    def load(cls, path: str | Path, validate: bool = True) -> DraftVocab:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: no such file")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path}: not a safetensors file ({err})") from err
        missing = [k for k in ("d2t", "t2d") if k not in tensors]
        if missing:
            raise UserError(f"{path}: missing tensor(s) {missing}; a vocabulary has d2t and t2d")
        vocab = cls(tensors["d2t"], tensors["t2d"])
        if validate:
            vocab.validate(str(path))
        return vocab


def count_tokens(dataset: Any, vocab_size: int, batch_size: int = 1000) -> torch.Tensor:
    """Counts [V] of target ids at `loss_mask == 1` over a prepared dataset."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for batch in dataset.iter(batch_size=batch_size):
        ids = torch.cat([torch.as_tensor(x, dtype=torch.long) for x in batch["input_ids"]])
        mask = torch.cat([torch.as_tensor(x, dtype=torch.bool) for x in batch["loss_mask"]])
        ids = ids[mask]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise UserError(f"token id {int(ids.max())} outside the target vocab of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_top(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Top `Vd` ids by (count desc, id asc); zero-count ids come smallest first (the padding)."""
    order = torch.sort(-counts, stable=True).indices  # stable: ties stay in id order
    return order[:draft_vocab_size].sort().values


def build_vocab(
    dataset: Any, target_vocab_size: int, draft_vocab_size: int
) -> tuple[DraftVocab, dict[str, Any]]:
    """The top `draft_vocab_size` ids of the dataset's reply tokens."""
    _check_size(target_vocab_size, draft_vocab_size)
    counts = count_tokens(dataset, target_vocab_size)
    return vocab_from_counts(counts, draft_vocab_size, len(dataset))


def vocab_from_counts(
    counts: torch.Tensor, draft_vocab_size: int, num_samples: int
) -> tuple[DraftVocab, dict[str, Any]]:
    """The top `draft_vocab_size` ids of any token counts [V] (replies, or the target's
    argmax there), with the share of the counted tokens they cover."""
    target_vocab_size = counts.numel()
    _check_size(target_vocab_size, draft_vocab_size)
    vocab = DraftVocab.from_selected(select_top(counts, draft_vocab_size), target_vocab_size)
    total = int(counts.sum())
    report = {
        "coverage": float(counts[vocab.t2d].sum()) / total if total else 0.0,
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
        "distinct_tokens": int((counts > 0).sum()),
        "num_samples": num_samples,
        "num_tokens": total,
    }
    return vocab, report


def _check_size(target_vocab_size: int, draft_vocab_size: int) -> None:
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise UserError(
            f"--size {draft_vocab_size}: the draft vocabulary size must be between 1 and the "
            f"target vocabulary size {target_vocab_size}"
        )


def build_vocab_cached(
    prepared: Any, target_vocab_size: int, draft_vocab_size: int
) -> tuple[DraftVocab, dict[str, Any]]:
    """`build_vocab` over a `data.prepare` result, cached by (prepared key, V, Vd).

    The prepared key already covers the data identity, tokenizer, max length
    and sample count.
    """
    from eagletools.assets import cache_dir
    from eagletools.data.prepare import cache_key

    key = cache_key(prepared=prepared.key, vocab_size=target_vocab_size, size=draft_vocab_size)
    folder = cache_dir() / "vocab" / key
    if (folder / "report.json").is_file():  # written last, so the vocab is whole
        return DraftVocab.load(folder / "vocab.safetensors"), json.loads(
            (folder / "report.json").read_text()
        )
    vocab, report = build_vocab(prepared.dataset, target_vocab_size, draft_vocab_size)
    vocab.save(folder / "vocab.safetensors")
    write_text(folder / "report.json", json.dumps(report, indent=2))
    return vocab, report


def reply_counts(source: SampleSource, indices: list[int], vocab_size: int) -> torch.Tensor:
    """`count_tokens` over samples of a `SampleSource` (tokenised data or the offline cache)."""
    import datasets

    rows = {
        "input_ids": [source.batch([i]).input_ids[0].tolist() for i in indices],
        "loss_mask": [source.loss_mask(i).tolist() for i in indices],
    }
    return count_tokens(datasets.Dataset.from_dict(rows), vocab_size)


def run_vocab(
    run_dir: Path,
    *,
    path: str | None,
    size: int,
    count: Callable[[], torch.Tensor],
    num_samples: int,
    counted_by: str,
) -> tuple[DraftVocab, dict[str, Any]]:
    """A training run's draft vocabulary and report: the file at `path`, the one the run
    saved before (a resume), or the top `size` ids of `count()` over `num_samples` samples."""
    if path:
        return DraftVocab.load(path), {"path": path}
    if (run_dir / RUN_VOCAB).is_file():
        report = json.loads((run_dir / RUN_VOCAB_REPORT).read_text())
        return DraftVocab.load(run_dir / RUN_VOCAB), report
    counts = count()
    vocab, report = vocab_from_counts(counts, min(size, counts.numel()), num_samples)
    return vocab, {**report, "count": counted_by}


def save_run_vocab(run_dir: Path, vocab: DraftVocab, report: dict[str, Any]) -> None:
    """Where `run_vocab` finds a run's vocabulary again."""
    vocab.save(run_dir / RUN_VOCAB)
    write_text(run_dir / RUN_VOCAB_REPORT, json.dumps(report, indent=2))
