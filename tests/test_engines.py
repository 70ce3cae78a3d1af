"""`eagletools eval --engine`: server lifecycle, command lines, counters, against fake servers.

tests/engines/fake_engine.py speaks the real engines' flags, endpoints and
counter formats; the real vLLM and llama.cpp run in `make interop`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from eagletools.cli import main
from eagletools.engines import ENGINES, Counters
from eagletools.engines.base import parse_metrics
from eagletools.engines.llamacpp import _per_position
from eagletools.engines.server import free_port, serve
from eagletools.errors import UserError

FAKE = Path(__file__).parent / "engines" / "fake_engine.py"


def _gone(pid: int, wait: float = 10.0) -> bool:
    """Whether `pid` has exited (a zombie counts) within `wait` s: SIGKILL lands asynchronously."""
    deadline = time.monotonic() + wait
    while True:
        status = Path(f"/proc/{pid}/stat")
        try:
            if status.read_text().split()[2] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _speculators_draft(folder):
    """A real (tiny, random) speculators draft: `eval --engine` reads its options first."""
    from test_formats import make_ckpt

    from eagletools.formats import save_checkpoint

    return save_checkpoint(make_ckpt(), folder, "speculators", overwrite=True)


def _eval(target, draft, engine, out, *extra, status: int = 0) -> dict | None:
    argv = ["eval", "--target", str(target), "--bench", "mt-bench", "--num-prompts", "2",
            "--max-new-tokens", "9", "--depth", "3", "--engine", engine, "--output-dir", str(out),
            "--no-progress", "--engine-timeout", "60", *extra]  # fmt: skip
    if draft:
        argv += ["--draft", str(draft)]
    assert main(argv) == status
    return json.loads((out / "results.json").read_text()) if status == 0 else None


def test_prometheus_samples_and_counters():
    text = (
        "# HELP x\n"
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 4.0\n'
        "llamacpp:spec_decode_num_drafts_total 12\n"
    )
    assert parse_metrics(text) == [
        (
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            {"engine": "0", "position": "1"},
            4.0,
        ),
        ("llamacpp:spec_decode_num_drafts_total", {}, 12.0),
    ]
    assert Counters(5, 4, [3, 1]) - Counters(1, 1, [1]) == Counters(4, 3, [2, 1])


def test_llamacpp_per_position_from_its_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "slot print_timing: id  0 | task 1 | draft acceptance = 0.33333 (   10 accepted /    30 "
        "generated), mean len =  2.00\n"
        "slot print_timing: id  0 | task 1 |      acc per pos = (0.700, 0.300, 0.000)\n"
        "slot print_timing: id  0 | task 2 | draft acceptance = 0.00000 (    0 accepted /     6 "
        "generated), mean len =  1.00\n"
        "slot print_timing: id  0 | task 2 |      acc per pos = (0.000, 0.000, 0.000)\n"
    )
    assert _per_position(log) == [7, 3, 0]


@pytest.mark.parametrize("engine", ["vllm", "llama.cpp"])
def test_engine_eval_reads_the_engines_counters(engine, fake_engines, tiny_target, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    if engine == "llama.cpp":
        (draft / "draft.gguf").write_bytes(b"GGUF fake draft")
    else:
        _speculators_draft(draft)
    results = _eval(tiny_target, draft, engine, tmp_path / "out")

    s = results["summary"]
    # the fake accepts 0, 1, 2, 3, 0, ... drafts per step: 9 tokens = steps of 1, 2, 3, 3(cut)
    assert s["prompts"] == 2 and s["verify_steps"] > 0
    assert s["tau"] == pytest.approx(
        1
        + sum(r["speculative"]["acceptance"]["accepted"] for r in results["per_prompt"])
        / s["verify_steps"]
    )
    assert len(s["per_position_acceptance"]) == 3
    assert s["per_position_acceptance"][0] >= s["per_position_acceptance"][1] > 0
    assert s["greedy_match_rate"] == 1.0
    assert results["settings"]["engine"] == engine and results["settings"]["topk"] == 1
    first = results["per_prompt"][0]  # results.json's record schema for an engine
    assert set(first) == {"id", "category", "turns", "baseline", "speculative", "greedy_match"}
    assert set(first["speculative"]) >= {"new_tokens", "seconds", "tokens_per_s", "acceptance"}
    assert results["machine"]["load_during_timing"]["samples"] == 8  # 2 servers x 2 prompts x 2
    logs = sorted(p.name for p in (tmp_path / "out").glob("*.log"))
    assert logs == [f"{engine}-plain.log", f"{engine}-with-the-draft.log"]
    argv = (tmp_path / "out" / f"{engine}-with-the-draft.log").read_text()
    assert "127.0.0.1" in argv
    if engine == "llama.cpp":
        assert "--spec-type draft-eagle3 --spec-draft-n-max 3" in argv
        assert (tmp_path / "cache" / "gguf").is_dir()  # the target went through the converter
    else:
        assert '"method": "eagle3"' in argv and '"num_speculative_tokens": 3' in argv
    assert "engine vllm" in (tmp_path / "out" / "results.md").read_text() or engine != "vllm"


def test_divergence_is_reported_with_its_position(fake_engines, tiny_target, tmp_path, monkeypatch):
    draft = _speculators_draft(tmp_path / "draft")
    monkeypatch.setenv("FAKE_ENGINE_MODE", "diverge")
    results = _eval(tiny_target, draft, "vllm", tmp_path / "out")
    first = results["per_prompt"][0]
    assert first["greedy_match"] is False
    assert first["baseline_difference"] == {"turn": 0, "index": 3}


def test_engine_not_installed_names_the_make_target(tmp_path, monkeypatch, tiny_target, capsys):
    monkeypatch.setenv("EAGLETOOLS_ENGINES", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    _eval(tiny_target, None, "vllm", tmp_path / "out", status=2)
    assert "vLLM is not installed: run `make engine-vllm`" in capsys.readouterr().err


def test_a_draft_the_engine_cannot_load_names_the_convert_command(
    fake_engines,
    tiny_target,
    tmp_path,
    capsys,
):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    _eval(tiny_target, draft, "llama.cpp", tmp_path / "out", status=2)
    err = capsys.readouterr().err
    assert "llama.cpp loads gguf drafts, this is a folder with no .gguf file" in err
    assert f"eagletools convert {draft} {draft}-gguf --to gguf --target {tiny_target}" in err


def test_start_timeout_quotes_the_log_and_leaves_no_process(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "never-ready")
    port = free_port()
    argv = [sys.executable, str(FAKE), "serve", "t", "--port", str(port)]
    log = tmp_path / "log"
    with (
        pytest.raises(UserError, match=r"(?s)not ready after 3 s.*fake engine: serve"),
        serve("fake", argv, port, log, timeout=3),
    ):
        pass
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash")
    with (
        pytest.raises(UserError, match="(?s)exited with status 3.*cannot load the draft"),
        serve("fake", argv, port, log, timeout=30),
    ):
        pass


@pytest.mark.parametrize("how", ["exception", "interrupt"])
def test_no_orphan_process_on_error_or_ctrl_c(tmp_path, monkeypatch, how):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "spawn")
    monkeypatch.setenv("FAKE_ENGINE_CHILD", str(tmp_path / "child.pid"))
    port = free_port()
    argv = [sys.executable, str(FAKE), "serve", "t", "--port", str(port)]
    raised = RuntimeError if how == "exception" else KeyboardInterrupt
    with pytest.raises(raised), serve("fake", argv, port, tmp_path / "log", timeout=60) as server:
        pid = server.process.pid
        if how == "interrupt":
            # Python's own Ctrl-C behaviour, whatever an earlier test left installed
            previous = signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            finally:
                signal.signal(signal.SIGINT, previous)
        raise RuntimeError("the benchmark failed")
    child = int((tmp_path / "child.pid").read_text())
    assert _gone(pid) and _gone(child)


def test_a_busy_port_is_replaced_by_a_free_one():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert free_port(taken) != taken
    assert free_port(taken) == taken  # free again once released


def test_engines_listed():
    assert set(ENGINES) == {"vllm", "llama.cpp"}
    assert ENGINES["llama.cpp"].draft_formats == ("gguf",)
