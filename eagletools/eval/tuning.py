"""The tree shape a run drafts with when it gives none: measured here once, then cached.

A shape that suits a GPU can make a CPU slower than plain decoding (issue 42:
topk 4, depth 5, 16 nodes gave tau 1.8 at 0.97x plain decoding's tokens/s on
2 cores). So when none of `--topk`, `--depth`, `--num-draft-tokens` (or the
recipe's `eval` fields) is given, `choose_tree` times `TUNE_GRID` (plain
decoding, two chains, two trees) on `TUNE_PROMPTS` through
`eval.runner.autotune` and keeps the fastest: plain decoding when no shape
beats it. The choice is kept in `tuned_shapes.json` in the eagletools cache
under everything it depends on (`tune_key`): the target, a hash of the
draft's files, the machine and threads, dtype, numerics, sampling, and the
versions of eagletools and torch. `--no-tune` (`eval.tune: false`) drafts
`FIXED_SHAPE` instead, the default before the tune.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagletools.eval.benchmarks import Question
from eagletools.eval.measure import loaded_by_others, machine_key

if TYPE_CHECKING:
    from eagletools.eval.runner import Settings

log = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # (topk, depth, num_draft_tokens)

FIXED_SHAPE: Shape = (4, 5, 16)  # --no-tune; and the rest of a shape given in part
# None is plain decoding; chains of 2 and 3 drafts pay on CPUs, where a wide verify costs
# much more than one row (issue 16); the fixed shape for where it pays (GPUs)
TUNE_GRID: tuple[Shape | None, ...] = (None, (1, 2, 3), (1, 3, 4), (2, 3, 6), FIXED_SHAPE)
TUNE_TOKENS = 64  # per prompt and shape: a small fixed budget
TUNE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, with a small Python example.",
)
CACHE_FILE = "tuned_shapes.json"
DRAFT_FILES = (".json", ".safetensors", ".bin")  # a draft folder's config and weights


def tune_questions() -> list[Question]:
    return [Question(f"tune-{i}", "tune", (p,)) for i, p in enumerate(TUNE_PROMPTS)]


def shape_label(shape: Shape | None) -> str:
    """A shape as the tune's record key and in messages: `plain`, or `topk/depth/nodes`."""
    return "plain" if shape is None else "/".join(map(str, shape))


def trial_shape(trial: dict) -> Shape | None:
    """The shape one timed trial of `eval.runner.autotune` ran (None: plain decoding)."""
    if trial["topk"] is None:
        return None
    return trial["topk"], trial["depth"], trial["num_draft_tokens"]


@dataclass
class TreeChoice:
    """The shape a run drafts with (None: plain decoding, the draft not run) and whence:
    `given`, `fixed` (--no-tune), `tuned` (measured now), `cache` or `autotune`."""

    shape: Shape | None
    source: str
    tune: dict | None = None  # autotune's prompts and trials, and the seconds it took

    def speedup(self) -> float | None:
        """The chosen shape's tokens/s over plain decoding's in the tune."""
        rates = {trial_shape(t): t["tokens_per_s"] for t in (self.tune or {}).get("trials", [])}
        plain, chosen = rates.get(None), rates.get(self.shape)
        return chosen / plain if plain and chosen else None

    def record(self) -> dict:
        """results.json's `tree`."""
        topk, depth, nodes = self.shape or (None, None, None)
        return {"topk": topk, "depth": depth, "num_draft_tokens": nodes,
                "plain": self.shape is None, "source": self.source, "tune": self.tune}  # fmt: skip

    def line(self) -> str | None:
        """The one line a run prints about a shape it did not give (None: it gave one)."""
        if self.source in ("given", "autotune"):
            return None
        if self.source == "fixed":
            return f"tree {shape_label(self.shape)} (topk/depth/nodes), fixed by --no-tune"
        speedup = self.speedup()
        what = (
            "plain decoding: no tree shape beat it here, so the draft is not run"
            if self.shape is None
            else f"tree {shape_label(self.shape)} (topk/depth/nodes)"
            + (f", {speedup:.2f}x plain decoding in the tune" if speedup else "")
        )
        how = (
            f"tuned now in {self.tune['seconds']:.0f} s"
            if self.source == "tuned"
            else f"from the tune cache {cache_path()}"
        )
        return f"{what} ({how}; --topk/--depth/--num-draft-tokens choose a shape, --no-tune 4/5/16)"


