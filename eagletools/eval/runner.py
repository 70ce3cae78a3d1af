"""The runner of `eagletools eval`: one benchmark in our decoders or in a serving engine.

`evaluate` is the one dispatch `eval` and the pipeline share. Ours: the
baseline, the speculative decoder and HF generate share one target and take
each prompt in turn (decode.timing), so a change in machine load hits them
alike; the decoders and their tree shape come from decode.session. Engines:
eval.engine_runner.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from eagletools.data.chat import chat_ids
from eagletools.decode.session import Decoders, Settings, load_decoders, tune_tree
from eagletools.decode.timing import Decoder, Method, Run, run_methods
from eagletools.engines import OURS
from eagletools.errors import UserError
from eagletools.eval.measure import build_results
from eagletools.eval.methods import HuggingFace
from eagletools.eval.questions import Question


def evaluate(
    s: Settings, questions: list[Question], out: str | Path, progress: bool = True
) -> tuple[dict, list[Path]]:
    """Every question through our decoders or the engine `s.engine`; writes the report to
    `out` (an engine's server logs too). Returns the results and the files written."""
    from eagletools.eval.report import write_report

    if s.engine == OURS:
        results = run_eval(s, questions, progress=progress)
    else:
        from eagletools.eval.engine_runner import run_engine_eval
        from eagletools.formats.engines import check_draft_on_disk

        if s.autotune or s.hf_baseline:
            raise UserError("--autotune and --hf-baseline go with --engine ours")
        if s.draft:
            check_draft_on_disk(s.draft, s.engine, s.target)
        results = run_engine_eval(s, questions, out, progress)
    return results, write_report(results, out)


def _logit_gap(target, question: Question, ours: Run, hf: Run, where: dict) -> dict:
    """At a divergence from HF: the target's top-2 logit gap there (a near tie = rounding)."""
    turn, index = where["turn"], where["index"]
    tokenizer = target.tokenizer
    messages = []
    for t in range(turn):
        reply = tokenizer.decode(ours.tokens[t], skip_special_tokens=True).strip()
        messages += [{"role": "user", "content": question.turns[t]}]
        messages += [{"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": question.turns[turn]})
    ids = chat_ids(tokenizer, messages) + ours.tokens[turn][:index]
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids], device=target.model.device)).logits[0, -1]
    top = logits.float().topk(2)
    mine, theirs = ours.tokens[turn], hf.tokens[turn]
    return {
        "turn": turn,
        "index": index,
        "ours": mine[index] if index < len(mine) else None,
        "hf": theirs[index] if index < len(theirs) else None,
        "top2_logit_gap": float(top.values[0] - top.values[1]),
    }


def methods(decoders: Decoders, s: Settings, generator: torch.Generator) -> list[Method]:
    """Our baseline, our speculative decoder and HF generate, as `s` asks. With greedy
    decoding the speculative decoder must equal the baseline, and the baseline HF."""
    greedy = s.sampling.greedy
    out: list[Method] = [
        Decoder("baseline", decoders.baseline, s.max_new_tokens, s.sampling, generator,
                reference="hf_generate" if s.hf_baseline and greedy else None),
    ]  # fmt: skip
    if decoders.speculative is not None:
        out.append(
            Decoder("speculative", decoders.speculative, s.max_new_tokens, s.sampling, generator,
                    reference="baseline" if greedy else None)
        )  # fmt: skip
    if s.hf_baseline:
        eos = decoders.baseline.session.eos_ids
        out.append(HuggingFace("hf_generate", decoders.target.model, s.max_new_tokens, eos,
                               s.sampling))  # fmt: skip
    return out


def run_eval(
    s: Settings,
    questions: list[Question],
    decoders: Decoders | None = None,
    progress: bool = True,
) -> dict:
    """Every question through every decoder; returns the results dict (see eval.report)."""
    from eagletools.eval import bandwidth

    decoders = decoders or load_decoders(s)
    if s.autotune:
        if decoders.draft is None:
            raise UserError("--autotune needs --draft: it searches the speculative tree shape")
        tune_tree(decoders, s, [q.turns[0] for q in questions[: s.autotune_prompts]])
    reserve(decoders, s, questions)
    generator = torch.Generator(device=s.device).manual_seed(s.seed)
    timed = methods(decoders, s, generator)
    tokenizer = decoders.target.tokenizer
    measured = run_methods([timed], [q.turns for q in questions], tokenizer, progress)
    tree = decoders.tree
    tuned = tree.tune if tree and tree.source == "autotune" else None
    depth = s.depth or 0  # 0: plain decoding, nothing drafted
    results = build_results(asdict(s), depth, questions, measured, timed, autotune=tuned,
                            tree=tree and tree.record())  # fmt: skip
    for q, r, ours, hf in zip(questions, results["per_prompt"], measured.runs["baseline"],
                              measured.runs.get("hf_generate", []), strict=False):  # fmt: skip
        if "hf_difference" in r:
            r["hf_difference"] = _logit_gap(decoders.target, q, ours, hf, r["hf_difference"])
    tps = results["summary"]["tokens_per_s"]
    results["bandwidth"] = bandwidth.achieved(decoders.runtime, tps, s.device)
    return results


def reserve(decoders: Decoders, s: Settings, questions: list[Question]) -> None:
    """A KV cache for the longest conversation, so no allocation is timed: a compiled step
    (`--compile`) and a captured CUDA graph are made again for every cache allocation."""
    tokenizer = decoders.target.tokenizer
    longest = max(
        len(chat_ids(tokenizer, [{"role": "user", "content": t} for t in q.turns]))
        + len(q.turns) * (s.max_new_tokens + 16)  # each reply and its template
        for q in questions
    )
    decoders.runtime.reserve(longest + (s.num_draft_tokens or 0) + 1)
