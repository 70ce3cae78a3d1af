"""The whole job on one recipe: train, convert to both formats, evaluate, report.

Each stage writes its output atomically and is skipped when that output
exists, so a second run repeats no finished work, and an interrupted training
stage resumes from its last checkpoint. Layout of the run folder:

    train/          training run (checkpoints, metrics.json, final/ in its kind's first layout)
    eagle/          the draft for SGLang, SpecForge, TensorRT-LLM, EAGLE
    speculators/    the draft for vLLM
    draft.gguf      the draft for llama.cpp (when eval.engines names it)
    doctor.json     `eagletools doctor` on both drafts, against the target and as
                    eval.engines read them (a draft served wrongly stops the run here)
    eval/<bench>/   results.json, results.md, PNG plots
    engines/<name>/ the first benchmark inside each installed engine of eval.engines,
                    and in ours with the same chain (engines/ours-chain/)
    report.md       the summary below, with links
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagletools.atomic import write_text
from eagletools.devices import resolve_device
from eagletools.eval.questions import Question
from eagletools.eval.report import pipeline_markdown
from eagletools.stages import Stage, run_stages
from eagletools.train.recipe import TrainConfig

log = logging.getLogger(__name__)


def sample_across_categories(questions: list[Question], n: int) -> list[Question]:
    """n questions taken round-robin over categories, in file order within each."""
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    queues = list(by_category.values())
    picked: list[Question] = []
    while len(picked) < min(n, len(questions)):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


def _questions(bench: str, n: int) -> list[Question]:
    from eagletools.eval.questions import load_benchmark

    if bench == "spec-bench":
        return sample_across_categories(load_benchmark(bench), n)
    return load_benchmark(bench, n)


# the draft formats every run writes (those its draft kind has); an engine's stages add
# the one it loads
ALWAYS = ("eagle", "speculators")


def written(config: TrainConfig) -> tuple[str, ...]:
    """The formats of ALWAYS the recipe's draft kind can be written in; ours runs the first."""
    from eagletools.kinds import KINDS

    return tuple(f for f in ALWAYS if f in KINDS[config.draft.kind].layouts)


def draft_path(out: Path, fmt: str) -> Path:
    """Where the run folder keeps the draft in `fmt`: a folder named for it, or draft.gguf."""
    return out / ("draft.gguf" if fmt == "gguf" else fmt)


def bench_name(bench: str) -> str:
    """A folder name for a benchmark: built-in names as they are, files by their stem."""
    return Path(bench).stem if Path(bench).suffix else bench


def stages(config: TrainConfig, out: Path) -> list[Stage]:
    from eagletools.formats.convert import convert

    questions = _read_benchmarks(config)
    device = str(resolve_device(config.eval.device, "eval.device"))  # fails now, not after training
    _check_engines_run_the_draft(config)

    target = config.target.spec
    train_dir = out / "train"

    def train() -> None:
        from eagletools.train.checkpoint import list_checkpoints
        from eagletools.train.trainer import train as run_training

        resume = bool(list_checkpoints(train_dir / "checkpoints"))
        run_training(config, train_dir, resume=resume)

    def to_format(fmt: str) -> Callable[[], Any]:
        return lambda: convert(
            train_dir / "final", draft_path(out, fmt), fmt, target=target, log=log.info
        )  # fmt: skip

    def evaluation(bench: str) -> Callable[[], Any]:
        def run() -> None:
            from eagletools.eval.runner import evaluate

            settings = eval_settings(config, device, bench, draft_path(out, written(config)[0]))
            evaluate(settings, questions[bench], out / "eval" / bench_name(bench))

        return run

    return [
        Stage("train", train_dir / "metrics.json", train),
        *(Stage(f"convert {fmt}", draft_path(out, fmt), to_format(fmt)) for fmt in written(config)),
        Stage("doctor", out / "doctor.json", lambda: check_drafts(config, out)),
        *(
            Stage(f"eval {b}", out / "eval" / bench_name(b) / "results.json", evaluation(b))
            for b in questions
        ),
        *engine_stages(config, out, questions, device),
    ]