def cache_path() -> Path:
    from eagletools.assets import cache_dir

    return cache_dir() / CACHE_FILE


def draft_identity(spec: str) -> str:
    """`random[:SEED]` as given; a draft on disk by a hash of its config and weights files,
    so a draft retrained or replaced in the same place is tuned again."""
    path = Path(spec)
    if not path.exists():
        return spec
    files = (
        [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in DRAFT_FILES)
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as f:  # in blocks: hashlib.file_digest needs Python 3.11
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()[:24]


def tune_key(s: Settings) -> dict:
    """Everything the fastest shape depends on (call after the run set its threads)."""
    import torch

    from eagletools import __version__

    return {
        "target": s.target, "draft": draft_identity(s.draft), "dtype": s.dtype,
        "machine": machine_key(torch.device(s.device)), "compile": s.compile,
        "fast_numerics": s.fast_numerics, "sampling": [s.temperature, s.top_k, s.top_p],
        "eagletools": __version__, "torch": torch.__version__,
        "grid": [shape_label(g) for g in TUNE_GRID], "prompts": len(TUNE_PROMPTS),
        "tokens": TUNE_TOKENS,
    }  # fmt: skip


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _cached(entry: object) -> TreeChoice | None:
    """A cache entry as a choice; None (with a warning) when it is not one."""
    shape = entry.get("shape", "missing") if isinstance(entry, dict) else "missing"
    if shape is None or (
        isinstance(shape, list) and len(shape) == 3 and all(isinstance(x, int) for x in shape)
    ):
        tune = entry.get("tune")
        return TreeChoice(shape and tuple(shape), "cache", tune if isinstance(tune, dict) else None)
    log.warning("ignoring a malformed entry of %s; tuning again", cache_path())
    return None


def choose_tree(s: Settings, measure: Callable[[], dict]) -> TreeChoice:
    """The shape `s` gives; given none, the one tuned for `tune_key(s)`: from the cache, or
    `measure()` now (`eval.runner.autotune` over TUNE_GRID) and cached. `--no-tune` and
    `--autotune` (which searches its own grid next) take FIXED_SHAPE untimed."""
    from eagletools.assets import read_cache_json, write_cache_json

    if s.shape is not None:
        return TreeChoice(s.shape, "given")
    if s.autotune:  # its search over the benchmark replaces this shape before any timing
        return TreeChoice(FIXED_SHAPE, "autotune")
    if not s.tune:
        return TreeChoice(FIXED_SHAPE, "fixed")
    key = tune_key(s)
    digest, path = _digest(key), cache_path()
    known = read_cache_json(path)
    if (entry := known.get(digest)) is not None and (hit := _cached(entry)) is not None:
        return hit
    start = time.perf_counter()
    tune = measure()
    tune["seconds"] = round(time.perf_counter() - start, 1)
    chosen = trial_shape(tune["best"])
    if loaded_by_others(tune["load_during_timing"], os.cpu_count()):
        # a choice timed beside other work would stay wrong for every later run: not kept
        log.warning("other work loaded the machine during the tree shape tune (load average "
                    "up to %s): its choice serves this run only, and the next run tunes again",
                    tune["load_during_timing"]["max"])  # fmt: skip
        return TreeChoice(chosen, "tuned", tune)
    known[digest] = {"key": key, "shape": chosen and list(chosen), "tune": tune,
                     "measured": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    write_cache_json(path, known)
    return TreeChoice(chosen, "tuned", tune)
