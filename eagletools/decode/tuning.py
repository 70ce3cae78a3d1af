"""Tree shapes: the grid a run times, the timing, and the choice it keeps.

A shape that suits a GPU can make a CPU slower than plain decoding (issue 42:
topk 4, depth 5, 16 nodes gave tau 1.8 at 0.97x plain decoding's tokens/s on
2 cores). So a run that gives no shape times a grid (plain decoding and its draft
kind's shapes, `DraftKind.shapes`) and keeps the fastest: plain decoding when no shape beats
it (decode.session.choose_tree, which also caches the choice). Every shape
is warmed first, then takes each prompt in turn, in rounds (decode.timing), so
a change in load hits them alike; medians are kept. A shape far behind after the
first round is not timed again, and a shape must beat plain decoding by
`MIN_GAIN` to be chosen: a tie within the noise keeps the draft off, so two
tunes on an idle machine choose alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagletools.decode.sampling import Sampling
from eagletools.decode.timing import Decoder, Run, run_methods

log = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # (topk, depth, num_draft_tokens)

FIXED_SHAPE: Shape = (4, 5, 16)  # --no-tune; and the rest of a shape given in part
TUNE_TOKENS = 64  # per prompt and shape: a small fixed budget
TUNE_ROUNDS = 3  # timed rounds per shape after its warm-up; the median kept
DROP_BELOW = 0.75  # of the first round's fastest: a shape this slow is not timed again
MIN_GAIN = 1.03  # over plain decoding's tokens/s, for a shape to be chosen
TUNE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, with a small Python example.",
)
CACHE_FILE = "tuned_shapes.json"
DRAFT_FILES = (".json", ".safetensors", ".bin")  # a draft folder's config and weights


def shape_label(shape: Shape | None) -> str:
    """A shape as the tune's record key and in messages: `plain`, or `topk/depth/nodes`."""
    return "plain" if shape is None else "/".join(map(str, shape))


def trial_shape(trial: dict) -> Shape | None:
    """The shape one timed trial of `time_shapes` ran (None: plain decoding)."""
    if trial["topk"] is None:
        return None
    return trial["topk"], trial["depth"], trial["num_draft_tokens"]


@dataclass
class TreeChoice:
    """The shape a run drafts with (None: plain decoding, the draft not run) and whence:
    `given`, `fixed` (--no-tune), `tuned` (measured now), `cache` or `autotune`."""

    shape: Shape | None
    source: str
    tune: dict | None = None  # the tune's prompts and trials, and the seconds it took

    def speedup(self) -> float | None:
        """The chosen shape's tokens/s over plain decoding's in the tune."""
        rates = {trial_shape(t): t["tokens_per_s"] for t in (self.tune or {}).get("trials", [])}
        plain, chosen = rates.get(None), rates.get(self.shape)
        return chosen / plain if plain and chosen else None

    def record(self) -> dict:
        """results.json's `tree` (an --autotune search's trials are results.json's `autotune`)."""
        topk, depth, nodes = self.shape or (None, None, None)
        tune = None if self.source == "autotune" else self.tune
        return {"topk": topk, "depth": depth, "num_draft_tokens": nodes,
                "plain": self.shape is None, "source": self.source, "tune": tune}  # fmt: skip

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


def cached_choice(key: dict) -> TreeChoice | None:
    """The choice kept under `key` in the tune cache, if any (and well formed)."""
    from eagletools.assets import read_cache_json

    entry = read_cache_json(cache_path()).get(_digest(key))
    return None if entry is None else _cached(entry)


def keep_choice(key: dict, chosen: Shape | None, tune: dict) -> None:
    """Cache `chosen` (None: plain decoding) and its tune under `key`."""
    from eagletools.assets import read_cache_json, write_cache_json

    path = cache_path()
    known = read_cache_json(path)
    known[_digest(key)] = {"key": key, "shape": chosen and list(chosen), "tune": tune,
                           "measured": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    write_cache_json(path, known)


def time_shapes(
    grid: Sequence[Shape | None],
    decoder: Callable[[Shape | None], object],
    prompts: Sequence[str],
    tokenizer,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    device: str,
    rounds: int = TUNE_ROUNDS,
) -> tuple[dict, dict[Shape | None, object]]:
    """Time each shape of `grid` (`decoder(shape)` makes its decoder; None: plain) on
    `prompts`: (the tune: its trials, the best and other processes' load while timing;
    the decoders, so the chosen one is kept, its compiled step not made again).

    Every candidate first decodes the first prompt untimed (compiled graphs, packed
    weights and caches at size: no cold candidate is timed). Then `rounds` rounds,
    each prompt through every candidate in turn, the order rotated each round; a
    trial's tokens/s is the median of its rounds'. After the first round only plain
    decoding and the shapes within `DROP_BELOW` of its fastest go on.
    """
    tried = {shape: decoder(shape) for shape in grid}
    timed = [
        Decoder(shape_label(shape), d, max_new_tokens, sampling,
                torch.Generator(device=device).manual_seed(seed))
        for shape, d in tried.items()
    ]  # fmt: skip
    conversations = [(p,) for p in prompts]
    run_methods([timed], conversations[:1], tokenizer, progress=False)  # the untimed warm-up
    runs: dict[str, list[list[Run]]] = {}
    loads = []
    for r in range(rounds):
        order = timed[r % len(timed) :] + timed[: r % len(timed)]
        measured = run_methods([order], conversations, tokenizer, progress=False)
        loads.append(measured.machine["load_during_timing"])
        for key, got in measured.runs.items():
            runs.setdefault(key, []).append(got)
        if r == 0:
            rates = {d.key: _trial(None, runs[d.key])["tokens_per_s"] for d in timed}
            keep = DROP_BELOW * max(rates.values())
            timed = [d for d in timed if d.key == "plain" or rates[d.key] >= keep]
    trials = [_trial(shape, runs[shape_label(shape)]) for shape in grid]
    best = _best(trials)
    tune = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "rounds": rounds,
            "trials": trials, "best": best,
            "load_during_timing": max(loads, key=lambda load: load["others"])}  # fmt: skip
    return tune, tried


def _best(trials: list[dict]) -> dict:
    """The fastest trial, plain decoding's unless a shape beats it by `MIN_GAIN`."""
    plain = next((t for t in trials if t["topk"] is None), None)
    fastest = max(trials, key=lambda t: t["tokens_per_s"])
    if plain and fastest["tokens_per_s"] < MIN_GAIN * plain["tokens_per_s"]:
        return plain
    return fastest


def _trial(shape: Shape | None, rounds: list[list[Run]]) -> dict:
    """One shape's figures in a tune: the median over rounds of tokens/s over its prompts
    (each round's kept), and tau over every step (plain: 1)."""
    topk, depth, nodes = shape or (None, None, None)
    rates = [sum(r.num_tokens for r in runs) / sum(r.seconds for r in runs) for runs in rounds]
    accepted = [a for runs in rounds for r in runs for a in r.accepted or []]
    return {
        "topk": topk, "depth": depth, "num_draft_tokens": nodes,
        "tokens_per_s": statistics.median(rates), "rounds": [round(x, 2) for x in rates],
        "tau": 1 + sum(accepted) / len(accepted) if shape and accepted else 1.0,
    }  # fmt: skip
