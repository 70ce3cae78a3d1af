"""Rows times a weight on CPU, per SmolLM2-135M shape: `F.linear`, `torch.mv`, packed, ours.

Decoding multiplies 1 row (a token) or a few (a draft tree) by every weight;
training's target forward multiplies hundreds. `packed` is oneDNN's product with the
bf16 weight pre-packed once (`eagletools.cpu_ops.packed_linear`) instead of at every
call, timed at every row count, one row included; `ours` is our bf16 kernel
(`eagletools.native.bf16_linear`), which decoding takes where oneDNN cannot pack. Each call
takes the next of enough distinct weights (about 200 MB) that none is still in
cache, as in a real forward. Prints microseconds per call (median of 5 rounds)
and each method's speed-up over `F.linear`.

    .venv/bin/python benchmarks/gemv.py [--dtype bfloat16|float32] [--threads N] [--rows 1 12 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from eagletools import native
from eagletools.cpu_ops import packed_linear, packed_weight, packing_available
from eagletools.decode.timing import cpu_model

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
    p.add_argument("--rows", type=int, nargs="+", default=[1, 12, 512])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    methods = {"F.linear": lambda w, x: F.linear(x, w)}
    methods["torch.mv (1 row)"] = lambda w, x: torch.mv(w, x[0])
    if dtype == torch.bfloat16 and packing_available():
        methods["packed"] = lambda w, x: packed_linear(x, w, None)
    if dtype == torch.bfloat16 and (ours := native.bf16_linear()):
        methods["ours"] = lambda w, x: ours(x, w, None)
    print(f"dtype {args.dtype}, {torch.get_num_threads()} threads, {cpu_model()}")
    print(f"| weight | shape | rows | {' | '.join(methods)} | speed-up over F.linear |")
    print("|---|---|---|" + "---|" * (len(methods) + 1))
    with torch.inference_mode():
        for name, (out, inp) in SHAPES.items():
            nbytes = out * inp * dtype.itemsize
            weights = [
                torch.randn(out, inp, dtype=dtype) for _ in range(max(4, 200_000_000 // nbytes))
            ]
            if "packed" in methods:
                for w in weights:
                    packed_weight(w)  # packed once, as a model's weights are
            for rows in args.rows:
                x = torch.randn(rows, inp, dtype=dtype)
                us = {
                    m: time_calls(fn, weights, x)
                    for m, fn in methods.items()
                    if rows == 1 or not m.startswith("torch.mv")
                }
                cells = " | ".join(f"{us[m]:.0f} us" if m in us else "-" for m in methods)
                best = {m: us["F.linear"] / t for m, t in us.items() if m != "F.linear"}
                gains = ", ".join(f"{m.split()[0]} {r:.2f}x" for m, r in best.items())
                print(f"| {name} | {out}x{inp} | {rows} | {cells} | {gains} |")


if __name__ == "__main__":
    main()
