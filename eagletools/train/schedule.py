"""How long a run trains and how its learning rate falls: the budgets and the schedule."""

from __future__ import annotations

import math

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
