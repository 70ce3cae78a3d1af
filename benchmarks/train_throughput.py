"""Trained tokens/s on CPU, online and offline, and the offline cache's bytes per token.

Online runs the SmolLM2-135M target in the loop; offline first caches its
hidden states (not timed) and then trains from the cache. Both use the demo
recipe's shapes (batch 4 x max length 512, draft vocab 8192, 7 TTT steps, bf16).
The cache's payload per token is (A+1)*Ht*2 bytes of bf16 states plus a 4-byte
id and a 1-byte mask; the file size adds only the per-sample offsets and headers.

    .venv/bin/python benchmarks/train_throughput.py [--steps 4] [--samples 48]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    args = parser.parse_args()

    from eagletools.data import prepare
    from eagletools.data.hidden_states import HiddenStateCache, write_hidden_states
    from eagletools.target import load_target
    from eagletools.train.recipe import load_config
    from eagletools.train.trainer import Trainer, offline_inputs, online_inputs

    target = load_target("smollm2-135m")
    prepared = prepare("smollm2-135m", "sharegpt", args.max_length, args.samples,
                       tokenizer=target.tokenizer)  # fmt: skip
    common = [
        f"data.max_length={args.max_length}", "data.eval_samples=1",
        f"vocab.draft_vocab_size={args.draft_vocab}", f"training.batch_size={args.batch_size}",
        f"training.max_steps={args.steps}", "training.eval_every=0", "training.save_every=0",
        "draft.init_head_from_target=false",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        online = load_config(None, common)
        r_on = Trainer(online, tmp / "on", online_inputs(online, target, prepared.dataset)).run()
        write_hidden_states(target, prepared.dataset, tmp / "cache", data_key=prepared.key,
                            max_length=args.max_length)  # fmt: skip
        offline = load_config(None, [*common, f"data.hidden_states={tmp / 'cache'}"])
        r_off = Trainer(offline, tmp / "off", offline_inputs(offline)).run()
        cache = HiddenStateCache.open(tmp / "cache")
        a, ht = len(cache.aux_layer_ids), target.info.hidden_size
        payload = (a + 1) * ht * 2 + 4 + 1
        measured = cache.bytes_per_token()
    print(f"trained tokens/s (batch {args.batch_size} x <= {args.max_length}, "
          f"Vd {args.draft_vocab}, {args.steps} steps, {os.cpu_count()} CPUs)")  # fmt: skip
    print(f"  online  : {r_on['tokens_per_s']:8.1f}")
    print(f"  offline : {r_off['tokens_per_s']:8.1f}")
    print(f"offline cache bytes/token: {measured:.1f} on disk; payload (A+1)*Ht*2 + id 4 + mask 1 "
          f"= ({a}+1)*{ht}*2 + 5 = {payload}")  # fmt: skip


if __name__ == "__main__":
    main()
