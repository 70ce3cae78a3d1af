"""Trained tokens/s per training precision, online and offline, on a recipe's settings.

Each precision loads the target as training does (`training.precision: fp32`
runs the teacher in fp32 too; `auto` is one of the two, per device). Online
runs the target in the loop; offline first caches its hidden states (not
timed) and trains from the cache. The runs share the recipe's settings (the
demo's by default), the same samples and the same step count, one after the
other: on a CPU without AMX fp32 is the faster, with AMX bf16. Also prints the
offline cache's bytes per token: (A+1)*Ht*2 bytes of bf16 states plus a 4-byte
id and a 1-byte mask, and the file's per-sample offsets and headers.

    .venv/bin/python benchmarks/train_throughput.py [--recipe recipes/smollm2-135m-cpu.yaml] \
        [--steps 20] [--samples 64] [--precisions bf16,fp32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--precisions", default="bf16,fp32")
    args = parser.parse_args()

    import torch

    from eagletools.data import prepare
    from eagletools.data.hidden_states import HiddenStateCache, write_hidden_states
    from eagletools.devices import fast_matmul_dtype
    from eagletools.train.inputs import load_teacher, offline_inputs, online_inputs
    from eagletools.train.recipe import load_config
    from eagletools.train.trainer import Trainer

    common = [
        "data.eval_samples=1", f"training.max_steps={args.steps}", "training.max_minutes=null",
        "training.eval_every=0", "training.save_every=0",
    ]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for precision in args.precisions.split(","):
            online = load_config(args.recipe, [*common, f"training.precision={precision}"])
            target = load_teacher(online)
            d = online.data
            prepared = prepare(online.target.spec, d.train, d.max_length, args.samples,
                               tokenizer=target.tokenizer)  # fmt: skip
            on = Trainer(online, tmp / f"on-{precision}",
                         online_inputs(online, target, prepared.dataset)).run()  # fmt: skip
            cache = tmp / f"cache-{precision}"
            write_hidden_states(target, prepared.dataset, cache, data_key=prepared.key,
                                max_length=d.max_length)  # fmt: skip
            offline = load_config(args.recipe, [*common, f"training.precision={precision}",
                                                f"data.hidden_states={cache}"])  # fmt: skip
            off = Trainer(offline, tmp / f"off-{precision}", offline_inputs(offline)).run()
            rows.append((precision, str(target.model.dtype).removeprefix("torch."),
                         on["tokens_per_s"], off["tokens_per_s"]))  # fmt: skip
        a, ht = len(HiddenStateCache.open(cache).aux_layer_ids), target.info.hidden_size
        measured = HiddenStateCache.open(cache).bytes_per_token()
    cpu = torch.device("cpu")
    print(f"{args.recipe}: {args.steps} steps, {args.samples} samples, {os.cpu_count()} CPUs, "
          f"fastest matmul dtype here {str(fast_matmul_dtype(cpu)).removeprefix('torch.')}")  # fmt: skip
    print("| training.precision | teacher | online tokens/s | offline tokens/s |")
    print("|---|---|---|---|")
    for precision, teacher, on_speed, off_speed in rows:
        print(f"| {precision} | {teacher} | {on_speed:.1f} | {off_speed:.1f} |")
    print(f"offline cache bytes/token: {measured:.1f} on disk; payload (A+1)*Ht*2 + id 4 + mask 1 "
          f"= ({a}+1)*{ht}*2 + 5 = {(a + 1) * ht * 2 + 5}")  # fmt: skip


if __name__ == "__main__":
    main()
