"""`eagletools pipeline` end to end on a tiny target, and its reuse of finished stages."""

from __future__ import annotations

import json

import pytest
from test_data_chat import CORPUS

from eagletools.cli import main
from eagletools.errors import UserError
from eagletools.eval.questions import Question
from eagletools.pipeline import sample_across_categories
from eagletools.train.recipe import load_config


def write_inputs(tmp_path):
    data = tmp_path / "chats.jsonl"
    with data.open("w") as f:
        for i in range(24):
            user, reply = CORPUS[i % 4], CORPUS[(i + 1) % 4]
            turns = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": turns}) + "\n")
    bench = tmp_path / "questions.jsonl"
    bench.write_text(
        json.dumps({"category": "chat", "turns": ["Hello there!", "And the fox?"]})
        + "\n"
        + json.dumps({"category": "code", "turns": ["def f(x):"]})
        + "\n"
    )
    return data, bench


def pipeline_args(target_dir, data, bench, out):
    return [
        "pipeline",
        f"target.spec={target_dir}",
        "target.dtype=float32",
        f"data.train={data}",
        "data.max_length=256",
        "data.eval_samples=4",
        "vocab.draft_vocab_size=64",
        "training.max_steps=3",
        "training.batch_size=4",
        "training.ttt_steps=2",
        "training.precision=fp32",
        "training.eval_every=0",
        "training.save_every=0",
        f"eval.benchmarks=[{bench}]",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        "eval.topk=2",
        "eval.depth=2",
        "eval.num_draft_tokens=4",
        "--output-dir",
        str(out),
    ]


