"""One token times a weight on CPU: `F.linear` against `torch.mv`, per SmolLM2-135M shape.

Decoding at batch 1 is a chain of matrix-vector products, so their speed is the
baseline's speed. Each call takes the next of enough distinct weights (about
200 MB) that none is still in cache, as in a real forward. Prints microseconds
(median of 5 rounds) and the weight bytes streamed per second.

    .venv/bin/python benchmarks/gemv.py [--dtype bfloat16|float32] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # SmolLM2-135M: (out, in)
    "fused q/k/v": (960, 576),
    "o_proj": (576, 576),
    "fused gate/up": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def time_calls(fn, weights: list[torch.Tensor], x: torch.Tensor, rounds: int = 5) -> float:
    """Median microseconds per call over `rounds` passes through all the weights."""
    for w in weights[:3]:
        fn(w, x)
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for w in weights:
            fn(w, x)
        per_call.append((time.perf_counter() - start) / len(weights) * 1e6)
    return statistics.median(per_call)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    methods = {
        "F.linear": lambda w, x: F.linear(x.view(1, 1, -1), w),
        "torch.mv": lambda w, x: torch.mv(w, x),
    }
    print(f"dtype {args.dtype}, {torch.get_num_threads()} threads")
    print(f"| weight | shape | {' | '.join(methods)} | mv speed-up | mv GB/s |")
    print("|---|---|" + "---|" * (len(methods) + 2))
    with torch.inference_mode():
        for name, (out, inp) in SHAPES.items():
            nbytes = out * inp * dtype.itemsize
            weights = [
                torch.randn(out, inp, dtype=dtype) for _ in range(max(4, 200_000_000 // nbytes))
            ]
            x = torch.randn(inp, dtype=dtype)
            us = {m: time_calls(fn, weights, x) for m, fn in methods.items()}
            cells = " | ".join(f"{us[m]:.0f} us" for m in methods)
            ratio = us["F.linear"] / us["torch.mv"]
            print(
                f"| {name} | {out}x{inp} | {cells} | {ratio:.2f}x | {nbytes / us['torch.mv'] / 1e3:.1f} |"
            )


if __name__ == "__main__":
    main()
