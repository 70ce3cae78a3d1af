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

from eagletools.data.chat import chat_ids
from eagletools.decode import Sampling
from eagletools.dtypes import dtype_arg
from eagletools.eval.benchmarks import load_benchmark
from eagletools.eval.runner import Settings, load_decoders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="random", help="an EAGLE-3 checkpoint, or random[:SEED]")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg)
    p.add_argument("--tree", default="4,5,16", help="topk,depth,num_draft_tokens")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.9)
    args = p.parse_args()

    topk, depth, n_draft = (int(x) for x in args.tree.split(","))
    s = Settings(target=args.target, draft=args.draft, dtype=args.dtype,
                 topk=topk, depth=depth, num_draft_tokens=n_draft)  # fmt: skip
    decoders = load_decoders(s)
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
    for q in load_benchmark("mt-bench", args.num_prompts):
        ids = chat_ids(tokenizer, [{"role": "user", "content": q.turns[0]}])
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