def test_pipeline_runs_every_stage_then_reuses_them(target_dir, tmp_path, monkeypatch, capsys):
    data, bench = write_inputs(tmp_path)
    out = tmp_path / "run"
    assert main(pipeline_args(target_dir, data, bench, out)) == 0
    printed = capsys.readouterr().out
    for phrase in ("vocabulary coverage:", "training simulated acceptance length:",
                   "questions: tau", "over our baseline", "report:"):  # fmt: skip
        assert phrase in printed
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["vocab_coverage"] <= 1
    assert summary["simulated_acceptance_length"] >= 1
    assert summary["benchmarks"]["questions"]["greedy_match_rate"] == 1.0
    assert (out / "eagle" / "config.json").is_file()
    assert json.loads((out / "speculators" / "config.json").read_text())["speculators_model_type"]
    assert (out / "report.md").read_text().startswith("# EAGLE-3 draft for")
    assert "[doctor](doctor.json): no error" in (out / "report.md").read_text()
    doctor = json.loads((out / "doctor.json").read_text())  # both drafts, run on the target
    assert {fmt: r["ok"] for fmt, r in doctor.items()} == {"eagle": True, "speculators": True}
    assert all(any(f["check"] == "numeric" for f in r["findings"]) for r in doctor.values())

    # a second run repeats no finished work
    def fail(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr("eagletools.train.trainer.train", fail)
    monkeypatch.setattr("eagletools.formats.convert.convert", fail)
    monkeypatch.setattr("eagletools.eval.runner.run_eval", fail)
    monkeypatch.setattr("eagletools.doctor.doctor", fail)
    assert main(pipeline_args(target_dir, data, bench, out)) == 0
    assert json.loads((out / "summary.json").read_text()) == summary


def test_spec_bench_sample_spreads_over_categories():
    questions = [Question(str(i), c, ("q",)) for i, c in enumerate("aaabbc")]
    picked = sample_across_categories(questions, 4)
    assert [q.category for q in picked] == ["a", "b", "c", "a"]
    assert len(sample_across_categories(questions, 99)) == 6


def test_a_draft_an_eval_engine_cannot_run_fails_before_training(tmp_path, monkeypatch):
    """llama.cpp runs one-layer drafts only: the recipe's eval.engines naming it refuses a
    second layer before training, not at the GGUF conversion after it."""
    import eagletools.pipeline as pipeline

    monkeypatch.setattr(pipeline, "run_stages", lambda *a, **k: pytest.fail("stages ran"))
    config = load_config(overrides=["draft.num_hidden_layers=2", "eval.engines=[vllm, llama.cpp]"])
    with pytest.raises(UserError, match=r"eval.engines: llama.cpp .*num_hidden_layers"):
        pipeline.run_pipeline(config, tmp_path / "run")
    vllm = load_config(overrides=["draft.num_hidden_layers=2", "eval.engines=[vllm]"])
    assert pipeline.stages(vllm, tmp_path / "vllm")[0].name == "train"


def test_a_missing_benchmark_fails_before_training(tmp_path, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr("eagletools.train.trainer.train", fail)
    code = main(["pipeline", "eval.benchmarks=[missing.jsonl]", "--output-dir", str(tmp_path)])
    assert code == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_builtin_spec_bench_is_read_before_training(tmp_path):
    """Spec-Bench ships with the package: the pipeline samples it across its categories."""
    from eagletools.pipeline import _read_benchmarks
    from eagletools.train.recipe import load_config

    _, bench = write_inputs(tmp_path)
    config = load_config(None, [f"eval.benchmarks=[spec-bench, {bench}]", "eval.num_prompts=3"])
    questions = _read_benchmarks(config)
    assert list(questions) == ["spec-bench", str(bench)]
    assert len({q.category for q in questions["spec-bench"]}) == 3


def test_pipeline_measures_the_draft_inside_installed_engines(
    target_dir, tmp_path, fake_engines, caplog
):
    """eval.engines: vLLM (installed, here the fake) runs the first benchmark beside our
    decoder with the same chain; an engine that is not installed is skipped with a note."""
    import shutil

    data, bench = write_inputs(tmp_path)
    shutil.rmtree(fake_engines / "llama.cpp")
    out = tmp_path / "run"
    args = pipeline_args(target_dir, data, bench, out)
    args[1:1] = ["eval.engines=[vllm, llama.cpp]", "eval.engine_depth=2"]
    assert main(args) == 0
    assert (
        "skipping llama.cpp: llama.cpp is not installed: run `make engine-llamacpp`" in caplog.text
    )
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["engine"]: r for r in summary["engines"]}
    assert set(rows) == {"ours", "vllm"}
    assert rows["vllm"]["depth"] == rows["ours"]["depth"] == 2
    assert rows["vllm"]["tau"] > 1 and rows["vllm"]["greedy_match_rate"] == 1.0
    assert "| vllm | 2 |" in (out / "report.md").read_text()


def test_an_unknown_engine_in_the_recipe_is_refused(tmp_path, capsys):
    code = main(["pipeline", "eval.engines=[tgi]", "--output-dir", str(tmp_path)])
    assert code == 2
    assert "eval.engines: unknown engine 'tgi'; known: vllm, llama.cpp" in capsys.readouterr().err


def test_a_recipe_without_a_tree_shape_takes_the_tuned_one(target_dir, tmp_path, monkeypatch):
    """The eval stage goes through the same choice as `eval` and `generate`."""
    from eagletools.decode import session
    from eagletools.decode.tuning import TreeChoice
    from eagletools.pipeline import stages
    from eagletools.train.recipe import load_config

    _, bench = write_inputs(tmp_path)
    config = load_config(None, [
        f"target.spec={target_dir}", "target.dtype=float32", f"eval.benchmarks=[{bench}]",
        "eval.num_prompts=1", "eval.max_new_tokens=4", "eval.hf_baseline=false",
    ])  # fmt: skip
    asked = []

    def choose_tree(s, measure, grid, prompts=None):
        asked.append((s.shape, s.tune))
        return TreeChoice((1, 2, 3), "cache")

    real = session.load_any_draft
    monkeypatch.setattr(session, "choose_tree", choose_tree)
    monkeypatch.setattr(session, "load_any_draft", lambda spec, *a, **k: real("random", *a, **k))
    stage = next(s for s in stages(config, tmp_path / "run") if s.name.startswith("eval"))
    stage.run()
    results = json.loads(stage.output.read_text())
    assert asked == [(None, True)]
    assert results["tree"]["source"] == "cache" and results["settings"]["depth"] == 2


def test_a_draft_doctor_finds_faulty_stops_the_pipeline_before_evaluation(
    target_dir, tmp_path, monkeypatch
):
    """The doctor stage refuses a draft an engine would serve wrongly (here: a NaN weight
    seeded after conversion), writes no doctor.json, and no evaluation runs."""
    from safetensors.torch import load_file, save_file

    from eagletools import pipeline

    data, bench = write_inputs(tmp_path)
    out = tmp_path / "run"
    args = pipeline_args(target_dir, data, bench, out)
    config = load_config(None, [a for a in args[1:] if "=" in a])
    stages = pipeline.stages(config, out)
    for stage in stages[:3]:  # train, convert eagle, convert speculators
        stage.run()
    weights = out / "speculators" / "model.safetensors"
    tensors = load_file(weights)
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, weights)
    doctor_stage = next(s for s in stages if s.name == "doctor")
    with pytest.raises(UserError, match="speculators would be served wrongly"):
        doctor_stage.run()
    assert not (out / "doctor.json").exists()


def test_a_peagle_pipeline_writes_and_evaluates_the_speculators_layout(tmp_path, monkeypatch):
    """A P-EAGLE draft has one layout (speculators, vLLM's): the pipeline converts to it
    alone and our decoder evaluates it; an engine that serves no P-EAGLE is refused first."""
    import eagletools.pipeline as pipeline

    monkeypatch.setattr(pipeline, "installed_engines", lambda config: ["vllm"])
    config = load_config(overrides=["draft.kind=peagle", "eval.engines=[vllm]"])
    names = [s.name for s in pipeline.stages(config, tmp_path / "run")]
    assert names[:3] == ["train", "convert speculators", "doctor"]
    assert not any("eagle" in n.split() for n in names)  # no eagle-layout stage
    monkeypatch.setattr(pipeline, "run_stages", lambda *a, **k: pytest.fail("stages ran"))
    both = load_config(overrides=["draft.kind=peagle", "eval.engines=[vllm, llama.cpp]"])
    with pytest.raises(UserError, match=r"eval.engines: llama.cpp .*ignores peagle"):
        pipeline.run_pipeline(both, tmp_path / "other")
