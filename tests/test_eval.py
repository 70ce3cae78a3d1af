"""Benchmarks loading, metrics, and `eagletools eval` end to end on a tiny local target."""

from __future__ import annotations

import json

import pytest
from test_decode_engine import one_thread  # noqa: F401  (autouse: one CPU thread)

from eagletools.cli import main
from eagletools.errors import UserError
from eagletools.eval.metrics import acceptance, summarize
from eagletools.eval.questions import load_benchmark, read_questions
from eagletools.eval.report import markdown, pipeline_markdown


def test_builtin_benchmarks():
    mt = load_benchmark("mt-bench")
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    assert mt[0].id == "81" and mt[0].category == "writing"
    assert [len(q.turns) for q in load_benchmark("mt-bench", 3, max_turns=1)] == [1, 1, 1]
    he = load_benchmark("humaneval", num_prompts=5)
    assert len(he) == 5 and he[0].id == "HumanEval/0" and "def " in he[0].turns[0]


def test_spec_bench_is_package_data():
    from importlib import resources

    questions = load_benchmark("spec-bench")
    assert len(questions) == 480
    assert len({q.category for q in questions}) == 13
    shipped = resources.files("eagletools.eval") / "data/spec_bench"
    assert "Apache License" in (shipped / "LICENSE").read_text()


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"turns": ["a"]', "line 2: not valid JSON"),
        ('["a"]', "line 2: expected a JSON object"),
        ('{"turns": []}', "line 2: field 'turns' must be a non-empty list"),
        ('{"turns": ["ok", 3]}', "line 2: field 'turns'"),
        ('{"text": "no known field"}', "line 2: needs field 'turns'"),
        ('{"prompt": "x", "category": 5}', "line 2: field 'category'"),
    ],
)
def test_malformed_benchmark_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bench.jsonl"
    path.write_text('{"turns": ["fine"]}\n' + line + "\n")
    with pytest.raises(UserError, match=message):
        read_questions(path)


