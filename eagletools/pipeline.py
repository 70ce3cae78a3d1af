"""The whole job on one recipe: train, convert to both formats, evaluate, report.

Each stage writes its output atomically and is skipped when that output
exists, so a second run repeats no finished work, and an interrupted training
stage resumes from its last checkpoint. Layout of the run folder:

    train/          training run (checkpoints, metrics.json, final/ in eagle format)
    eagle/          the draft for SGLang, SpecForge, TensorRT-LLM, EAGLE
    speculators/    the draft for vLLM
    draft.gguf      the draft for llama.cpp (when eval.engines names it)
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
from eagletools.eval.benchmarks import Question
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
    from eagletools.eval.benchmarks import load_benchmark

    if bench == "spec-bench":
        return sample_across_categories(load_benchmark(bench), n)
    return load_benchmark(bench, n)


def bench_name(bench: str) -> str:
    """A folder name for a benchmark: built-in names as they are, files by their stem."""
    return Path(bench).stem if Path(bench).suffix else bench


def stages(config: TrainConfig, out: Path) -> list[Stage]:
    from eagletools.formats.convert import convert

    questions = _read_benchmarks(config)
    device = str(resolve_device(config.eval.device, "eval.device"))  # fails now, not after training

    target = config.target.spec
    train_dir = out / "train"

    def train() -> None:
        from eagletools.train.checkpoint import list_checkpoints
        from eagletools.train.trainer import train as run_training

        resume = bool(list_checkpoints(train_dir / "checkpoints"))
        run_training(config, train_dir, resume=resume)

    def to_format(fmt: str) -> Callable[[], Any]:
        return lambda: convert(train_dir / "final", out / fmt, fmt, target=target, log=log.info)

    def evaluate(bench: str) -> Callable[[], Any]:
        def run() -> None:
            from eagletools.eval.report import write_report
            from eagletools.eval.runner import Settings, run_eval

            e = config.eval
            settings = Settings(
                target=target,
                draft=str(out / "eagle"),
                bench=bench,
                num_prompts=e.num_prompts,
                max_new_tokens=e.max_new_tokens,
                topk=e.topk,
                depth=e.depth,
                num_draft_tokens=e.num_draft_tokens,
                autotune=e.autotune,
                hf_baseline=e.hf_baseline,
                compile=e.compile,
                dtype=config.target.dtype,
                threads=config.training.num_threads,
                device=device,
                chat_template=config.data.chat_template,
            )
            results = run_eval(settings, questions[bench])
            write_report(results, out / "eval" / bench_name(bench))

        return run

    return [
        Stage("train", train_dir / "metrics.json", train),
        Stage("convert eagle", out / "eagle", to_format("eagle")),
        Stage("convert speculators", out / "speculators", to_format("speculators")),
        *(
            Stage(f"eval {b}", out / "eval" / bench_name(b) / "results.json", evaluate(b))
            for b in questions
        ),
        *engine_stages(config, out, questions, device),
    ]


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


def engine_stages(
    config: TrainConfig, out: Path, questions: dict[str, list[Question]], device: str
) -> list[Stage]:
    """The first benchmark in each installed engine, and in ours with the engines' chain."""
    engines = installed_engines(config)
    if not engines or not questions:
        return []
    from eagletools.formats.convert import convert

    bench = next(iter(questions))
    drafts = {"vllm": out / "speculators", "llama.cpp": out / "draft.gguf", "ours": out / "eagle"}

    def evaluate(engine: str) -> Callable[[], Any]:
        def run() -> None:
            from eagletools.eval.engine_runner import run_engine_eval
            from eagletools.eval.report import write_report
            from eagletools.eval.runner import Settings, run_eval

            e = config.eval
            folder = out / "engines" / ("ours-chain" if engine == "ours" else engine)
            s = Settings(
                target=config.target.spec, draft=str(drafts[engine]), bench=bench,
                num_prompts=e.num_prompts, max_new_tokens=e.max_new_tokens, topk=1,
                depth=e.engine_depth, num_draft_tokens=e.engine_depth + 1,
                dtype=config.target.dtype, threads=config.training.num_threads,
                device=device, chat_template=config.data.chat_template, engine=engine,
            )  # fmt: skip
            if engine == "ours":
                results = run_eval(s, questions[bench])
            else:
                results = run_engine_eval(s, questions[bench], folder)
            write_report(results, folder)

        return run

    gguf = lambda: convert(  # noqa: E731  (the draft in the dtype the target runs in)
        out / "train" / "final", drafts["llama.cpp"], "gguf", target=config.target.spec,
        dtype=config.target.dtype, log=log.info,
    )  # fmt: skip
    return [
        *([Stage("convert gguf", drafts["llama.cpp"], gguf)] if "llama.cpp" in engines else []),
        *(
            Stage(f"{bench} in {name}", out / "engines" / folder / "results.json", evaluate(name))
            for name, folder in [("ours", "ours-chain"), *((n, n) for n in engines)]
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
    write_text(out / "report.md", report_markdown(summary))
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


def engine_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: each engine with and without the draft; a draft that slows one is said so."""
    if not rows:
        return []
    lines = [
        "| engine | chain | tok/s without draft | tok/s with draft | speedup | acceptance length "
        "| per position | greedy match |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = ", ".join(_fmt(a) for a in r["per_position_acceptance"] or [])
        tps = r["tokens_per_s"]
        lines.append(
            f"| {r['engine']} | {r['depth']} | {_fmt(tps['baseline'], 1)} "
            f"| {_fmt(tps['speculative'], 1)} | {_fmt(r['speedup'])} | {_fmt(r['tau'])} "
            f"| {per} | {_fmt(r['greedy_match_rate'])} |"
        )
    slower = [r["engine"] for r in rows if r["speedup"] is not None and r["speedup"] < 1]
    if slower:
        lines += ["", f"**The draft makes {', '.join(slower)} slower than plain decoding here.**"]
    return lines


def _fmt(value: Any, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _mean_ratio(speedup: dict | None, key: str) -> float | None:
    entry = (speedup or {}).get(key)
    return entry.get("mean_of_ratios") if isinstance(entry, dict) else entry


def headline(summary: dict[str, Any]) -> list[str]:
    """The lines `eagletools pipeline` prints at the end."""
    lines = [
        f"vocabulary coverage: {_fmt(summary['vocab_coverage'], 4)} "
        f"(draft vocab {summary['draft_vocab_size']})",
        f"training simulated acceptance length: {_fmt(summary['simulated_acceptance_length'])}",
    ]
    for bench, b in summary["benchmarks"].items():
        lines.append(
            f"{bench}: tau {_fmt(b['tau'])}, speedup x{_fmt(_mean_ratio(b['speedup'], 'vs_baseline'))} "
            f"over our baseline, x{_fmt(_mean_ratio(b['speedup'], 'vs_hf_generate'))} over "
            f"Hugging Face generate, greedy match {_fmt(b['greedy_match_rate'])}"
        )
    lines.append(f"report: {summary['report']}")
    return lines


def report_markdown(summary: dict[str, Any]) -> str:
    rows = [
        "| benchmark | tau | speedup vs our baseline | speedup vs HF generate | greedy match |",
        "|---|---|---|---|---|",
    ]
    for bench, b in summary["benchmarks"].items():
        rows.append(
            f"| [{bench}](eval/{bench}/results.md) | {_fmt(b['tau'])} "
            f"| {_fmt(_mean_ratio(b['speedup'], 'vs_baseline'))} "
            f"| {_fmt(_mean_ratio(b['speedup'], 'vs_hf_generate'))} "
            f"| {_fmt(b['greedy_match_rate'])} |"
        )
    acc = ", ".join(_fmt(a) for a in summary["acc"] or [])
    return "\n".join(
        [
            f"# EAGLE-3 draft for {summary['target']}",
            "",
            f"- vocabulary: {summary['draft_vocab_size']} tokens, coverage "
            f"{_fmt(summary['vocab_coverage'], 4)}",
            f"- training: {summary['trained_tokens']} tokens in "
            f"{_fmt(summary['train_seconds'], 0)} s; held-out acc per step [{acc}], "
            f"simulated acceptance length {_fmt(summary['simulated_acceptance_length'])}",
            "- checkpoints: [eagle](eagle/) (SGLang, SpecForge, TensorRT-LLM), "
            "[speculators](speculators/) (vLLM)",
            "",
            *rows,
            "",
            *engine_table(summary.get("engines", [])),
            "",
        ]
    )
