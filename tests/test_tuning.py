"""The tree shape a run takes when it gives none: tuned once here, cached, plain when faster."""

from __future__ import annotations

import json
import logging

import pytest

from eagletools.cli import main
from eagletools.decode import session, tuning
from eagletools.decode.session import Settings
from eagletools.decode.timing import Measured, Run
from eagletools.kinds import KINDS

GRID = (None, *KINDS["eagle3"].shapes)  # what a random (EAGLE-3) draft's tune times

QUIET = {"max": 0.0, "own_cpus": 1.0, "others": 0.0, "samples": 2}


def fake_timer(monkeypatch, speeds: dict[str, float]) -> list[list[str]]:
    """The tune's timing replaced: each shape (by label) decodes at `speeds[label]` tokens/s;
    the benchmark's own loop runs for real. Returns the tunes' labels."""
    calls = []

    def run_methods(groups, conversations, tokenizer, progress=True):
        keys = [m.key for m in groups[0]]
        calls.append(keys)
        runs = {k: [Run([[0] * 8], 8 / speeds[k], None if k == "plain" else [1, 0])] for k in keys}
        return Measured(runs, {"load_during_timing": QUIET})

    monkeypatch.setattr(tuning, "run_methods", run_methods)
    return calls


def speeds(fastest: str) -> dict[str, float]:
    return {tuning.shape_label(g): 10.0 for g in GRID} | {fastest: 30.0}


def eval_args(target, tmp_path, out: str, *extra: str) -> list[str]:
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["hello there"]}) + "\n")
    return ["eval", "--target", str(target), "--draft", "random:1", "--bench", str(bench),
            "--dtype", "float32", "--max-new-tokens", "8", "--no-progress",
            "--output-dir", str(tmp_path / out), *extra]  # fmt: skip


def generate_args(target, *extra: str) -> list[str]:
    return ["generate", "--target", str(target), "--draft", "random:1", "--dtype", "float32",
            "--max-new-tokens", "6", *extra, "hello"]  # fmt: skip


def results(tmp_path, out: str) -> dict:
    return json.loads((tmp_path / out / "results.json").read_text())


def test_no_shape_tunes_once_then_takes_the_cached_choice(tiny_target, tmp_path, monkeypatch,
                                                          capsys, caplog):  # fmt: skip
    caplog.set_level(logging.INFO)
    calls = fake_timer(monkeypatch, speeds("1/3/4"))
    assert main(eval_args(tiny_target, tmp_path, "first")) == 0
    labels = [tuning.shape_label(g) for g in GRID]  # plain among them
    # a warm-up, a first round, then the rounds of plain and the shapes near the fastest
    # (3x the others here), each in another order
    assert calls == [labels, labels, ["1/3/4", "plain"], ["plain", "1/3/4"]]
    first = results(tmp_path, "first")
    assert first["tree"]["source"] == "tuned" and not first["tree"]["plain"]
    assert (first["settings"]["topk"], first["settings"]["depth"]) == (1, 3)
    assert first["settings"]["num_draft_tokens"] == 4 and "speculative" in first["per_prompt"][0]
    assert (
        "tree 1/3/4 (topk/depth/nodes), 3.00x plain decoding in the tune (tuned now" in caplog.text
    )
    assert "tree shape tune" in (tmp_path / "first" / "results.md").read_text()

    caplog.clear()
    assert main(eval_args(tiny_target, tmp_path, "again")) == 0
    assert main(generate_args(tiny_target)) == 0
    assert len(calls) == 1 + tuning.TUNE_ROUNDS, "a cached choice was timed again"
    assert results(tmp_path, "again")["tree"]["source"] == "cache"
    assert results(tmp_path, "again")["settings"]["num_draft_tokens"] == 4
    assert caplog.text.count("tree 1/3/4 (topk/depth/nodes), 3.00x") == 2
    assert "from the tune cache" in caplog.text and "[speculative]" in capsys.readouterr().err


def test_a_given_shape_neither_tunes_nor_reads_the_cache(tiny_target, tmp_path, monkeypatch,
                                                         capsys):  # fmt: skip
    def fail(*args):
        raise AssertionError("the tune cache was consulted")

    monkeypatch.setattr(session, "tune_key", fail)
    monkeypatch.setattr(tuning, "cache_path", fail)
    assert main(eval_args(tiny_target, tmp_path, "out", "--topk", "2")) == 0
    got = results(tmp_path, "out")
    assert (got["settings"]["topk"], got["settings"]["depth"]) == (2, 5)  # the rest as before
    assert got["settings"]["num_draft_tokens"] == 16 and got["tree"]["source"] == "given"
    assert main(generate_args(tiny_target, "--no-tune")) == 0
    assert "[speculative]" in capsys.readouterr().err


def test_plain_decoding_wins_and_the_draft_is_not_run(tiny_target, tmp_path, monkeypatch, capsys):
    calls = fake_timer(monkeypatch, speeds("plain"))
    assert main(eval_args(tiny_target, tmp_path, "out")) == 0
    got = results(tmp_path, "out")
    assert got["tree"]["plain"] and got["settings"]["topk"] is None
    assert "speculative" not in got["per_prompt"][0] and got["summary"]["tau"] is None
    report = (tmp_path / "out" / "results.md").read_text()
    assert "plain decoding: the tree shape tune found none faster here" in report
    assert main(generate_args(tiny_target)) == 0
    assert "[plain]" in capsys.readouterr().err and len(calls) == 1 + tuning.TUNE_ROUNDS


