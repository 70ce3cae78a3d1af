"""The built wheel is complete: installed away from the checkout, its built-in Spec-Bench runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = (
    "eagletools/eval/data/spec_bench/question.jsonl",
    "eagletools/eval/data/spec_bench/LICENSE",
    "eagletools/csrc/bf16_ops.cpp",  # built on the user's machine (eagletools.native)
)


def build_wheel(dest: Path) -> Path:
    """A wheel of a copy of the working tree (the build never writes into the checkout)."""
    src = dest / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(ROOT / "eagletools", src / "eagletools", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dest / "dist"), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = (dest / "dist").glob("eagletools-*.whl")
    return wheel


@pytest.mark.slow
def test_spec_bench_ships_in_the_wheel_and_runs_installed(tiny_target, tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert all(name in names for name in SHIPPED), [
        n for n in names if "/data/" in n or "csrc" in n
    ]

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    # a folder with no ../shared anywhere above the installed package or the working dir
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    script = (
        "import sys, eagletools, eagletools.cli; print(eagletools.__file__, flush=True); "
        "sys.exit(eagletools.cli.main(sys.argv[1:]))"
    )
    args = ["eval", "--target", str(tiny_target), "--draft", "random", "--bench", "spec-bench",
            "--num-prompts", "2", "--dtype", "float32", "--max-new-tokens", "8", "--topk", "2",
            "--depth", "2", "--num-draft-tokens", "4", "--no-progress", "--output-dir", "out"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=work, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[0].startswith(str(site / "eagletools")), run.stdout
    summary = json.loads((work / "out" / "results.json").read_text())["summary"]
    assert summary["prompts"] == 2
