"""The held-out pass: the draft scored on conversations it never trains on, in the
`eval_ttt_steps` unroll, each acceptance length with a bootstrap interval over them.

One set of held-out conversations, split off with the seed, scores every run of a
recipe; the intervals and the paired difference resample those conversations, so two
drafts compare on what they were both asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from eagletools.data.batch import SampleSource
from eagletools.train.data import even_shards
from eagletools.train.ttt import StepStats, summarize


class HeldOut:
    """The held-out conversations `rows`, `batch_size` to a forward in length order (little
    padding), the forwards shared out over the ranks; `score` maps dataset rows to their
    per-conversation `StepStats` (the trainer's unroll over `steps` steps)."""

    def __init__(
        self,
        source: SampleSource,
        rows: list[int],
        batch_size: int,
        steps: int,
        score: Callable[[list[int]], StepStats],
        accelerator: Any,
    ):
        self.source, self.rows, self.steps = source, rows, steps
        self.score, self.accelerator = score, accelerator
        order = sorted(range(len(rows)), key=lambda i: source.length(rows[i]))
        self.chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def _stats(self, chunk: list[int]) -> StepStats:
        return self.score([self.rows[i] for i in chunk])

    def per_sample(self) -> StepStats:
        """Per-conversation sums, every rank's rows: what `metrics` summarises, and what a
        paired comparison of two drafts resamples (`paired_difference`)."""
        device = self.accelerator.device
        total = StepStats.zeros(len(self.rows), self.steps, device)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        for chunk, counted in even_shards(self.chunks, rank, world):
            stats = self._stats(chunk)
            if counted:
                total.add_(stats, torch.tensor(chunk, device=device))
        return total.map(lambda x: self.accelerator.reduce(x, "sum"))

    def metrics(self, decay: float) -> dict[str, float]:
        """Loss, acc_j, simulated and exact acceptance length, each length with its
        bootstrap 95% interval, and the pass's seconds."""
        start = time.perf_counter()
        metrics = held_out_metrics(self.per_sample(), decay)
        return {**metrics, "eval_seconds": time.perf_counter() - start}

    def seconds(self) -> float:
        """The whole pass's seconds, estimated before training from its longest forward
        timed now, scaled by tokens: an overestimate, since shorter rows cost less a token."""
        begun = time.perf_counter()
        float(self._stats(self.chunks[-1]).count.sum())  # a host read: GPUs finish first
        elapsed = time.perf_counter() - begun
        tokens = [sum(self.source.length(self.rows[i]) for i in c) for c in self.chunks]
        return elapsed * sum(tokens) / tokens[-1] / self.accelerator.num_processes


def format_metrics(metrics: dict[str, float]) -> str:
    """The headline of `summarize` (with `bootstrap_intervals`) on one log line."""
    keys = ["loss", "acc_0", "acc_1"]
    out = [f"{k}={metrics[k]:.3f}" for k in keys if k in metrics]
    for name in ("simulated", "exact"):
        key = f"{name}_acceptance_length"
        if key in metrics:
            out.append(f"{key}={metrics[key]:.3f} [{metrics[key + '_lo']:.3f}, "
                       f"{metrics[key + '_hi']:.3f}]")  # fmt: skip
    return " ".join(out)


def _resampled_lengths(stats: StepStats, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Both acceptance lengths [R] of the resamples `weights` [R,N] (row counts)."""
    correct = weights @ stats.correct.cpu().float()
    count = (weights @ stats.count.cpu().float()).clamp(min=1.0)
    return {
        "simulated": 1 + torch.cumprod(correct / count, dim=1).sum(1),
        "exact": (weights @ stats.chain.cpu().float()) / count[:, 0],
    }


def _resample_weights(n: int, resamples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, n, (resamples, n), generator=g)
    return torch.zeros(resamples, n).scatter_add_(1, draws, torch.ones(resamples, n))


def _percentiles(values: torch.Tensor, level: float) -> tuple[float, float]:
    lo, hi = torch.quantile(values, torch.tensor([(1 - level) / 2, (1 + level) / 2])).tolist()
    return lo, hi


def bootstrap_intervals(
    stats: StepStats, resamples: int = 1000, level: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """Percentile intervals of both acceptance lengths over samples drawn with
    replacement from the rows (held-out conversations) of per-sample `stats`."""
    weights = _resample_weights(stats.count.shape[0], resamples, seed)
    out = {}
    for name, values in _resampled_lengths(stats, weights).items():
        lo, hi = _percentiles(values, level)
        out[f"{name}_acceptance_length_lo"], out[f"{name}_acceptance_length_hi"] = lo, hi
    return out


def held_out_metrics(per_sample: StepStats, decay: float) -> dict[str, float]:
    """`summarize` with both lengths' bootstrap intervals: what a held-out pass reports."""
    return {**summarize(per_sample, decay), **bootstrap_intervals(per_sample)}


def paired_difference(
    a: StepStats, b: StepStats, resamples: int = 1000, level: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """a's acceptance lengths minus b's, with percentile intervals from resampling the
    same conversations for both: two drafts scored on one held-out set share its easy
    and hard conversations, so the difference is known more tightly than the two
    runs' own intervals suggest."""
    if a.count.shape != b.count.shape or not torch.equal(a.count.cpu(), b.count.cpu()):
        raise ValueError(
            "paired_difference: the two stats count different positions; score both "
            "drafts on the same held-out conversations with the same eval_ttt_steps"
        )
    n = a.count.shape[0]
    weights = torch.cat([torch.ones(1, n), _resample_weights(n, resamples, seed)])  # row 0: all
    mine, theirs = _resampled_lengths(a, weights), _resampled_lengths(b, weights)
    out = {}
    for name in mine:
        diff = mine[name] - theirs[name]
        point, (lo, hi) = diff[0], _percentiles(diff[1:], level)
        key = f"{name}_acceptance_length_difference"
        out[key], out[f"{key}_lo"], out[f"{key}_hi"] = float(point), lo, hi
    return out