def check_drafts(config: TrainConfig, out: Path) -> None:
    """`eagletools doctor` on each written draft: statically, as each of eval.engines that
    loads its layout reads it (the engines the user deploys to, installed or not), and run
    on the target against the training record; no evaluation is spent on a draft an
    engine would serve wrongly. doctor.json is written only when every draft passes."""
    from eagletools.doctor import doctor
    from eagletools.engines import ENGINES
    from eagletools.errors import UserError
    from eagletools.formats.checks import render

    target = config.target.spec
    reports = {}
    for fmt in written(config):
        engines = [e for e in config.eval.engines if fmt in ENGINES[e].draft_formats]
        reports[fmt] = doctor(draft_path(out, fmt), target, engines)
        log.info("%s", render(reports[fmt]))
    failed = [str(draft_path(out, fmt)) for fmt, report in reports.items() if not report["ok"]]
    if failed:
        raise UserError(
            f"doctor: {', '.join(failed)} would be served wrongly (the report above; "
            f"`eagletools doctor {failed[0]} --target {target}` prints it again)"
        )
    write_text(out / "doctor.json", json.dumps(reports, indent=2))


def _check_engines_run_the_draft(config: TrainConfig) -> None:
    """Refuse, before training, a draft option one of eval.engines would ignore (a second
    layer and llama.cpp: its GGUF conversion would fail after the whole run)."""
    from eagletools.engines import ENGINE_NAMES
    from eagletools.formats.engines import check_recipe_options

    named = [e for e in config.eval.engines if e in ENGINE_NAMES]  # unknown: installed_engines
    check_recipe_options(config.draft.options(), named, "eval.engines")


def installed_engines(config: TrainConfig) -> list[str]:
    """The recipe's engines that are installed here; the others are skipped with a note."""
    from eagletools.engines import ENGINES
    from eagletools.errors import UserError

    found = []
    for name in config.eval.engines:
        if name not in ENGINES:
            raise UserError(f"eval.engines: unknown engine {name!r}; known: {', '.join(ENGINES)}")
        try:
            ENGINES[name].program()
        except UserError as err:
            log.warning("eval.engines: skipping %s: %s", name, err)
            continue
        found.append(name)
    return found


def eval_settings(config: TrainConfig, device: str, bench: str, draft: Path, **fields):
    """The recipe's eval section as eval `Settings`, for every eval stage."""
    from eagletools.decode.session import Settings

    return Settings.of(
        config.eval, target=config.target.spec, draft=str(draft), bench=bench,
        dtype=config.target.dtype, threads=config.training.num_threads, device=device,
        chat_template=config.data.chat_template, **fields,
    )  # fmt: skip


def engine_stages(
    config: TrainConfig, out: Path, questions: dict[str, list[Question]], device: str
) -> list[Stage]:
    """The first benchmark in each installed engine, and in ours with the engines' chain;
    each engine gets the draft in the first format it states it loads."""
    engines = installed_engines(config)
    if not engines or not questions:
        return []
    from eagletools.engines import ENGINES, OURS
    from eagletools.formats.convert import convert
    from eagletools.kinds import KINDS

    bench = next(iter(questions))
    formats = {OURS: written(config)[0]} | {
        name: next(f for f in ENGINES[name].draft_formats if f in KINDS[config.draft.kind].layouts)
        for name in engines
    }
    depth = config.eval.engine_depth
    folders = {OURS: "ours-chain"} | {name: name for name in engines}

    def evaluation(engine: str) -> Callable[[], Any]:
        def run() -> None:
            from eagletools.eval.runner import evaluate

            s = eval_settings(
                config, device, bench, draft_path(out, formats[engine]), engine=engine, topk=1,
                depth=depth, num_draft_tokens=depth + 1, autotune=False, hf_baseline=False,
                compile=False,
            )  # fmt: skip
            evaluate(s, questions[bench], out / "engines" / folders[engine])

        return run

    def to_format(fmt: str) -> Callable[[], Any]:  # the draft in the dtype the target runs in
        return lambda: convert(
            out / "train" / "final", draft_path(out, fmt), fmt, target=config.target.spec,
            dtype=config.target.dtype, log=log.info,
        )  # fmt: skip

    return [
        *(
            Stage(f"convert {fmt}", draft_path(out, fmt), to_format(fmt))
            for fmt in sorted(set(formats.values()) - set(written(config)))
        ),
        *(
            Stage(f"{bench} in {name}", out / "engines" / folder / "results.json", evaluation(name))
            for name, folder in folders.items()
        ),
    ]