def test_benchmark_file_forms(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text('{"prompt": "p1"}\n\n{"id": "x", "category": "c", "turns": ["t1", "t2"]}\n')
    first, second = load_benchmark(str(path))
    assert (first.id, first.turns) == ("1", ("p1",))
    assert (second.id, second.category, second.turns) == ("x", "c", ("t1", "t2"))
    with pytest.raises(UserError, match="no such file"):
        load_benchmark(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no questions"):
        load_benchmark(str(tmp_path / "empty.jsonl"))


def test_acceptance_metrics():
    tau, rates = acceptance([0, 1, 3, 2], depth=4)
    assert tau == pytest.approx(1 + 6 / 4)
    assert rates == [0.75, 0.5, 0.25, 0.0]


def test_summary_speedups():
    def rec(cat, base, spec, accepted):
        return {
            "category": cat,
            "baseline": {
                "new_tokens": base[0],
                "seconds": base[1],
                "tokens_per_s": base[0] / base[1],
            },
            "speculative": {
                "new_tokens": spec[0],
                "seconds": spec[1],
                "tokens_per_s": spec[0] / spec[1],
                "accepted": accepted,
            },
            "greedy_match": True,
        }

    records = [rec("a", (10, 1.0), (10, 0.5), [1, 1]), rec("b", (30, 1.0), (30, 1.0), [0, 2])]
    s = summarize(records, depth=2)
    assert s["speedup"]["vs_baseline"]["mean_of_ratios"] == pytest.approx((2.0 + 1.0) / 2)
    assert s["speedup"]["vs_baseline"]["total_over_total"] == pytest.approx((40 / 1.5) / (40 / 2.0))
    assert s["tau"] == pytest.approx(2.0)
    assert s["efficiency"] == pytest.approx(4 / 3 / 2.0)
    assert s["per_category"]["a"]["tau"] == pytest.approx(2.0)
    assert s["greedy_match_rate"] == 1.0 and s["speedup"]["vs_hf_generate"] is None


def _fabricated_results(records: list[dict], load: dict, cpu_count: int = 8) -> dict:
    from dataclasses import asdict

    from eagletools.decode.session import Settings

    machine = {"processor": "x86_64", "cpu_count": cpu_count, "torch": "2", "torch_threads": 2,
               "load_average_at_start": [0.1], "load_during_timing": load}  # fmt: skip
    settings = asdict(Settings(draft="d", device="cpu"))
    return {"settings": settings, "machine": machine, "summary": summarize(records, depth=2)}


def test_headline_speedup_is_total_over_total():
    """A short prompt timed slow (other work) moves the mean of per-prompt ratios a lot and
    the total over total little: reports lead with the total."""

    def rec(base_seconds, spec_seconds, n):
        run = lambda sec: {"new_tokens": n, "seconds": sec, "tokens_per_s": n / sec}  # noqa: E731
        return {"category": "c", "baseline": run(base_seconds),
                "speculative": run(spec_seconds) | {"accepted": [1] * (n // 2)}}  # fmt: skip

    records = [rec(1.0, 0.5, 100), rec(1.0, 0.5, 100), rec(0.01, 0.1, 2)]
    speedup = summarize(records, depth=2)["speedup"]["vs_baseline"]
    assert speedup["mean_of_ratios"] == pytest.approx((2 + 2 + 0.1) / 3)
    assert speedup["total_over_total"] == pytest.approx((202 / 1.1) / (202 / 2.01))
    assert speedup["median_of_ratios"] == pytest.approx(2.0)
    text = markdown(_fabricated_results(records, {"max": 0.5, "own_cpus": 0.5, "others": 0.0}))
    row = next(line for line in text.splitlines() if line.startswith("| all |"))
    assert row.split(" | ")[6] == f"{speedup['total_over_total']:.2f}" != "1.37"
    assert "Other work" not in text
    summary = {"target": "t", "vocab_coverage": 0.9, "draft_vocab_size": 8, "acc": [0.5],
               "trained_tokens": 10, "train_seconds": 1.0, "simulated_acceptance_length": 1.5,
               "benchmarks": {"b": {"tau": 1.5, "speedup": {"vs_baseline": speedup},
                                    "greedy_match_rate": 1.0}}}  # fmt: skip
    assert f"| {speedup['total_over_total']:.2f} |" in pipeline_markdown(summary)


def test_the_report_warns_when_other_work_loaded_the_machine():
    records = [{"category": "c", "baseline": {"new_tokens": 4, "seconds": 1.0, "tokens_per_s": 4}}]
    busy = {"max": 7.5, "own_cpus": 2.0, "others": 5.5, "samples": 4}
    text = markdown(_fabricated_results(records, busy, cpu_count=8))
    assert "**Other work loaded the machine while it was timed: other processes kept 5.50" in text
    calm = {"max": 5.5, "own_cpus": 2.0, "others": 3.5, "samples": 4}
    assert "Other work" not in markdown(_fabricated_results(records, calm, cpu_count=8))


def test_eval_command_end_to_end(tiny_target, tmp_path, capsys):
    bench = tmp_path / "bench.jsonl"
    lines = [
        {"question_id": 1, "category": "chat", "turns": ["hello there", "and again"]},
        {"question_id": 2, "category": "code", "turns": ["write a loop"]},
    ]
    bench.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    args = ["eval", "--target", str(tiny_target), "--draft", "random:1", "--bench", str(bench)]
    args += ["--dtype", "float32", "--max-new-tokens", "24", "--hf-baseline", "--no-progress"]
    args += ["--topk", "2", "--depth", "3", "--num-draft-tokens", "6", "--output-dir", str(out)]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    s = results["summary"]
    assert s["prompts"] == 2 and s["greedy_match_rate"] == 1.0
    assert s["hf_match_rate"] == 1.0
    assert len(s["per_position_acceptance"]) == 3 and s["tau"] >= 1.0
    assert set(s["per_category"]) == {"chat", "code"}
    for key in ("baseline", "speculative", "hf_generate"):
        assert s["tokens_per_s"][key] > 0
    assert set(s["speedup"]["vs_hf_generate"]) == {
        "mean_of_ratios", "median_of_ratios", "total_over_total"
    }  # fmt: skip
    assert results["per_prompt"][0]["turns"] == 2
    assert results["settings"]["topk"] == 2 and "load_average_at_start" in results["machine"]
    load = results["machine"]["load_during_timing"]
    assert set(load) == {"max", "own_cpus", "others", "samples"} and load["samples"] == 4
    first = results["per_prompt"][0]  # results.json's record schema
    assert set(first) == {"id", "category", "turns", "baseline", "speculative", "hf_generate",
                          "greedy_match", "hf_match"}  # fmt: skip
    assert set(first["baseline"]) == {"new_tokens", "seconds", "tokens_per_s", "tokens"}
    assert set(first["speculative"]) == {"new_tokens", "seconds", "tokens_per_s", "tokens",
                                         "accepted"}  # fmt: skip
    # each turn's tokens: what makes two runs' (or engines') outputs comparable
    assert len(first["baseline"]["tokens"]) == 2
    assert sum(map(len, first["baseline"]["tokens"])) == first["baseline"]["new_tokens"]
    assert first["speculative"]["tokens"] == first["baseline"]["tokens"]
    report = (out / "results.md").read_text()
    assert report.startswith("# eagletools eval") and "steps eager (`--compile`" in report
    for png in ("acceptance_by_position.png", "speedup_by_category.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "| all | 2 |" in capsys.readouterr().out


def test_compiled_eval_is_lossless_and_says_so(tiny_target, tmp_path):
    """`--compile` in bf16: both decoders run compiled steps, so their outputs match
    (a two-turn question: the second turn reuses the cache the first one filled)."""
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["hello there", "and again"]}) + "\n")
    out = tmp_path / "out"
    args = ["eval", "--target", str(tiny_target), "--draft", "random:1", "--bench", str(bench)]
    args += ["--max-new-tokens", "24", "--no-progress", "--compile", "--output-dir", str(out)]
    args += ["--topk", "2", "--depth", "3", "--num-draft-tokens", "6"]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["compile"] and results["settings"]["dtype"] == "bfloat16"
    assert results["summary"]["greedy_match_rate"] == 1.0
    assert "steps compiled (inductor)" in (out / "results.md").read_text()


def test_autotune_picks_the_fastest_shape(tiny_target):
    from eagletools.decode.session import Settings
    from eagletools.eval.runner import run_eval
    from eagletools.kinds import KINDS

    s = Settings(target=str(tiny_target), draft="random", dtype="float32", max_new_tokens=8)
    s.autotune, s.autotune_prompts = True, 1
    questions = load_benchmark("mt-bench", num_prompts=1)
    results = run_eval(s, questions, progress=False)
    trials = results["autotune"]["trials"]
    assert len(trials) == 1 + len(KINDS["eagle3"].shapes)  # plain decoding besides
    best = max(trials, key=lambda t: t["tokens_per_s"])
    assert (s.topk, s.depth, s.num_draft_tokens) == (
        best["topk"],
        best["depth"],
        best["num_draft_tokens"],
    )
    assert results["settings"]["topk"] == best["topk"]


def test_generate_command_streams_and_reports(tiny_target, capsys):
    args = ["generate", "--target", str(tiny_target), "--draft", "random", "--dtype", "float32"]
    assert main([*args, "--max-new-tokens", "12", "hello"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s, tau" in captured.err and "stop: max_tokens" in captured.err
    assert main([*args, "   "]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main([*args, "--num-draft-tokens", "99", "hi"]) == 2
    assert "--num-draft-tokens 99" in capsys.readouterr().err


def test_wandb_offline(tiny_target, tmp_path, monkeypatch):
    from eagletools.decode.session import Settings
    from eagletools.eval.report import log_wandb, write_report
    from eagletools.eval.runner import run_eval

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    s = Settings(target=str(tiny_target), draft="random", dtype="float32", max_new_tokens=6)
    results = run_eval(s, load_benchmark("mt-bench", num_prompts=1), progress=False)
    files = write_report(results, tmp_path / "out")
    log_wandb(results, files, project="eagletools-test")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.parametrize(
    "argv",
    [["eval", "--output-dir", "out"], ["eval", "--engine", "llama.cpp", "--output-dir", "out"],
     ["generate", "hello"]],
    ids=["eval", "eval --engine", "generate"],
)  # fmt: skip
def test_an_empty_or_missing_draft_is_a_usage_error(argv, tmp_path, capsys):
    """Plain decoding alone is asked for by omitting --draft, never by an empty one."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--draft", " "])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--draft" in err and "omit --draft" in err, err
    assert main([*argv, "--draft", str(tmp_path / "nope")]) == 2
    assert "--draft " in (err := capsys.readouterr().err) and "no such file" in err, err
