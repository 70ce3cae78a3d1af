"""Where an online training step's time goes: target forward, teacher, draft, optimizer.

The demo trains with the target in its loop; this splits `Trainer.train_step`
into the target's forward (the aux states, `trainer.features`), the teacher's
product over the draft vocabulary, the draft's unrolled forward, its backward
and the optimizer's step (Muon's Newton-Schulz iterations), each timed around
its call (on CPU every call returns when its work is done). It shows which part
a faster trainer must shrink. Steps after `--warmup` count.

    .venv/bin/python benchmarks/train_step_parts.py [--recipe recipes/smollm2-135m-cpu.yaml] \
        [--steps 30] [--warmup 10] [overrides ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

from step_parts import timed  # benchmarks/, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")

    from eagletools.dtypes import dtype_name
    from eagletools.train import trainer as training
    from eagletools.train.inputs import online_inputs
    from eagletools.train.recipe import load_config

    total = args.warmup + args.steps
    config = load_config(args.recipe, [
        *args.overrides, "data.eval_samples=1", f"training.max_steps={total}",
        "training.max_minutes=null", "training.eval_every=0", "training.save_every=0",
    ])  # fmt: skip
    parts: dict[str, list[float]] = defaultdict(list)  # seconds of each call
    with tempfile.TemporaryDirectory() as tmp:
        trainer = training.Trainer(config, tmp, online_inputs(config))
        # the callables train_step calls, wrapped: train_step itself runs unchanged
        features = training.features
        training.features = timed(parts["target forward (aux states)"], features)
        try:
            trainer._teacher = timed(parts["teacher (draft-vocab product)"], trainer._teacher)
            trainer.model = timed(parts["draft forward (unroll)"], trainer.model)
            acc = trainer.accelerator
            acc.backward = timed(parts["draft backward"], acc.backward)
            trainer.optimizer.step = timed(parts["optimizer step"], trainer.optimizer.step)
            for step in range(total):
                if step == args.warmup:
                    for record in parts.values():
                        record.clear()
                    start, tokens = time.perf_counter(), trainer.state.tokens
                trainer.train_step()
            wall, tokens = time.perf_counter() - start, trainer.state.tokens - tokens
        finally:
            training.features = features
    t = config.training
    print(f"{args.recipe}: steps {args.warmup + 1}-{total}, batch {t.batch_size}, "
          f"{t.ttt_steps} unrolled steps, optimizer {t.optimizer}, "
          f"{dtype_name(str(trainer.dtype))}")  # fmt: skip
    print(f"{tokens} tokens in {wall:.1f} s: {tokens / wall:.0f} tokens/s, "
          f"{wall / args.steps:.2f} s a step")  # fmt: skip
    print("| part | s a step | share |")
    print("|---|---|---|")
    seconds = {name: sum(record) for name, record in parts.items()}
    seconds["the rest (batching, clipping, bookkeeping)"] = wall - sum(seconds.values())
    for name, spent in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {spent / args.steps:.3f} | {spent / wall:.1%} |")


if __name__ == "__main__":
    main()
