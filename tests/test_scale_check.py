"""benchmarks/scale_check.py at toy widths: every stage a user runs still runs, so the
shape-real check (docs/results.md) cannot rot between its long runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 45 s on 2 cores: ten child processes, each importing torch
def test_scale_check_runs_every_stage_at_tiny_widths(tmp_path):
    rows = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scale_check.py"), "--preset", "tiny",
           "--models", "llama3.1-8b", "--out", str(tmp_path / "run"), "--json", str(rows)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    stages = [(r["model"], r["stage"]) for r in json.loads(rows.read_text())]
    assert stages == [
        *(("llama3.1-8b", s) for s in ("train (FSDP2 x2)", "cache", "convert eagle",
                                      "convert speculators", "convert gguf", "eval (16k prompt)")),
        ("llama3.1-70b", "convert speculators"), ("llama3.1-70b", "inspect"),
    ]  # fmt: skip
    # the cache writes the walkthrough's bytes per token (plus a fraction for offsets)
    measured, formula = map(
        int, re.search(r"(\d+) B/token \(formula (\d+)\)", done.stdout).groups()
    )
    assert formula <= measured <= formula + 1
    assert "| llama3.1-70b | inspect |" in done.stdout
