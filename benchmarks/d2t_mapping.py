"""Draft ids to target ids: map after the top-k, or scatter logits into the target vocab?

docs/design.md 3.6 maps after the top-k / argmax over the draft-vocab logits
(`id + d2t[id]`, `eagletools.kernels.topk_d2t_reference`). The alternative
scatters the draft logits into a `-inf` tensor of the target vocab, then takes
the top-k there. Both give the same log-probs and target ids (checked here);
this times them on CPU, medians over repeats, batch 1 and 64, draft vocab 32k,
target vocab 128k.

    .venv/bin/python benchmarks/d2t_mapping.py [--repeats 50] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagletools.kernels import topk_d2t_reference
from eagletools.vocab import DraftVocab


def scatter_topk(logits: torch.Tensor, selected: torch.Tensor, vocab_size: int, k: int):
    """The rejected form: a full target-vocab row per draft row, then top-k."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, selected] = logits
    values, ids = full.topk(k, dim=-1)
    return values.float() - torch.logsumexp(full.float(), dim=-1, keepdim=True), ids


def median_us(fn, args: tuple, repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--draft-vocab", type=int, default=32_000)
    parser.add_argument("--target-vocab", type=int, default=128_256)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    selected = torch.randperm(args.target_vocab, generator=gen)[: args.draft_vocab].sort().values
    vocab = DraftVocab.from_selected(selected, args.target_vocab)
    print(
        f"draft vocab {args.draft_vocab}, target vocab {args.target_vocab}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} runs (us)"
    )
    print(
        f"{'dtype':8} {'batch':>5} {'k':>3} {'map after':>10} {'scatter':>10} {'scatter/map':>12}"
    )
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 64):
            logits = torch.randn(batch, args.draft_vocab, generator=gen).to(dtype)
            for k in (1, 8):
                mapped = topk_d2t_reference(logits, vocab.d2t, k)
                scattered = scatter_topk(logits, selected, args.target_vocab, k)
                # same log-probs; the same ids up to the order of tied logits
                torch.testing.assert_close(mapped[0], scattered[0])
                assert torch.equal(mapped[1].sort().values, scattered[1].sort().values) or bool(
                    (mapped[0][:, -1] == mapped[0][:, -2]).any()
                )
                t_map = median_us(topk_d2t_reference, (logits, vocab.d2t, k), args.repeats)
                t_scatter = median_us(
                    scatter_topk, (logits, selected, args.target_vocab, k), args.repeats
                )
                name = str(dtype).removeprefix("torch.")
                print(
                    f"{name:8} {batch:>5} {k:>3} {t_map:>10.1f} {t_scatter:>10.1f} "
                    f"{t_scatter / t_map:>12.2f}"
                )


if __name__ == "__main__":
    main()