def fake_tune(shape) -> dict:
    best = {"topk": None, "depth": None, "num_draft_tokens": None, "tokens_per_s": 9.0}
    if shape:
        best = dict(zip(("topk", "depth", "num_draft_tokens"), shape, strict=True))
    return {"prompts": 2, "trials": [best], "best": best, "load_during_timing": QUIET}


def test_the_cache_key_follows_the_draft_files(tmp_path):
    def key(draft):
        return session.tune_key(Settings(target="t", draft=str(draft)), GRID)

    a, b = tmp_path / "a", tmp_path / "b"
    for folder, weights in ((a, b"one"), (b, b"two")):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(weights)
    assert key(a) != key(b)
    before = key(a)
    (a / "notes.txt").write_text("not the draft")
    assert key(a) == before
    (a / "model.safetensors").write_bytes(b"retrained")
    assert key(a) != before
    assert key("random:1") != key("random:2")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"%s": {"shape": "big"}}'])
def test_a_corrupt_cache_is_ignored_with_a_warning(tune_cache, text, caplog):
    s = Settings(target="t", draft="random")
    tune_cache.write_text(
        text % tuning._digest(session.tune_key(s, GRID)) if "%s" in text else text
    )
    tree = session.choose_tree(s, lambda *_: fake_tune((1, 3, 4)), GRID)
    assert (tree.shape, tree.source) == ((1, 3, 4), "tuned")
    assert "ignoring" in caplog.text
    hit = session.choose_tree(s, lambda *_: pytest.fail("tuned again"), GRID)
    assert (hit.shape, hit.source) == ((1, 3, 4), "cache")


def test_a_tune_under_load_serves_its_run_but_is_not_cached(tune_cache, caplog):
    """Timed beside other work, a choice can be wrong; cached, it would stay wrong."""
    s = Settings(target="t", draft="random")
    loaded = fake_tune((1, 3, 4)) | {"load_during_timing": {**QUIET, "max": 9.0, "others": 8.0}}
    tree = session.choose_tree(s, lambda *_: loaded, GRID)
    assert (tree.shape, tree.source) == ((1, 3, 4), "tuned")
    assert "tunes again" in caplog.text and not tune_cache.exists()
    again = session.choose_tree(s, lambda *_: fake_tune((2, 3, 6)), GRID)
    assert (again.shape, again.source) == ((2, 3, 6), "tuned")
    assert session.choose_tree(s, lambda *_: pytest.fail("tuned again"), GRID).source == "cache"


def test_no_tune_and_autotune_take_the_fixed_shape_untimed():
    no_tune = session.choose_tree(
        Settings(draft="random", tune=False), lambda *_: pytest.fail(), GRID
    )
    assert (no_tune.shape, no_tune.source) == (tuning.FIXED_SHAPE, "fixed")
    assert no_tune.line() == "tree 4/5/16 (topk/depth/nodes), fixed by --no-tune"
    autotune = session.choose_tree(
        Settings(draft="random", autotune=True), lambda *_: pytest.fail(), GRID
    )
    assert autotune.shape == tuning.FIXED_SHAPE and autotune.line() is None


class FakeDecoder:
    """Decodes 8 tokens in 1 s; its first two calls (compiling, packing) take 100 s."""

    draft = None

    def __init__(self) -> None:
        self.calls = 0

    def reset(self) -> None:
        pass

    def generate(self, ids, max_new_tokens, sampling, generator=None):
        from types import SimpleNamespace

        self.calls += 1
        return SimpleNamespace(tokens=[0] * 8, seconds=100.0 if self.calls <= 2 else 1.0)


def test_no_candidate_is_timed_cold(tiny_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    made = {}
    tune, _ = tuning.time_shapes(
        [None, (1, 2, 3)], lambda shape: made.setdefault(shape, FakeDecoder()),
        ["a prompt"], tokenizer, 8, None, 0, "cpu",
    )  # fmt: skip
    for trial in tune["trials"]:
        assert trial["rounds"] == [8.0] * tuning.TUNE_ROUNDS and trial["tokens_per_s"] == 8.0
    assert tune["rounds"] == tuning.TUNE_ROUNDS


@pytest.mark.parametrize(
    "rates, chosen",
    [
        ({"plain": 20.0, "1/2/3": 20.5, "1/3/4": 19.0}, "plain"),  # 2.5%: within the noise
        ({"plain": 20.0, "1/2/3": 21.0, "1/3/4": 19.0}, "1/2/3"),
        ({"1/2/3": 21.0, "1/3/4": 22.0}, "1/3/4"),  # an --autotune grid may lack plain
    ],
)
def test_a_shape_must_beat_plain_decoding_by_min_gain(rates, chosen):
    trials = [{"topk": None if k == "plain" else 1, "label": k, "tokens_per_s": v}
              for k, v in rates.items()]  # fmt: skip
    assert tuning._best(trials)["label"] == chosen


def test_the_load_meter_counts_other_processes_only(monkeypatch):
    """Our own threads are not other work: a process tree busy on both CPUs reads 0."""
    from types import SimpleNamespace

    from eagletools.decode import timing

    clock = {"own": 0.0, "busy": 0.0}
    monkeypatch.setattr(timing, "_own_cpu_seconds", lambda: clock["own"])
    monkeypatch.setattr(timing, "_busy_cpu_seconds", lambda: clock["busy"])
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock["busy"] / 2.5))
    meter = timing.LoadMeter()
    with meter.timing():  # 10 s: we ran 20 CPU-seconds, the machine 25
        clock["own"], clock["busy"] = 20.0, 25.0
    assert meter.result()["own_cpus"] == 2.0 and meter.result()["others"] == 0.5
