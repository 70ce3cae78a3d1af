"""Write a run: results.json, results.md (Markdown table), PNG plots, wandb."""

from __future__ import annotations

import json
from pathlib import Path

from eagletools.atomic import atomic_file, write_text


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _row(name: str, s: dict) -> list[str]:
    tps, sp = s["tokens_per_s"], s["speedup"]
    vs_base, vs_hf = sp["vs_baseline"] or {}, sp["vs_hf_generate"] or {}
    return [
        name,
        str(s["prompts"]),
        _fmt(s["tau"]),
        _fmt(tps["baseline"], 1),
        _fmt(tps["speculative"], 1),
        _fmt(tps["hf_generate"], 1),
        _fmt(vs_base.get("mean_of_ratios")),
        _fmt(vs_base.get("total_over_total")),
        _fmt(vs_hf.get("mean_of_ratios")),
        _fmt(s["efficiency"]),
        _fmt(s["greedy_match_rate"]),
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


def markdown(results: dict) -> str:
    s, cfg = results["summary"], results["settings"]
    head = [
        "set", "prompts", "tau", "base tok/s", "spec tok/s", "HF tok/s",
        "speedup (mean)", "speedup (total)", "vs HF (mean)", "efficiency", "greedy match",
    ]  # fmt: skip
    rows = [_row("all", s)]
    rows += [_row(name, c) for name, c in s.get("per_category", {}).items()]
    engine = cfg.get("engine", "ours")
    shape = (
        f"chain of {cfg['depth']} drafts"
        if engine != "ours"
        else f"tree topk={cfg['topk']} depth={cfg['depth']} "
        f"num_draft_tokens={cfg['num_draft_tokens']}"
    )
    lines = [
        f"# eagletools eval: {cfg['bench']}, engine {engine}",
        "",
        f"target `{cfg['target']}`, draft `{cfg['draft']}`, {cfg['dtype']}, {shape}, "
        f"max_new_tokens={cfg['max_new_tokens']}, temperature={cfg['temperature']}"
        + (numerics(cfg) if engine == "ours" else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    vs_base = (s["speedup"]["vs_baseline"] or {}).get("total_over_total")
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
        lines += ["", "autotune (tokens/s by topk, depth, num_draft_tokens):", ""]
        for t in results["autotune"]["trials"]:
            lines.append(
                f"- ({t['topk']}, {t['depth']}, {t['num_draft_tokens']}): "
                f"{t['tokens_per_s']:.1f} tok/s, tau {t['tau']:.2f}"
            )
    m = results["machine"]
    lines += ["", f"machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}, "
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
        name: c["speedup"]["vs_baseline"]["mean_of_ratios"]
        for name, c in cats.items()
        if c["speedup"]["vs_baseline"]
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
