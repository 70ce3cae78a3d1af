"""Figures of a run (docs/design.md 3.6): tau, per-position acceptance, speedups.

The headline speedup is total tokens over total time (what a user waiting on
the whole benchmark sees): one prompt slowed by other work moves it by its
share of the time only. The median of per-prompt ratios (each pair timed back
to back) is kept beside it, and the mean of them (what EAGLE reports) for
comparison with papers, never as the headline: a single prompt timed under
load can move a mean of ratios arbitrarily.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

# record fields of a method's greedy match with its reference, as results.json has them
MATCH_FIELDS = {
    "speculative": ("greedy_match", "baseline_difference"),
    "baseline": ("hf_match", "hf_difference"),
}


def match_fields(key: str) -> tuple[str, str]:
    """(record field: equal to its reference, record field: where they first differ)."""
    return MATCH_FIELDS.get(key, (f"{key} match", f"{key} difference"))


def acceptance(accepted: list[int], depth: int) -> tuple[float, list[float]]:
    """(tau, rate[i] = share of verify steps that accepted at least i+1 drafts)."""
    return rates(counts(accepted, depth), depth)


def counts(accepted: list[int], depth: int) -> dict:
    """Per-step accepted drafts as the counters an engine keeps: steps, accepted, per position."""
    per_position = [sum(a > i for a in accepted) for i in range(depth)]
    return {"steps": len(accepted), "accepted": sum(accepted), "per_position": per_position}


def rates(c: dict, depth: int) -> tuple[float, list[float]]:
    """(tau, per-position acceptance rates) from counters."""
    if not c["steps"]:
        return 1.0, [0.0] * depth
    per_position = (c["per_position"] + [0] * depth)[:depth]
    return 1 + c["accepted"] / c["steps"], [n / c["steps"] for n in per_position]


def entry_counts(entry: dict, depth: int) -> dict | None:
    """A method's counters in one record: from our per-step list, or an engine's own."""
    if "accepted" in entry:
        return counts(entry["accepted"], depth)
    return entry.get("acceptance")


def total_counts(records: list[dict], depth: int, key: str = "speculative") -> dict:
    """Counters over every run of the method `key`."""
    total = {"steps": 0, "accepted": 0, "per_position": [0] * depth}
    for r in records:
        if key not in r or (c := entry_counts(r[key], depth)) is None:
            continue
        total["steps"] += c["steps"]
        total["accepted"] += c["accepted"]
        for i, n in enumerate(c["per_position"][:depth]):
            total["per_position"][i] += n
    return total


def throughput(records: list[dict], key: str) -> dict | None:
    runs = [r[key] for r in records if key in r]
    if not runs:
        return None
    tokens = sum(r["new_tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    return {"total": tokens / seconds if seconds else 0.0, "tokens": tokens, "seconds": seconds}


def speedups(records: list[dict], fast: str, slow: str) -> dict | None:
    pairs = [(r[fast], r[slow]) for r in records if fast in r and slow in r]
    if not pairs:
        return None
    ratios = [f["tokens_per_s"] / s["tokens_per_s"] for f, s in pairs if s["tokens_per_s"]]
    total_fast = sum(f["new_tokens"] for f, _ in pairs) / sum(f["seconds"] for f, _ in pairs)
    total_slow = sum(s["new_tokens"] for _, s in pairs) / sum(s["seconds"] for _, s in pairs)
    return {
        "mean_of_ratios": sum(ratios) / len(ratios) if ratios else None,
        "median_of_ratios": statistics.median(ratios) if ratios else None,
        "total_over_total": total_fast / total_slow if total_slow else None,
    }


def headline(speedup: dict | None) -> float | None:
    """The speedup a report leads with: total tokens over total seconds."""
    return (speedup or {}).get("total_over_total")


def _rate(records: list[dict], key: str) -> float | None:
    flags = [r[key] for r in records if key in r]
    return sum(flags) / len(flags) if flags else None


def summarize(records: list[dict], depth: int, by_category: bool = True) -> dict:
    total = total_counts(records, depth)
    accepted = total["steps"] > 0
    tau, per_position = rates(total, depth)
    totals = {
        name: throughput(records, name) for name in ("baseline", "speculative", "hf_generate")
    }
    speedup = {
        "vs_baseline": speedups(records, "speculative", "baseline"),
        "vs_hf_generate": speedups(records, "speculative", "hf_generate"),
        "baseline_vs_hf_generate": speedups(records, "baseline", "hf_generate"),
    }
    vs_base = speedup["vs_baseline"]
    summary = {
        "prompts": len(records),
        "tau": tau if accepted else None,
        "per_position_acceptance": per_position if accepted else None,
        "verify_steps": total["steps"],
        "tokens_per_s": {k: v and v["total"] for k, v in totals.items()},
        "new_tokens": {k: v and v["tokens"] for k, v in totals.items()},
        "speedup": speedup,
        # share of the ideal speedup tau that the decoder's overhead leaves
        "efficiency": headline(vs_base) / tau if vs_base and accepted else None,
        "greedy_match_rate": _rate(records, "greedy_match"),
        "hf_match_rate": _rate(records, "hf_match"),
    }
    categories = defaultdict(list)
    for r in records:
        categories[r["category"]].append(r)
    if by_category and len(categories) > 1:
        summary["per_category"] = {
            name: summarize(rs, depth, by_category=False) for name, rs in sorted(categories.items())
        }
    return summary


def method_figures(records: list[dict], key: str, hf: str, baseline: str, depth: int) -> dict:
    """One method's row in a side-by-side comparison (benchmarks/compare.py)."""
    total = total_counts(records, depth, key)
    flags = [r[field] for r in records if (field := match_fields(key)[0]) in r]
    return {
        "name": key,
        "prompts": len(records),
        "tokens_per_s": throughput(records, key)["total"],
        "speedup": headline(speedups(records, key, hf)),
        "vs_baseline": headline(speedups(records, key, baseline)),
        "tau": rates(total, depth)[0] if total["steps"] else None,
        "plain_matches": sum(flags) if flags else None,
    }
