"""The draft's share of a speculative step on CPU: one draft forward, one whole tree.

Every speculative step drafts a tree: `depth - 1` draft forwards over the
top-k frontier plus the bookkeeping around each level (top-k, sort, index),
then the tree's mask (issue 16 measured it at a third of a target step). This
times, with the built-in target in bf16 and a draft head (`--draft`, default
an untrained one sized for the target), after a `--context`-token prompt:

- `draft forward`: the decoder's draft step over `--topk` frontier rows;
- `grow_tree`: one whole tree of shape (`--topk`, `--depth`, `--num-draft-tokens`).

Prints the median and the 10th-90th percentile in milliseconds over `--repeats`
calls, and the aten ops one call dispatches (what the eager overhead scales
with, whatever the load). `--against DIR` runs the same timing in a separate
process with eagletools imported from DIR (another commit's checkout:
`git worktree add /tmp/wt-old <commit>`) and prints both side by side.

    .venv/bin/python benchmarks/draft_step.py [--against /tmp/wt-old] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def percentiles(ms: list[float]) -> tuple[float, float, float]:
    """(10th, 50th, 90th) percentile."""
    deciles = statistics.quantiles(ms, n=10)
    return deciles[0], statistics.median(ms), deciles[-1]


def aten_ops(fn) -> int:
    """Ops one call of `fn` dispatches, views included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn()
    return count.ops


def timed(fn, repeats: int) -> dict:
    """{"ms": per call, `repeats` of them after 3 warm-up calls, "ops": aten ops per call}."""
    for _ in range(3):
        fn()
    ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - start) * 1e3)
    return {"ms": ms, "ops": aten_ops(fn)}


@torch.inference_mode()
def measure(args: argparse.Namespace) -> dict[str, dict]:
    """`timed` for each piece, on the eagletools this process imports."""
    from eagletools.decode import SpeculativeDecoder, Transformer
    from eagletools.decode.session import load_any_draft
    from eagletools.decode.tree import grow_tree
    from eagletools.targets import load_target

    dtype = torch.bfloat16
    target = load_target(args.target, dtype=dtype)
    runtime = Transformer.from_hf(target.model, dtype)
    draft = load_any_draft(args.draft, target, dtype, "cpu")
    spec = SpeculativeDecoder(runtime, draft, None, args.topk, args.depth, args.num_draft_tokens)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(runtime.args.vocab_size, (args.context,), generator=gen)
    spec.generate(prompt.tolist(), max_new_tokens=2)  # the draft's cache holds the prompt
    step = functools.partial(spec._draft_step, spec.session.last.draft_len)  # a `tree.DraftStep`
    k, width = args.topk, draft.config.hidden_size
    tokens = torch.randint(runtime.args.vocab_size, (k,), generator=gen)
    hidden = torch.randn(k, width, generator=gen).to(dtype)
    rows = torch.eye(k, dtype=torch.bool)
    logits = torch.randn(draft.config.draft_vocab_size, generator=gen).to(dtype)

    def tree():
        return grow_tree(
            step, int(tokens[0]), logits, hidden[0], spec.d2t,
            args.topk, args.depth, args.num_draft_tokens,
        )  # fmt: skip

    return {
        f"draft forward ({k} rows)": timed(lambda: step(1, tokens, hidden, rows), args.repeats),
        f"grow_tree ({args.topk},{args.depth},{args.num_draft_tokens})": timed(tree, args.repeats),
    }


def measure_at(checkout: Path, args: argparse.Namespace) -> dict[str, dict]:
    """`measure` in a child process that imports eagletools from `checkout`."""
    flags = ["target", "draft", "topk", "depth", "num_draft_tokens", "context", "repeats"]
    argv = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in flags]
    if args.threads:
        argv.append(f"--threads={args.threads}")
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--json"],
        env=env, check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="random", help="checkpoint or random[:SEED]")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the tree")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int)
    p.add_argument("--against", type=Path, help="a checkout of another commit to time too")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.json:
        print(json.dumps(measure(args)))
        return
    columns = {}
    if args.against:
        columns[str(args.against)] = measure_at(args.against, args)
    columns["this checkout"] = measure(args)
    print(f"{args.target} bf16, draft {args.draft}, {torch.get_num_threads()} threads, "
          f"context {args.context}, {args.repeats} calls; ms: median (p10-p90), aten ops")  # fmt: skip
    names = list(columns)
    print("| piece | " + " | ".join(names) + (" | speed-up |" if len(names) > 1 else " |"))
    print("|---|" + "---|" * (len(names) + (len(names) > 1)))
    for piece in columns["this checkout"]:
        cells = []
        for name in names:
            low, mid, high = percentiles(columns[name][piece]["ms"])
            cells.append(f"{mid:.2f} ({low:.2f}-{high:.2f}), {columns[name][piece]['ops']} ops")
        if len(names) > 1:
            before, after = (statistics.median(columns[n][piece]["ms"]) for n in names)
            cells.append(f"{before / after:.2f}x")
        print(f"| {piece} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
