"""The held-out pass (train.held_out): length-ordered batches shared over ranks, each
conversation filed under its own row, and the bootstrap over those rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagletools.train.held_out import HeldOut, bootstrap_intervals, paired_difference
from eagletools.train.ttt import StepStats, summarize


class Rank:
    """The part of accelerate's surface HeldOut reads; `reduce` left to the caller."""

    device = torch.device("cpu")

    def __init__(self, index: int = 0, world: int = 1):
        self.process_index, self.num_processes = index, world

    def reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        return x


def test_held_out_scores_by_length_and_counts_each_conversation_once_over_ranks():
    lengths = {10: 5, 11: 2, 12: 9, 13: 1, 14: 7}
    source = SimpleNamespace(length=lengths.__getitem__)
    seen = []

    def score(rows: list[int]) -> StepStats:
        seen.append(rows)
        ids = torch.tensor(rows, dtype=torch.float32)
        ones = torch.ones(len(rows), 2)
        return StepStats(ones, ones, ones, ids)

    def held_out(rank: Rank) -> HeldOut:
        return HeldOut(source, list(lengths), 2, 2, score, rank)

    whole = held_out(Rank()).per_sample()
    assert seen == [[13, 11], [10, 14], [12]]  # short to long, two a forward
    assert whole.chain.tolist() == list(lengths)  # each under its own row
    # two ranks: as many forwards each (one repeats, uncounted), every row once
    shares = [held_out(Rank(r, 2)).per_sample() for r in range(2)]
    assert len(seen) == 3 + 4
    for name in ("loss_sum", "correct", "count", "chain"):
        total = getattr(shares[0], name) + getattr(shares[1], name)
        assert torch.equal(total, getattr(whole, name)), name


def test_bootstrap_interval_of_a_known_distribution():
    """400 conversations of one position each, hit with p = 0.3: acc_0's standard error
    is sqrt(0.3 * 0.7 / 400) = 0.0229, so the 95% interval spans 2 * 1.96 * 0.0229."""
    g = torch.Generator().manual_seed(0)
    n = 400
    hits = (torch.rand(n, 1, generator=g) < 0.3).float()
    stats = StepStats(torch.zeros(n, 1), hits, torch.ones(n, 1), 1 + hits[:, 0])
    out = bootstrap_intervals(stats, resamples=2000)
    mean = 1 + float(hits.mean())
    for name in ("simulated", "exact"):
        lo, hi = out[f"{name}_acceptance_length_lo"], out[f"{name}_acceptance_length_hi"]
        assert lo < mean < hi
        assert hi - lo == pytest.approx(2 * 1.96 * (0.3 * 0.7 / n) ** 0.5, rel=0.15)


def test_paired_difference_is_tighter_than_the_runs_own_intervals():
    """Two drafts on one held-out set of easy and hard conversations (hit rates 0.05 to
    0.8): b hits where a does, less 5% of a's hits. The runs' own intervals overlap,
    yet the paired interval excludes 0 and is centred on the difference of their
    `summarize` lengths; a draft against itself differs by 0."""
    g = torch.Generator().manual_seed(1)
    n, k = 300, 3
    count = torch.randint(1, 40, (n, k), generator=g).float()
    rate = 0.05 + 0.75 * torch.rand(n, 1, generator=g)
    a_hits = torch.binomial(count, rate.expand(n, k), generator=g)
    b_hits = a_hits - torch.binomial(a_hits, torch.full((n, k), 0.05), generator=g)
    a, b = (StepStats(torch.zeros(n, k), h, count, h[:, 0] + count[:, 0]) for h in (a_hits, b_hits))
    d = paired_difference(a, b)
    for name in ("simulated", "exact"):
        key = f"{name}_acceptance_length"
        point = summarize(a, 1.0)[key] - summarize(b, 1.0)[key]
        assert d[f"{key}_difference"] == pytest.approx(point, abs=1e-6)
        assert 0 < d[f"{key}_difference_lo"] < point < d[f"{key}_difference_hi"]
        own = [bootstrap_intervals(s) for s in (a, b)]
        assert own[1][f"{key}_hi"] > own[0][f"{key}_lo"]  # the runs' intervals overlap
    same = paired_difference(a, a)
    assert same["simulated_acceptance_length_difference_lo"] == 0.0
    assert same["simulated_acceptance_length_difference_hi"] == 0.0
    with pytest.raises(ValueError, match="same held-out conversations"):
        paired_difference(
            a, StepStats(*(x[:-1] for x in (a.loss_sum, a.correct, a.count, a.chain)))
        )
