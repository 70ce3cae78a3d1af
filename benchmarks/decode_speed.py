"""Decoding speed side by side, in one run: HF generate, our baseline, our speculative decoder.

Each MT-bench first turn goes through the three in turn (greedy), so machine
load hits all of them alike; the figures are medians of per-prompt ratios.
Issue 5 targets (SmolLM2-135M, bf16, CPU): baseline / HF generate >= 1.2;
efficiency = (speculative / baseline tokens/s) / tau >= 0.6 at the autotuned
shape; with a trained draft, speculative >= 1.5x baseline and >= 1.8x HF.

    .venv/bin/python benchmarks/decode_speed.py --draft random --num-prompts 5
    .venv/bin/python benchmarks/decode_speed.py --draft runs/cpu/draft --autotune \
        --num-prompts 80 --output runs/bench/decode_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics

from eagletools.atomic import write_text
from eagletools.dtypes import dtype_arg
from eagletools.eval.benchmarks import load_benchmark
from eagletools.eval.runner import Settings, run_eval


def medians(records: list[dict]) -> dict:
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def ratio(r, a, b):
        return r[a]["tokens_per_s"] / r[b]["tokens_per_s"] if a in r and b in r else None

    def tau(r):
        acc = r.get("speculative", {}).get("accepted")
        return 1 + sum(acc) / len(acc) if acc else None

    return {
        "tokens_per_s": {
            k: median(r[k]["tokens_per_s"] for r in records if k in r)
            for k in ("hf_generate", "baseline", "speculative")
        },
        "baseline_vs_hf_generate": median(ratio(r, "baseline", "hf_generate") for r in records),
        "speculative_vs_baseline": median(ratio(r, "speculative", "baseline") for r in records),
        "speculative_vs_hf_generate": median(
            ratio(r, "speculative", "hf_generate") for r in records
        ),
        "tau": median(tau(r) for r in records),
        "efficiency": median(
            ratio(r, "speculative", "baseline") / tau(r) if tau(r) else None for r in records
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", help="checkpoint or random[:SEED]; without it no speculative run")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--autotune", action="store_true")
    p.add_argument("--threads", type=int)
    p.add_argument("--output", help="write the figures and per-prompt records here (JSON)")
    args = p.parse_args()

    questions = load_benchmark("mt-bench", args.num_prompts, max_turns=1)
    s = Settings(
        target=args.target,
        draft=args.draft,
        bench="mt-bench (first turns)",
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        topk=args.topk,
        depth=args.depth,
        num_draft_tokens=args.num_draft_tokens,
        hf_baseline=True,
        dtype=args.dtype,
        threads=args.threads,
        autotune=args.autotune,
    )
    results = run_eval(s, questions)
    figures = medians(results["per_prompt"])
    print(json.dumps({"settings": results["settings"], "machine": results["machine"]}, indent=1))
    print(json.dumps(figures, indent=1))
    print(json.dumps({"bandwidth": results["bandwidth"]}, indent=1))
    if args.output:
        results["medians"] = figures
        write_text(args.output, json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
