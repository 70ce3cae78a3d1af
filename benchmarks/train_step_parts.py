"""Where an online training step's time goes: target forward, teacher, draft, optimizer.

The demo trains with the target in its loop; this splits `Trainer.train_step`
into the target's forward (the aux states, `trainer.features`), the teacher's
product over the draft vocabulary, the draft's unrolled forward, its backward
and the optimizer's step (Muon's Newton-Schulz iterations), each timed around
its call (on CPU every call returns when its work is done). It shows which part
a faster trainer must shrink: on 2 AVX2 cores in fp32 the target's forward
already runs near the machine's GEMM peak. Steps after `--warmup` count.

    .venv/bin/python benchmarks/train_step_parts.py [--recipe recipes/smollm2-135m-cpu.yaml] \
        [--steps 30] [--warmup 10] [overrides ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def timed(parts: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name] += time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides")
    args = parser.parse_args()

    from eagletools.train import trainer as training
    from eagletools.train.recipe import load_config

    total = args.warmup + args.steps
    config = load_config(args.recipe, [
        *args.overrides, "data.eval_samples=1", f"training.max_steps={total}",
        "training.max_minutes=null", "training.eval_every=0", "training.save_every=0",
    ])  # fmt: skip
    parts: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = training.Trainer(config, tmp, training.online_inputs(config))
        # the callables train_step calls, wrapped: train_step itself runs unchanged
        features = training.features
        training.features = timed(parts, "target forward (aux states)", features)
        try:
            trainer._teacher = timed(parts, "teacher (draft-vocab product)", trainer._teacher)
            trainer.model = timed(parts, "draft forward (unroll)", trainer.model)
            acc = trainer.accelerator
            acc.backward = timed(parts, "draft backward", acc.backward)
            trainer.optimizer.step = timed(parts, "optimizer step", trainer.optimizer.step)
            for step in range(total):
                if step == args.warmup:
                    parts.clear()
                    start, tokens = time.perf_counter(), trainer.state.tokens
                trainer.train_step()
            wall, tokens = time.perf_counter() - start, trainer.state.tokens - tokens
        finally:
            training.features = features
    t = config.training
    print(f"{args.recipe}: steps {args.warmup + 1}-{total}, batch {t.batch_size}, "
          f"{t.ttt_steps} unrolled steps, optimizer {t.optimizer}, "
          f"{str(trainer.dtype).removeprefix('torch.')}")  # fmt: skip
    print(
        f"{tokens} tokens in {wall:.1f} s: {tokens / wall:.0f} tokens/s, "
        f"{wall / args.steps:.2f} s a step"
    )
    print("| part | s a step | share |")
    print("|---|---|---|")
    for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds / args.steps:.3f} | {seconds / wall:.1%} |")
    rest = wall - sum(parts.values())
    print(
        f"| the rest (batching, clipping, bookkeeping) | {rest / args.steps:.3f} | {rest / wall:.1%} |"
    )


if __name__ == "__main__":
    main()
