"""The acceptance a draft reached in training, kept beside its weights.

`eagletools doctor --target` runs the draft and compares its acceptance with
this record: a draft far below its own record has been damaged on the way
(weights swapped or transposed, aux ids shifted), which no static check can
see. The record is `acceptance.json` in the checkpoint folder; `convert`
carries it into every folder layout. A trainer's `final/` has none of its own
yet: its run folder's `metrics.json` (the last held-out pass) is read instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORD = "acceptance.json"
RUN_METRICS = "metrics.json"  # the trainer's, beside final/
# the trained options an engine may read otherwise (doctor's norm_before_residual check)
TRAINED_FIELDS = (
    "norm_before_residual",
    "aux_layer_ids",
    "fc_norm",
    "norm_before_fc",
    "norm_output",
)
LENGTH = "simulated_acceptance_length"


def record_from_metrics(metrics: dict[str, Any], draft: dict[str, Any]) -> dict[str, Any] | None:
    """A record from a held-out pass's metrics (`train.held_out`) and the trained
    `DraftConfig.to_dict()`; None when the run had no held-out pass."""
    steps = sorted(int(k[4:]) for k in metrics if k.startswith("acc_") and k[4:].isdigit())
    acc = metrics.get("acc") or [metrics[f"acc_{j}"] for j in steps]
    if not acc:
        return None
    out = {"source": "held-out pass at the end of training", "acc": [float(a) for a in acc]}
    for key in (LENGTH, LENGTH + "_lo", LENGTH + "_hi", "eval_samples"):
        if key in metrics:
            out[key] = metrics[key]
    out["draft"] = {k: draft[k] for k in TRAINED_FIELDS if k in draft}
    return out


def find_record(folder: str | Path, config: Any = None) -> dict[str, Any] | None:
    """The record of the draft in `folder`: its `acceptance.json`, else, for a trainer's
    `final/`, the run's `metrics.json` with the draft's config (`config`, the loaded
    `DraftConfig`, else read from `folder`); None if neither."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    if (folder / RECORD).is_file():
        return json.loads((folder / RECORD).read_text())
    run = folder.parent / RUN_METRICS
    if folder.name != "final" or not run.is_file():
        return None
    if config is None:
        from eagletools.formats.checkpoint import load_checkpoint

        config = load_checkpoint(folder).config
    return record_from_metrics(json.loads(run.read_text()), config.to_dict())


def record_text(record: dict[str, Any]) -> str:
    """The record as `acceptance.json` holds it."""
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def expected_rates(record: dict[str, Any], depth: int) -> list[float]:
    """Per-position acceptance a chain of `depth` drafts should reach: the share of steps
    that accept at least i+1 drafts is the product of the first i+1 recorded `acc`."""
    rates, running = [], 1.0
    for a in record["acc"][:depth]:
        running *= a
        rates.append(running)
    return rates
