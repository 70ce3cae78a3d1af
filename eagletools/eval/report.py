"""Write a run: results.json, results.md (Markdown table), PNG plots, wandb; and the
pipeline's report.md. Every number in every report goes through `_fmt`.

results.json: `settings` (decode.session.Settings), `machine` (decode.timing.machine,
with `load_average_at_end` and `load_during_timing`: `max`, `own_cpus`, `others`,
`samples`), `summary` (eval.metrics.summarize), `per_prompt` records (each
method's `new_tokens`, `seconds`, `tokens_per_s` and its `tokens`, one list a turn,
so two engines' outputs can be compared token by token; our speculative decoder's
`accepted` per verify step, an engine's `acceptance` counters), `autotune`,
`tree` (decode.tuning.TreeChoice.record: the shape drafted, `plain` when the
tune found plain decoding fastest, its `source` and the tune's trials),
`bandwidth` (ours) or `engine` (a serving engine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagletools.atomic import atomic_file, write_text
from eagletools.decode.timing import loaded_by_others
from eagletools.eval.metrics import headline


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _row(name: str, s: dict) -> list[str]:
    tps, sp = s["tokens_per_s"], s["speedup"]
    vs_base = sp["vs_baseline"] or {}
    return [
        name,
        str(s["prompts"]),
        _fmt(s["tau"]),
        _fmt(tps["baseline"], 1),
        _fmt(tps["speculative"], 1),
        _fmt(tps["hf_generate"], 1),
        _fmt(headline(vs_base)),
        _fmt(vs_base.get("median_of_ratios")),
        _fmt(headline(sp["vs_hf_generate"])),
        _fmt(s["efficiency"]),
        _fmt(s["greedy_match_rate"]),
    ]


def cpu_of(machine: dict) -> str:
    """The CPU a run names (`timing.cpu_model`; older results have only the platform's)."""
    return machine.get("cpu") or machine["processor"]


def load_warning(machine: dict) -> list[str]:
    """A bold line when other work loaded the machine during timing (over half its cores)."""
    load = machine.get("load_during_timing")  # absent in results from before it was measured
    if not loaded_by_others(load, machine["cpu_count"]):
        return []
    return [
        "",
        f"**Other work loaded the machine while it was timed: other processes kept "
        f"{_fmt(load['others'])} CPUs busy (this run {_fmt(load['own_cpus'])}) of "
        f"{machine['cpu_count']} cores. Tokens/s and speedups are unreliable; rerun on an idle "
        f"machine.**",
    ]


def numerics(cfg: dict) -> str:
    """Which numerics ran: only the exact ones promise bf16 greedy equality; compiled
    steps equal each other, not eager ones."""
    compiled = (
        ", steps compiled (inductor)"
        if cfg.get("compile")
        else ", steps eager (`--compile` runs both decoders compiled, and faster)"
    )
    if cfg.get("fast_numerics"):
        return (
            ", numerics fast (fp32 attention: bf16 output may drift from plain decoding)" + compiled
        )
    return ", numerics exact (batch-invariant attention)" + compiled


SOURCES = {"tuned": "tuned here", "cache": "tuned here before (cached)", "autotune": "autotuned",
           "fixed": "fixed by --no-tune"}  # fmt: skip


def shape_text(results: dict) -> str:
    """What drafted: an engine's chain, our tree and how its shape was chosen, or plain
    decoding when the tune found no shape faster than it."""
    cfg, tree = results["settings"], results.get("tree") or {}
    if cfg.get("engine", "ours") != "ours":
        return f"chain of {cfg['depth']} drafts"
    if tree.get("plain"):
        return ("plain decoding: the tree shape tune found none faster here, so the draft was "
                "not run (give --topk, --depth or --num-draft-tokens to measure it)")  # fmt: skip
    source = SOURCES.get(tree.get("source"))
    return (
        f"tree topk={cfg['topk']} depth={cfg['depth']} num_draft_tokens={cfg['num_draft_tokens']}"
        + (f" ({source})" if source else "")
    )


def trial_lines(title: str, tune: dict) -> list[str]:
    """A shape search's trials: tokens/s and tau of each shape (plain: no draft)."""
    lines = ["", f"{title} (tokens/s by topk, depth, num_draft_tokens; {tune['prompts']} "
             f"prompts x {tune.get('max_new_tokens', 'n/a')} tokens):", ""]  # fmt: skip
    for t in tune["trials"]:
        shape = "plain" if t["topk"] is None else (t["topk"], t["depth"], t["num_draft_tokens"])
        lines.append(f"- {shape}: {t['tokens_per_s']:.1f} tok/s, tau {t['tau']:.2f}")
    return lines


def markdown(results: dict) -> str:
    s, cfg = results["summary"], results["settings"]
    head = [
        "set", "prompts", "tau", "base tok/s", "spec tok/s", "HF tok/s", "speedup",
        "speedup (median per prompt)", "vs HF", "efficiency", "greedy match",
    ]  # fmt: skip
    rows = [_row("all", s)]
    rows += [_row(name, c) for name, c in s.get("per_category", {}).items()]
    engine = cfg.get("engine", "ours")
    lines = [
        f"# eagletools eval: {cfg['bench']}, engine {engine}",
        "",
        f"target `{cfg['target']}`, draft `{cfg['draft']}`, {cfg['dtype']}, {shape_text(results)}, "
        f"max_new_tokens={cfg['max_new_tokens']}, temperature={cfg['temperature']}"
        + (numerics(cfg) if engine == "ours" else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "speedup: total tokens over total seconds, with the draft over without it",
        *load_warning(results["machine"]),
    ]
    vs_base = headline(s["speedup"]["vs_baseline"])
    if vs_base is not None and vs_base < 1:
        lines += ["", f"**The draft makes {engine} slower than plain decoding here: "
                  f"x{vs_base:.2f} of its tokens/s without the draft.**"]  # fmt: skip
    if bw := results.get("bandwidth"):
        parts = [
            f"{name} {d['gb_per_s']:.1f} GB/s ({d['share']:.0%})"
            for name, d in bw["decoders"].items()
        ]
        lines += ["", f"bandwidth achieved (weights {bw['weight_bytes'] / 1e6:.0f} MB x tokens/s; "
                  f"share of the measured {bw['read_gb_per_s']:.1f} GB/s read bandwidth, "
                  f"speculative effective): {', '.join(parts)}"]  # fmt: skip
    if s["per_position_acceptance"]:
        rates = ", ".join(f"{r:.2f}" for r in s["per_position_acceptance"])
        lines += ["", f"per-position acceptance: {rates}"]
    if results.get("autotune"):
        lines += trial_lines("autotune", results["autotune"])
    if (results.get("tree") or {}).get("tune"):
        lines += trial_lines("tree shape tune", results["tree"]["tune"])
    m = results["machine"]
    lines += ["", f"machine: {cpu_of(m)}, {m['cpu_count']} CPUs, torch {m['torch']}, "
              f"{m['torch_threads']} threads, load average {m['load_average_at_start']}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, written = results["summary"], []
    if s["per_position_acceptance"]:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        rates = s["per_position_acceptance"]
        ax.bar(range(1, len(rates) + 1), rates, color="#3a7ca5")
        ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1))
        ax.set_title(f"per-position acceptance (tau {s['tau']:.2f})")
        written.append(_save(fig, out / "acceptance_by_position.png"))
    cats = s.get("per_category") or {"all": s}
    speedups = {
        name: headline(c["speedup"]["vs_baseline"])
        for name, c in cats.items()
        if headline(c["speedup"]["vs_baseline"]) is not None
    }
    if speedups:
        fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(speedups)), 3.2))
        ax.bar(list(speedups), list(speedups.values()), color="#d1495b")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(ylabel="speedup vs baseline")
        ax.tick_params(axis="x", rotation=45)
        ax.set_title("speedup by category")
        written.append(_save(fig, out / "speedup_by_category.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path


def write_report(results: dict, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "results.json", json.dumps(results, indent=2) + "\n")
    write_text(out / "results.md", markdown(results))
    return [out / "results.json", out / "results.md", *plots(results, out)]


def log_wandb(results: dict, files: list[Path], project: str, run_name: str | None = None) -> None:
    """Summary figures, the per-prompt table and the plots (WANDB_MODE=offline works)."""
    import wandb

    run = wandb.init(project=project, name=run_name, config=results["settings"], job_type="eval")
    s = results["summary"]
    flat = {
        "tau": s["tau"],
        "efficiency": s["efficiency"],
        "greedy_match_rate": s["greedy_match_rate"],
        **{f"tokens_per_s/{k}": v for k, v in s["tokens_per_s"].items() if v is not None},
        **{
            f"speedup/{k}/{how}": v
            for k, d in s["speedup"].items()
            if d
            for how, v in d.items()
            if v is not None
        },
    }
    for i, rate in enumerate(s["per_position_acceptance"] or []):
        flat[f"acceptance/position_{i + 1}"] = rate
    run.summary.update({k: v for k, v in flat.items() if v is not None})
    columns = ["id", "category", "baseline_tok_s", "spec_tok_s", "greedy_match"]
    table = wandb.Table(columns=columns)
    for r in results["per_prompt"]:
        spec = r.get("speculative", {})
        table.add_data(
            r["id"],
            r["category"],
            r["baseline"]["tokens_per_s"],
            spec.get("tokens_per_s"),
            r.get("greedy_match"),
        )
    run.log(
        {"per_prompt": table, **{p.stem: wandb.Image(str(p)) for p in files if p.suffix == ".png"}}
    )
    run.finish()


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


def pipeline_lines(summary: dict[str, Any]) -> list[str]:
    """The lines `eagletools pipeline` prints at the end (summary: pipeline.summarize)."""
    lines = [
        f"vocabulary coverage: {_fmt(summary['vocab_coverage'], 4)} "
        f"(draft vocab {summary['draft_vocab_size']})",
        f"training simulated acceptance length: {_fmt(summary['simulated_acceptance_length'])}",
    ]
    for bench, b in summary["benchmarks"].items():
        tau, vs_base, vs_hf, match = _bench_figures(b)
        lines.append(
            f"{bench}: tau {tau}, speedup x{vs_base} over our baseline, x{vs_hf} over "
            f"Hugging Face generate, greedy match {match}"
        )
    lines.append(f"report: {summary['report']}")
    return lines


def _bench_figures(b: dict[str, Any]) -> list[str]:
    """A benchmark's tau, headline speedups over our baseline and HF generate, greedy match."""
    speedup = b["speedup"] or {}
    return [_fmt(b["tau"]), _fmt(headline(speedup.get("vs_baseline"))),
            _fmt(headline(speedup.get("vs_hf_generate"))), _fmt(b["greedy_match_rate"])]  # fmt: skip


def pipeline_markdown(summary: dict[str, Any]) -> str:
    """The pipeline's report.md: training, each benchmark and each engine, with links."""
    rows = [
        "| benchmark | tau | speedup vs our baseline | speedup vs HF generate | greedy match |",
        "|---|---|---|---|---|",
    ]
    for bench, b in summary["benchmarks"].items():
        rows.append(
            f"| [{bench}](eval/{bench}/results.md) | " + " | ".join(_bench_figures(b)) + " |"
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
            *_doctor_line(summary.get("doctor", {})),
            "",
            *rows,
            "",
            "speedups: total tokens over total seconds",
            "",
            *engine_table(summary.get("engines", [])),
            "",
        ]
    )


def _doctor_line(doctor: dict[str, dict[str, int]]) -> list[str]:
    """report.md's line on `eagletools doctor` (doctor.json): no error, warnings counted."""
    if not doctor:
        return []
    counts = ", ".join(f"{fmt} {c['warn']} warning(s)" for fmt, c in doctor.items())
    return [f"- [doctor](doctor.json): no error in either draft ({counts})"]


def methods_markdown(rows: list[dict], notes: list[str], header: dict, machine: dict) -> str:
    """benchmarks/compare.py's table: every method's figures (eval.metrics.method_figures)."""
    lines = [
        "# Results: eagletools against Hugging Face decoders",
        "",
        f"Measured {header['date']} on {cpu_of(machine)}, {machine['cpu_count']} cores, "
        f"torch {machine['torch']} with `benchmarks/compare.py` ({header['prompts']} MT-bench "
        f"first turns, {header['max_new_tokens']} new tokens, greedy, {header['dtype']}, target "
        f"`{header['target']}`, draft `{header['draft']}`, load average "
        f"{machine['load_average_at_start']} at start, {machine['load_average_at_end']} at end).",
        *load_warning(machine),
        "",
        "| method | tokens/s | speedup vs HF generate | speedup vs eagletools baseline | tau "
        "| output equals HF generate | output equals its runtime's plain decoding |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plain = "n/a" if r["plain_matches"] is None else f"{r['plain_matches']}/{r['prompts']}"
        lines.append(
            f"| {r['name']} | {_fmt(r['tokens_per_s'], 1)} | {_fmt(r['speedup'])}x "
            f"| {_fmt(r['vs_baseline'])}x | {_fmt(r['tau'])} | {r['matches']}/{r['prompts']} "
            f"| {plain} |"
        )
    notes = [
        "tokens/s and speedups: total tokens over total seconds; tau: tokens per verify step "
        "(1 + drafts accepted), for the methods that draft and count it.",
        "In bf16 each runtime rounds its own way, so outputs of different runtimes differ "
        "(HF's own prompt lookup from HF generate too). What a draft must not change is its "
        "runtime's plain output: our speculative rows against our baseline (batch-invariant "
        "attention), each engine's drafted row against its plain row. Equality with HF generate "
        "is checked in fp32 (tests, and `eagletools eval --dtype float32 --hf-baseline`).",
        *notes,
    ]
    return "\n".join([*lines, "", *(f"- {n}" for n in notes), ""])
