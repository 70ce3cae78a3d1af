"""Trained tokens/s of the online training step, conversations padded against packed.

Two trainers on a recipe's settings (the demo's by default) share one loaded
target and one prepared dataset: one pads each micro-batch's conversations to
the longest (`training.pack_tokens: 0`), the other packs them end to end into
rows of `--pack-tokens` (default `data.max_length`), with the same
`training.batch_size` rows a micro-batch. Their steps alternate, so both see
the same load on a shared machine; after `--warmup` steps each, every step's
tokens/s counts, and the table gives the median, the total tokens over the
total seconds, and packed over padded. The CPU (lscpu's model name) and the
1-minute load average before and after are printed beside it.

    .venv/bin/python benchmarks/packing.py [--recipe recipes/smollm2-135m-cpu.yaml] \
        [--steps 8] [--warmup 2] [--samples 256] [--pack-tokens N] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from eagletools.decode.timing import cpu_model


def timed_step(trainer) -> tuple[int, float]:
    """(tokens, seconds) of one optimizer step."""
    tokens, start = trainer.state.tokens, time.perf_counter()
    trainer.train_step()
    return trainer.state.tokens - tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--pack-tokens", type=int, default=None)
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")

    from eagletools.data import prepare
    from eagletools.dtypes import dtype_name
    from eagletools.train.inputs import load_teacher, online_inputs
    from eagletools.train.recipe import load_config
    from eagletools.train.trainer import Trainer

    total = args.warmup + args.steps
    common = [*args.overrides, "data.eval_samples=1", f"training.max_steps={total}",
              "training.max_minutes=null", "training.eval_every=0", "training.save_every=0"]  # fmt: skip
    base = load_config(args.recipe, common)
    pack = args.pack_tokens or base.data.max_length
    d, load_before = base.data, os.getloadavg()[0]
    target = load_teacher(base)
    prepared = prepare(base.target.spec, d.train, d.max_length, args.samples,
                       tokenizer=target.tokenizer)  # fmt: skip
    settings = {"padded": [], f"packed {pack}": [f"training.pack_tokens={pack}"]}
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name, extra in settings.items():
            config = load_config(args.recipe, [*common, *extra])
            inputs = online_inputs(config, target, prepared.dataset)
            trainers[name] = Trainer(config, Path(tmp) / name.replace(" ", "-"), inputs)
        for step in range(total):
            for name, trainer in trainers.items():  # alternating: the same load for both
                tokens, seconds = timed_step(trainer)
                if step >= args.warmup:
                    runs[name].append((tokens, seconds))
    t = base.training
    print(f"{args.recipe}: {cpu_model()}, {os.cpu_count()} CPUs, load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after; online, batch "
          f"{t.batch_size} rows, {t.ttt_steps} unrolled steps, "
          f"{dtype_name(str(trainers['padded'].dtype))}; steps {args.warmup + 1}-{total} "
          f"of each, alternating")  # fmt: skip
    print("| rows | tokens a step | median tokens/s | total tokens/s |")
    print("|---|---|---|---|")
    medians = {}
    for name, record in runs.items():
        tokens, seconds = sum(n for n, _ in record), sum(s for _, s in record)
        medians[name] = statistics.median(n / s for n, s in record)
        print(f"| {name} | {tokens / len(record):.0f} | {medians[name]:.0f} | "
              f"{tokens / seconds:.0f} |")  # fmt: skip
    ratio = medians[f"packed {pack}"] / medians["padded"]
    print(f"packed / padded (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
