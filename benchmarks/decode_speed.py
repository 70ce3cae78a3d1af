"""Decoding speed side by side, in one run: HF generate, our baseline, our speculative decoder.

Each MT-bench first turn goes through the three in turn (greedy), so machine
load hits all of them alike; the figures are those of `eagletools eval`'s
summary (eval.metrics): total tokens over total seconds, tau over every step.
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

from eagletools.atomic import write_text
from eagletools.decode.session import Settings
from eagletools.dtypes import dtype_arg
from eagletools.eval.questions import load_benchmark
from eagletools.eval.report import load_warning
from eagletools.eval.runner import run_eval


def figures(summary: dict) -> dict:
    """The issue 5 figures, from a run's summary."""
    speedup = summary["speedup"]
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "baseline_vs_hf_generate": speedup["baseline_vs_hf_generate"],
        "speculative_vs_baseline": speedup["vs_baseline"],
        "speculative_vs_hf_generate": speedup["vs_hf_generate"],
        "tau": summary["tau"],
        "efficiency": summary["efficiency"],
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
    print(json.dumps({"settings": results["settings"], "machine": results["machine"]}, indent=1))
    print(json.dumps(figures(results["summary"]), indent=1))
    print(json.dumps({"bandwidth": results["bandwidth"]}, indent=1))
    print("\n".join(load_warning(results["machine"])))
    if args.output:
        write_text(args.output, json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
