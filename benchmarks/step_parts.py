"""Where a decoding step's time goes: the graph, the KV compaction, the host read, the rest.

Efficiency (speculative speedup over the baseline / tau) is the share of a
step spent as a target forward would; this splits the rest. Both decoders run
the same MT-bench first turns in turn (greedy); each part is timed around its
call (on CPU every call returns when its work is done) and reported as the
median per step, in ms, beside the baseline's step.

    .venv/bin/python benchmarks/step_parts.py --draft runs/long/final --compile \
        --topk 1 --depth 1 --num-draft-tokens 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from eagletools.data.chat import chat_ids
from eagletools.decode.session import Decoders, Settings, load_decoders
from eagletools.eval.questions import load_benchmark


def timed(record: list[float], fn):
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out

    return call


def instrument(d: Decoders) -> dict[str, list[float]]:
    """Wrap each part in a timer, before the first call, so a compiled step never sees a
    change; returns each part's record of seconds per call."""
    base, spec = d.baseline, d.speculative
    times: dict[str, list[float]] = defaultdict(list)
    for name, decoder in (("baseline", base), ("speculative", spec)):
        decoder.session.prefill = timed(
            times[f"{name}: target prefill (per prompt)"], decoder.session.prefill
        )
    spec._refresh = timed(times["speculative: draft prefill (per prompt)"], spec._refresh)
    base.forward = timed(times["baseline: forward"], base.forward)
    spec.device_step = timed(times["speculative: graph"], spec.device_step)
    cache = d.runtime.kv_cache
    cache.compact = timed(times["speculative: KV compaction"], cache.compact)
    spec._step = timed(times["speculative: step"], spec._step)
    return times


def parts_table(times: dict[str, list[float]], steps: int, tau: float, shape: str) -> float:
    """Print each part's median ms beside the baseline's forward; returns that forward's ms."""
    # a step without a slot to move skips the compaction: its mean over every step
    compaction = times.pop("speculative: KV compaction")
    median_ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    step = median_ms.pop("speculative: step")
    median_ms["speculative: KV compaction (mean)"] = 1e3 * sum(compaction) / steps
    median_ms["speculative: rest of the step (host read)"] = (
        step - median_ms["speculative: graph"] - median_ms["speculative: KV compaction (mean)"]
    )
    forward = median_ms["baseline: forward"]
    print(f"{shape}, tau {tau:.2f}\n")
    print("| part | ms (median) | vs the baseline's forward |\n|---|---|---|")
    for name, ms in median_ms.items():
        print(f"| {name} | {ms:.2f} | {ms / forward:.3f}x |")
    return forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="random")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()

    s = Settings(
        target=args.target, draft=args.draft, max_new_tokens=args.max_new_tokens,
        topk=args.topk, depth=args.depth, num_draft_tokens=args.num_draft_tokens,
        compile=args.compile,
    )  # fmt: skip
    d = load_decoders(s)
    base, spec = d.baseline, d.speculative
    tok = d.target.tokenizer
    prompts = [
        chat_ids(tok, [{"role": "user", "content": q.turns[0]}])
        for q in load_benchmark("mt-bench", args.num_prompts, max_turns=1)
    ]
    d.runtime.reserve(max(map(len, prompts)) + args.max_new_tokens + args.num_draft_tokens + 1)
    times = instrument(d)
    for decoder in (base, spec):  # compile and allocate outside the timing
        decoder.generate(prompts[0], 8)
        decoder.reset()
    for record in times.values():
        record.clear()

    totals = defaultdict(float)
    steps = defaultdict(int)
    for prompt in prompts:
        for name, decoder in (("baseline", base), ("speculative", spec)):
            decoder.reset()
            r = decoder.generate(prompt, args.max_new_tokens)
            totals[name] += r.seconds
            steps[name] += r.steps
            totals[name + " tokens"] += len(r.tokens)

    prefill = {
        name: sum(times[f"{name}: target prefill (per prompt)"])
        for name in ("baseline", "speculative")
    }
    prefill["speculative"] += sum(times["speculative: draft prefill (per prompt)"])
    tau = totals["speculative tokens"] / steps["speculative"]
    shape = f"{args.topk}/{args.depth}/{args.num_draft_tokens}"
    parts_table(times, steps["speculative"], tau, shape)
    speed = {}
    print("\n| decoder | tokens/s | tokens/s after prefill | ms per step after prefill |")
    print("|---|---|---|---|")
    for name in ("baseline", "speculative"):
        tokens, seconds = totals[name + " tokens"], totals[name]
        speed[name] = (tokens / seconds, tokens / (seconds - prefill[name]))
        per_step = 1e3 * (seconds - prefill[name]) / steps[name]
        print(f"| {name} | {speed[name][0]:.1f} | {speed[name][1]:.1f} | {per_step:.2f} |")
    whole, decode = (speed["speculative"][i] / speed["baseline"][i] for i in (0, 1))
    print(f"\nspeedup {whole:.3f}x ({decode:.3f}x after prefill), efficiency {whole / tau:.3f}")


if __name__ == "__main__":
    main()
