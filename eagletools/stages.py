"""Resumable stages: a job is a list of steps, each skipped once its output is complete.

Shared by `train()` (regenerate, hidden-state cache) and the pipeline (train,
convert, evaluate), so both decide "done already" and report it the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Stage:
    name: str
    output: Path
    run: Callable[[], Any]
    done: Callable[[Path], bool] = Path.exists  # whether `output` is complete

    def is_done(self) -> bool:
        return self.done(self.output)


def run_stages(stages: Sequence[Stage], progress: str | None = None) -> None:
    """Run every stage that is not done, in order; `progress` names a progress bar."""
    from tqdm.auto import tqdm

    bar = tqdm(stages, desc=progress, unit="stage", disable=progress is None)
    for stage in bar:
        bar.set_postfix_str(stage.name)
        if stage.is_done():
            log.info("%s: done already (%s)", stage.name, stage.output)
            continue
        log.info("%s ...", stage.name)
        stage.run()