def _read_benchmarks(config: TrainConfig) -> dict[str, list[Question]]:
    """Every benchmark's questions, read now: a missing file fails in a second, not after
    training."""
    return {b: _questions(b, config.eval.num_prompts) for b in config.eval.benchmarks}


def run_pipeline(config: TrainConfig, output_dir: str | Path) -> dict[str, Any]:
    """Run every unfinished stage, then write and return the summary."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_stages(stages(config, out), progress="pipeline")
    summary = summarize(config, out)
    write_text(out / "report.md", pipeline_markdown(summary))
    write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def summarize(config: TrainConfig, out: Path) -> dict[str, Any]:
    metrics = json.loads((out / "train" / "metrics.json").read_text())
    summary: dict[str, Any] = {
        "target": config.target.spec,
        "vocab_coverage": metrics.get("vocab", {}).get("coverage"),
        "draft_vocab_size": metrics.get("vocab", {}).get("draft_vocab_size"),
        "simulated_acceptance_length": metrics.get("simulated_acceptance_length"),
        "acc": metrics.get("acc"),
        "train_seconds": metrics.get("train_seconds"),
        "trained_tokens": metrics.get("trained_tokens"),
        "checkpoints": {"eagle": str(out / "eagle"), "speculators": str(out / "speculators")},
        "benchmarks": {},
        "report": str(out / "report.md"),
    }
    summary["engines"] = _engine_rows(out)
    summary["doctor"] = _doctor_rows(out)
    for bench in map(bench_name, config.eval.benchmarks):
        path = out / "eval" / bench / "results.json"
        if not path.is_file():  # skipped: its questions could not be had here
            continue
        results = json.loads(path.read_text())["summary"]
        summary["benchmarks"][bench] = {
            "tau": results.get("tau"),
            "per_position_acceptance": results.get("per_position_acceptance"),
            "tokens_per_s": results.get("tokens_per_s"),
            "speedup": results.get("speedup"),
            "greedy_match_rate": results.get("greedy_match_rate"),
            "report": str(path.with_name("results.md")),
        }
    return summary


def _doctor_rows(out: Path) -> dict[str, dict[str, int]]:
    """Per draft, the warnings and infos doctor.json holds (a written one has no error)."""
    path = out / "doctor.json"
    if not path.is_file():
        return {}
    reports = json.loads(path.read_text())
    return {
        fmt: {level: sum(f["level"] == level for f in r["findings"]) for level in ("warn", "info")}
        for fmt, r in reports.items()
    }


def _engine_rows(out: Path) -> list[dict[str, Any]]:
    """One row per engine run under engines/: the figures the report's engine table shows."""
    rows = []
    for path in sorted((out / "engines").glob("*/results.json")):
        results = json.loads(path.read_text())
        s = results["summary"]
        rows.append({
            "engine": results["settings"].get("engine", "ours"),
            "depth": results["settings"]["depth"],
            "dtype": results["settings"]["dtype"],
            "tokens_per_s": s["tokens_per_s"],
            "tau": s["tau"],
            "per_position_acceptance": s["per_position_acceptance"],
            "speedup": (s["speedup"]["vs_baseline"] or {}).get("total_over_total"),
            "greedy_match_rate": s["greedy_match_rate"],
            "report": str(path.with_name("results.md")),
        })  # fmt: skip
    return rows
