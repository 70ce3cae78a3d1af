"""The schedule (train.schedule): warmup and decay, the budgets that end a run, and the
share of it done, all from where the run stands."""

from __future__ import annotations

import pytest

from eagletools.errors import UserError
from eagletools.train.recipe import TrainingSection
from eagletools.train.schedule import (
    FINISH_SECONDS,
    Schedule,
    lr_factor,
    step_seconds_budget,
    time_budget,
)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(schedule):
    """Warmup reaches the full rate at its last step; both decays start at 1, end at
    min_ratio, and differ in between (a quarter in: cosine 0.854, linear 0.75)."""
    factor = lambda step, progress: lr_factor(step, progress, 4, 0.1, schedule)  # noqa: E731
    assert [factor(s, 0.0) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factor(4, 0.0) == pytest.approx(1.0)
    assert factor(9, 1.0) == factor(9, 1.5) == pytest.approx(0.1)
    quarter = {"cosine": 0.1 + 0.9 * 0.5 * (1 + 2**-0.5), "linear": 0.1 + 0.9 * 0.75}
    assert factor(6, 0.25) == pytest.approx(quarter[schedule])


def test_step_seconds_budget_takes_the_tighter_of_the_two():
    assert step_seconds_budget(None, None) is None
    assert step_seconds_budget(2.0, None, spent_s=500.0) == 120.0  # the steps alone
    whole = 60.0 * 10 - 100.0 - 40.0 - FINISH_SECONDS
    assert step_seconds_budget(None, 10.0, 100.0, 40.0) == whole
    assert step_seconds_budget(5.0, 10.0, 100.0, 40.0) == 300.0
    assert step_seconds_budget(9.0, 10.0, 100.0, 40.0) == whole


def test_time_budget_is_the_ranks_mean_and_refuses_none_left():
    t = TrainingSection(total_minutes=1.0)
    assert time_budget(TrainingSection(), 5.0, 1.0, mean=lambda x: x) is None
    assert time_budget(t, 10.0, 5.0, mean=lambda x: x + 1) == 60 - 15 - FINISH_SECONDS + 1
    with pytest.raises(UserError, match="training.total_minutes=1.0.*no time to train"):
        time_budget(t, 40.0, 0.0, mean=lambda x: x)


def test_schedule_sizes_its_steps_from_epochs_or_tokens():
    plain = Schedule.of(TrainingSection(num_epochs=2.5, warmup_ratio=0.1), 10, 999, None)
    assert (plain.total, plain.warmup, plain.by_steps) == (25, 2, True)
    steps = Schedule.of(TrainingSection(max_steps=7, warmup_steps=3), 10, 999, None)
    assert (steps.total, steps.warmup) == (7, 3)
    # 3000 tokens of a 1000-token epoch: three epochs' steps (the bar), ended by tokens
    tokens = Schedule.of(TrainingSection(max_tokens=3000), 10, 1000, 60.0)
    assert (tokens.total, tokens.by_steps, tokens.budget_s) == (30, False, 60.0)


def test_the_first_budget_spent_ends_the_run_and_the_largest_share_moves_the_rate():
    s = Schedule(total=12, warmup=2, lr=1.0, max_tokens=1000, budget_s=100.0)
    assert s.progress(7, 100, 10.0) == pytest.approx(0.5)  # the steps': (7 - 2) / 10
    assert s.progress(7, 800, 10.0) == pytest.approx(0.8)  # the tokens'
    assert s.progress(7, 100, 90.0) == pytest.approx(0.9)  # the time's
    assert not s.spent(11, 999) and s.spent(12, 0) and s.spent(0, 1000)
    assert not s.late(99.9) and s.late(100.0)
    assert not Schedule(total=12, warmup=0, lr=1.0).late(1e9)  # no time budget
    # tokens alone end the run: the steps neither end it nor move the rate
    by_tokens = Schedule(total=12, warmup=0, lr=1.0, max_tokens=1000, by_steps=False)
    assert not by_tokens.spent(50, 999) and by_tokens.progress(50, 250, 0.0) == 0.25
    assert s.learning_rate(0, 0, 0.0) == pytest.approx(0.5)  # warmup's first step
    assert s.learning_rate(12, 0, 0.0) == pytest.approx(0.0)  # cosine to the floor


def test_the_bar_ends_where_the_first_budget_will():
    """`make demo` trains 16 minutes of a 936-step plan: its bar and ETA say ~216, not 936."""
    s = Schedule(total=936, warmup=10, lr=1.0, budget_s=960.0)
    assert s.end_step(0, 0, 0.0) == 936
    assert s.end_step(54, 0, 240.0) == 216  # a quarter of the time at step 54
    assert s.end_step(900, 0, 10.0) == 936  # the steps run out first
    assert Schedule(total=100, warmup=0, lr=1.0, max_tokens=1000).end_step(10, 500, 0.0) == 20
