"""sgl-jax's own models compute our drafts and capture our aux states (`make interop-sgljax`).

Needs the sgl-jax venv (`make interop-sgljax` creates it); skipped without it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SGLJAX_PYTHON = HERE.parents[1] / ".venv-sgljax" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not SGLJAX_PYTHON.exists(), reason="no .venv-sgljax: run `make interop-sgljax`")
def test_sgljax_computes_our_drafts_and_aux_states(tmp_path):
    sys.path.insert(0, str(HERE))
    from make_sgljax_case import main as make_cases

    make_cases(tmp_path)
    result = subprocess.run(
        [str(SGLJAX_PYTHON), str(HERE / "check_sgljax.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "max abs difference, ours vs sgl-jax" in result.stdout
