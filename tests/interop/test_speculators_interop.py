"""The real vLLM-side client loads what `convert --to speculators` writes (`make interop`).

Needs the speculators venv (`make interop` creates it); skipped without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SPEC_PYTHON = HERE.parents[1] / ".venv-speculators" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not SPEC_PYTHON.exists(), reason="no .venv-speculators: run `make interop`")
def test_speculators_logits_match_ours(tmp_path):
    sys.path.insert(0, str(HERE))
    from make_case import CASES, make_case

    for name in CASES:
        make_case(tmp_path / name, name)
    result = subprocess.run(
        [str(SPEC_PYTHON), str(HERE / "check_speculators.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "max abs difference, ours vs speculators" in result.stdout
