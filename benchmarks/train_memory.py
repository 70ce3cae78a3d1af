"""Peak memory of one training-time-test step (forward + backward) vs sequence length.

The SmolLM2-135M draft (hidden 576, draft vocab 8192, 7 steps, bf16 autocast) on
CPU, batch 1. Each length runs in a fresh process and reports its peak RSS above
the RSS after setup, so the target's own forward is not counted (it is the same
for any draft trainer). Linear memory per step means the peak at most doubles
when the length doubles; a dense [T, T*j] score per step would quadruple.

    .venv/bin/python benchmarks/train_memory.py [--lengths 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def measure(length: int, draft_vocab: int, steps: int, chunk: int) -> dict:
    import time

    import torch

    from eagletools.draft import DraftConfig, Eagle3Draft
    from eagletools.targets import load_config
    from eagletools.train.ttt import TTTModel, teacher_targets

    tc = load_config("smollm2-135m")  # sizes only; the weights do not matter for memory
    config = DraftConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.hidden_size // tc.num_attention_heads, vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab, target_hidden_size=tc.hidden_size,
        max_position_embeddings=max(tc.max_position_embeddings, length + steps),
    )  # fmt: skip
    torch.manual_seed(0)
    model = TTTModel(Eagle3Draft(config), steps=steps, chunk=chunk)
    ids = torch.randint(0, tc.vocab_size, (1, length))
    aux = torch.randn(1, length, 3 * tc.hidden_size, dtype=torch.bfloat16)
    mask = torch.ones(1, length, dtype=torch.long)
    lm_head = torch.randn(tc.vocab_size, tc.hidden_size, dtype=torch.bfloat16) * 0.05
    probs, argmax = teacher_targets(
        torch.randn(1, length, tc.hidden_size, dtype=torch.bfloat16), lm_head, model.draft.d2t
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(ids, aux, mask, probs, argmax)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"length": length, "peak_mib": (peak - base) / 1024,
            "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.draft_vocab, args.steps, args.chunk)))
        return
    rows = []
    for length in args.lengths:
        cmd = [sys.executable, __file__, "--child", str(length), "--draft-vocab",
               str(args.draft_vocab), "--steps", str(args.steps), "--chunk", str(args.chunk)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"TTT step memory, SmolLM2-135M draft, Vd={args.draft_vocab}, K={args.steps}, bf16, CPU")
    print(f"{'length':>8} {'peak MiB':>10} {'x prev':>8} {'seconds':>8}")
    prev = None
    for r in rows:
        ratio = f"{r['peak_mib'] / prev:.2f}" if prev else "-"
        print(f"{r['length']:>8} {r['peak_mib']:>10.0f} {ratio:>8} {r['seconds']:>8.1f}")
        prev = r["peak_mib"]


if __name__ == "__main__":
    main()
