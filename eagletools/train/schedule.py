"""How long a run trains and how its learning rate falls: the budgets and the schedule."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from eagletools.errors import UserError
from eagletools.train.recipe import TrainingSection

log = logging.getLogger(__name__)

# the final checkpoint, the draft folder and metrics after the held-out pass
FINISH_SECONDS = 30.0


def lr_factor(
    step: int, progress: float, warmup_steps: int, min_ratio: float, schedule: str = "cosine"
) -> float:
    """Linear warmup over `warmup_steps`, then a cosine or linear decay over `progress`
    in [0, 1]."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    done = min(1.0, progress)
    decay = 0.5 * (1 + math.cos(math.pi * done)) if schedule == "cosine" else 1 - done
    return min_ratio + (1 - min_ratio) * decay


def step_seconds_budget(
    max_minutes: float | None,
    total_minutes: float | None,
    spent_s: float = 0.0,
    held_out_s: float = 0.0,
) -> float | None:
    """Seconds of training steps a run may take: `training.max_minutes` (the steps alone),
    and what `training.total_minutes` (the whole run) leaves after the `spent_s` already
    gone (data stages, set-up), the final held-out pass and the finish. None: no time
    budget; <= 0: the whole run's budget is spent before training starts."""
    budgets = [60.0 * max_minutes] if max_minutes is not None else []
    if total_minutes is not None:
        budgets.append(60.0 * total_minutes - spent_s - held_out_s - FINISH_SECONDS)
    return min(budgets) if budgets else None


def time_budget(
    t: TrainingSection, spent_s: float, held_out_s: float, mean: Callable[[float], float]
) -> float | None:
    """`step_seconds_budget` made one number for all ranks (`mean` over them), so that they
    stop together; refuses a run whose budget is spent before its first step."""
    budget = step_seconds_budget(t.max_minutes, t.total_minutes, spent_s, held_out_s)
    if budget is None:
        return None
    budget = mean(budget)
    if budget <= 0:
        raise UserError(
            f"training.total_minutes={t.total_minutes}: the data stages and set-up took "
            f"{spent_s / 60:.1f} minutes and the held-out pass needs ~{held_out_s / 60:.1f}, "
            "leaving no time to train; raise training.total_minutes or lower "
            "data.num_samples (or data.eval_samples)"
        )
    if t.total_minutes is not None:
        log.info("training.total_minutes=%s: %.1f minutes of training steps (held-out "
                 "pass ~%.1f)", t.total_minutes, budget / 60, held_out_s / 60)  # fmt: skip
    return budget


@dataclass(frozen=True)
class Schedule:
    """A run's end and its learning rate, answered from where it stands (step, tokens,
    seconds of steps): fixed at the start, so a resumed run follows the same schedule.

    The run ends at the first budget spent: `total` steps (unless training.max_tokens
    alone ends it), `max_tokens`, or `budget_s` seconds; the rate decays over the
    largest share spent of those.
    """

    total: int  # optimizer steps (the progress bar's length)
    warmup: int
    lr: float
    min_lr_ratio: float = 0.0
    decay: str = "cosine"
    max_tokens: int | None = None
    by_steps: bool = True  # steps end the run (and move the schedule)
    budget_s: float | None = None

    @classmethod
    def of(
        cls, t: TrainingSection, steps_per_epoch: int, epoch_tokens: int, budget_s: float | None
    ) -> Schedule:
        """The recipe's schedule; under training.max_tokens `total` is the steps of the epochs
        those tokens fill (the bar, warmup_ratio)."""
        epochs = t.num_epochs if t.max_tokens is None else t.max_tokens / max(1, epoch_tokens)
        total = t.max_steps or max(1, math.ceil(steps_per_epoch * epochs))
        warmup = t.warmup_steps if t.warmup_steps is not None else round(t.warmup_ratio * total)
        by_steps = t.max_tokens is None or t.max_steps is not None
        return cls(total, warmup, t.lr, t.min_lr_ratio, t.schedule, t.max_tokens, by_steps,
                   budget_s)  # fmt: skip

    def progress(self, step: int, tokens: int, seconds: float) -> float:
        """Share of the schedule done: the largest of the steps', the tokens' and the time's."""
        shares = [seconds / self.budget_s] if self.budget_s is not None else []
        shares += [tokens / self.max_tokens] if self.max_tokens is not None else []
        if self.by_steps:
            shares.append((step - self.warmup) / max(1, self.total - self.warmup))
        return max(shares)

    def spent(self, step: int, tokens: int) -> bool:
        """The steps or the tokens (global counts, the same on every rank) are used up."""
        return (self.by_steps and step >= self.total) or tokens >= (self.max_tokens or math.inf)

    def end_step(self, step: int, tokens: int, seconds: float) -> int:
        """The step the run will end at, at its pace so far (the progress bar's length):
        `total`, or fewer where the tokens or the time will run out first."""
        share = self.progress(step, tokens, seconds)
        if step <= 0 or share <= 0:
            return self.total
        return max(step, min(self.total, round(step / share)))

    def late(self, seconds: float) -> bool:
        """This rank's time is up (ranks differ: the trainer stops all on the first late)."""
        return self.budget_s is not None and seconds >= self.budget_s

    def learning_rate(self, step: int, tokens: int, seconds: float) -> float:
        progress = self.progress(step, tokens, seconds)
        return self.lr * lr_factor(step, progress, self.warmup, self.min_lr_ratio, self.decay)
