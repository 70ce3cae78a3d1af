"""What sampling costs a speculative step beside greedy verification, in one run.

Issue 16: speculative sampling at top-p 0.9 must cost at most 1.5x the greedy
step. Each MT-bench first turn is decoded greedily, then sampled (temperature
and top-p as given), alternating so machine load hits both alike; the figure
is the median over prompts of per-step time ratios (a step: one draft tree
and one verify forward).

    .venv/bin/python benchmarks/sampling_cost.py --draft runs/demo/eagle --num-prompts 10
"""

from __future__ import annotations

import argparse
import statistics

import torch
from compare import add_run_args, first_turns, run_settings  # benchmarks/, beside this script

from eagletools.decode import Sampling
from eagletools.decode.session import load_decoders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, num_prompts=10)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.9)
    args = p.parse_args()

    decoders = load_decoders(run_settings(args))
    spec, tokenizer = decoders.speculative, decoders.target.tokenizer
    modes = {
        "greedy": Sampling(),
        f"temperature {args.temperature}, top-p {args.top_p}": Sampling(
            temperature=args.temperature, top_p=args.top_p
        ),
    }
    generator = torch.Generator().manual_seed(0)
    per_step = {name: [] for name in modes}
    taus = {name: [] for name in modes}
    prompts = first_turns(tokenizer, args.num_prompts)
    for sampling in modes.values():  # warm-up: first-call allocation is not timed
        spec.generate(prompts[0][:32], 8, sampling, generator=generator)
    for ids in prompts:
        for name, sampling in modes.items():
            spec.reset()
            r = spec.generate(ids, args.max_new_tokens, sampling, generator=generator)
            per_step[name].append(r.seconds / max(r.steps, 1))
            taus[name].append(r.tau)
    greedy = per_step["greedy"]
    print(f"| mode (tree {args.tree}) | ms per step (median) | tau | step time / greedy's |")
    print("|---|---|---|---|")
    for name, times in per_step.items():
        ratio = statistics.median(t / g for t, g in zip(times, greedy, strict=True))
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} "
              f"| {statistics.median(taus[name]):.2f} | {ratio:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
