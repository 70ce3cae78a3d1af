"""Whether two runs' acceptances differ by their texts or by their engines.

Each `eagletools eval` run (ours or `--engine vllm` / `llama.cpp`) keeps its
plain decoding's tokens in results.json. In bf16 an engine's greedy text can
leave ours within a few tokens (another kernel rounds a near tie the other
way), and from there it drafts on another text. This replays a draft, teacher-
forced with our runtime, over each run's own plain text: its step-0 hit rate
at every reply position beside the run's measured first-position acceptance.
Where both agree per prompt, the engine accepts what the draft predicts on
that text, and a gap between engines is the texts' (docs/deploy.md).

    .venv/bin/python benchmarks/engine_text.py --draft runs/long/final \\
        runs/eval-ours/results.json runs/eval-vllm/results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def measured_first(record: dict) -> float | None:
    """A record's first-position acceptance: ours counts accepted drafts per verify step,
    an engine its per-position counters."""
    spec = record.get("speculative") or {}
    if "accepted" in spec:
        return sum(a >= 1 for a in spec["accepted"]) / max(1, len(spec["accepted"]))
    if counters := spec.get("acceptance"):
        return counters["per_position"][0] / max(1, counters["steps"])
    return None


@torch.inference_mode()
def step0_guesses(runtime, draft, seq: list[int]) -> torch.Tensor:
    """[n - 1] target ids: row i is the draft's step-0 guess for token i + 2, from the
    target's aux state at i and token i + 1 (the decoder's prefill over a prompt)."""
    from eagletools.decode.model import extend_mask
    from eagletools.draft import DraftKVCache

    ids = torch.tensor(seq, device=runtime.device)
    n = ids.numel()
    runtime.setup_caches(1, n)
    _, aux = runtime(ids[None], torch.arange(n, device=ids.device), 0, None,
                     tuple(draft.config.aux_layer_ids))  # fmt: skip
    cache = DraftKVCache.allocate(draft.config, 1, n, runtime.dtype, runtime.device)
    slots = torch.arange(n - 1, device=ids.device)
    # as the decoder's prefill: past 64 rows causal SDPA, no [n, n] mask (1 GB at 32k tokens)
    mask = extend_mask(0, n - 1, device=ids.device) if n - 1 <= 64 else None
    logits, _ = draft.decode(draft.fuse_aux(aux[0, :-1])[None], ids[None, 1:], slots, cache,
                             slots, mask)  # fmt: skip
    return draft.to_target_ids(logits[0].argmax(-1))


def step0_hits(runtime, draft, prompt: list[int], reply: list[int]) -> tuple[int, int]:
    """(hits, positions) over the reply's tokens after its first."""
    guess = step0_guesses(runtime, draft, prompt + reply)
    hit = guess[len(prompt) - 1 : -1].cpu() == torch.tensor(reply[1:])  # the last: past the end
    return int(hit.sum()), hit.numel()


def replay(path: Path, runtime, draft, tokenizer) -> list[dict]:
    """Per prompt of one results.json: the measured rate and the replayed one."""
    from eagletools.data.chat import chat_ids
    from eagletools.eval.questions import load_benchmark

    results = json.loads(path.read_text())
    if "tokens" not in results["per_prompt"][0].get("baseline", {}):
        raise SystemExit(f"{path}: per_prompt[].baseline.tokens missing; rerun `eagletools "
                         "eval` (its results.json keeps each method's tokens since bb23a1a)")  # fmt: skip
    questions = {q.id: q for q in load_benchmark(results["settings"]["bench"])}
    rows = []
    for record in results["per_prompt"]:
        messages, hits, total = [], 0, 0
        replies = record["baseline"]["tokens"]  # the run's turns: --max-turns may cut them
        for turn, reply in zip(questions[record["id"]].turns[: len(replies)], replies, strict=True):
            messages.append({"role": "user", "content": turn})
            h, t = step0_hits(runtime, draft, chat_ids(tokenizer, messages), reply)
            hits, total = hits + h, total + t
            text = tokenizer.decode(reply, skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": text})
        rows.append({"id": record["id"], "measured": measured_first(record),
                     "replayed": hits / max(1, total), "tokens": record["baseline"]["tokens"]})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="results.json files of one benchmark")
    p.add_argument("--draft", required=True, help="the draft those runs used (any format)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()

    from eagletools.decode import Transformer
    from eagletools.decode.session import load_any_draft
    from eagletools.dtypes import parse_dtype
    from eagletools.eval.measure import first_difference
    from eagletools.targets import load_target

    dtype = parse_dtype(args.dtype)
    target = load_target(args.target, dtype=dtype)
    runtime = Transformer.from_hf(target.model, dtype)
    draft = load_any_draft(args.draft, target, dtype, "cpu").to(dtype).eval()
    runs = {path: replay(path, runtime, draft, target.tokenizer) for path in args.runs}
    names = [str(path) for path in runs]
    first = next(iter(runs.values()))
    head = "| prompt | " + " | ".join(f"{n}: measured, replayed" for n in names)
    print(head + (" | first (turn, token) unlike the first run's |" if len(runs) > 1 else " |"))
    print("|---" * (len(runs) + 1 + (len(runs) > 1)) + "|")
    for i, row in enumerate(first):
        cells = [f"{r[i]['measured']:.2f}, {r[i]['replayed']:.2f}" for r in runs.values()]
        diffs = [
            str(first_difference(row["tokens"], r[i]["tokens"])) for r in list(runs.values())[1:]
        ]
        print(
            f"| {row['id']} | "
            + " | ".join(cells)
            + (f" | {', '.join(diffs)} |" if diffs else " |")
        )
    for name, rows in runs.items():
        measured = sum(r["measured"] for r in rows) / len(rows)
        replayed = sum(r["replayed"] for r in rows) / len(rows)
        print(f"{name}: mean of prompts, measured {measured:.3f}, replayed {replayed:.3f}")


if __name__ == "__main__":
    main()
