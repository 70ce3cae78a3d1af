"""Run a benchmark through the baseline and the speculative decoder, prompt by prompt.

Both decoders share one runtime and run back to back on each prompt, so a
change in machine load hits both; per-prompt ratios are what EAGLE reports.
Multi-turn questions feed each decoder its own earlier answers (with greedy
decoding they are the same), through the target's chat template.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from eagletools.data.chat import chat_ids, set_chat_template
from eagletools.decode import BaselineDecoder, Result, Sampling, SpeculativeDecoder, Transformer
from eagletools.decode.model import compiled
from eagletools.devices import resolve_device
from eagletools.dtypes import dtype_name, parse_dtype
from eagletools.errors import UserError
from eagletools.eval.benchmarks import Question

log = logging.getLogger(__name__)

# (topk, depth, num_draft_tokens) shapes --autotune times: chains and small-to-large trees,
# the small ones for where drafting costs much beside a verify (on CPUs: issue 16)
# and for compiled CPU steps, where 5 or more rows verify at well over one row's cost
AUTOTUNE_GRID = (
    (1, 1, 2),
    (1, 2, 3),
    (1, 3, 4),
    (1, 5, 6),
    (2, 3, 6),
    (2, 4, 8),
    (3, 3, 8),
    (4, 3, 8),
    (4, 4, 8),
    (4, 4, 12),
    (4, 5, 16),
    (8, 5, 24),
    (8, 6, 32),
)


@dataclass
class Settings:
    target: str = "smollm2-135m"
    draft: str | None = None  # a checkpoint, "random[:SEED]", or None (baseline only)
    bench: str = "mt-bench"
    num_prompts: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    topk: int = 4
    depth: int = 5
    num_draft_tokens: int = 16
    hf_baseline: bool = False
    dtype: str = "bfloat16"
    seed: int = 0
    threads: int | None = None
    autotune: bool = False
    autotune_prompts: int = 3
    allow_pickle: bool = False
    device: str = "auto"  # resolved on construction: auto is CUDA where torch sees it, else CPU
    chat_template: str | None = None  # a Jinja file or text, for tokenizers without one
    fast_numerics: bool = False  # fp32 attention reductions (Transformer.set_exact(False))
    compile: bool = False  # decoding steps by inductor (`compiled`, the speculative step whole)
    engine: str = "ours"  # or a serving engine (eagletools.engines): vllm, llama.cpp
    engine_port: int | None = None  # a free one is chosen when busy or unset
    engine_timeout: float = 900.0  # seconds a server may take to become ready

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype, "--dtype")
        self.device = str(resolve_device(self.device))

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)


@dataclass
class Decoders:
    target: object  # eagletools.target.Target
    runtime: Transformer
    baseline: BaselineDecoder
    speculative: SpeculativeDecoder | None


def load_decoders(s: Settings) -> Decoders:
    from eagletools.target import load_target

    if s.threads:
        torch.set_num_threads(s.threads)
    dtype = parse_dtype(s.dtype)
    target = load_target(s.target, dtype=dtype, device=s.device)
    set_chat_template(target.tokenizer, s.chat_template)
    runtime = Transformer.from_hf(target.model, dtype)
    runtime.set_exact(not s.fast_numerics)
    forward = compiled(runtime) if s.compile else runtime
    baseline = BaselineDecoder(runtime, target.tokenizer, forward=forward)
    spec = None
    if s.draft:
        draft = load_any_draft(s.draft, target, dtype, s.device, s.allow_pickle)
        spec = SpeculativeDecoder(
            runtime, draft, target.tokenizer, s.topk, s.depth, s.num_draft_tokens,
            compile=s.compile,
        )  # fmt: skip
    return Decoders(target, runtime, baseline, spec)


def load_any_draft(spec: str, target, dtype, device, allow_pickle: bool = False):
    """A checkpoint folder, or `random[:SEED]`: an untrained head sized for the target."""
    if spec == "random" or spec.startswith("random:"):
        from eagletools.draft import Eagle3Draft

        seed = spec.partition(":")[2]
        if seed and not seed.isdigit():
            raise UserError(f"--draft {spec}: the seed after 'random:' must be an integer")
        torch.manual_seed(int(seed or 0))
        return Eagle3Draft.from_target(target.model).to(device=device, dtype=dtype).eval()
    from eagletools.formats import load_draft

    return load_draft(spec, target=target, dtype=dtype, device=device, allow_pickle=allow_pickle)


def converse(
    generate: Callable[[list[int]], tuple[list[int], float, list[int]]],
    tokenizer,
    turns: Sequence[str],
) -> list[tuple[list[int], float, list[int]]]:
    """Each user turn in order; the reply (text of the generated tokens) joins the history."""
    messages, out = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        tokens, seconds, accepted = generate(chat_ids(tokenizer, messages))
        out.append((tokens, seconds, accepted))
        reply = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
    return out


def _ours(decoder, s: Settings, generator: torch.Generator):
    decoder.reset()  # each question starts cold, as HF generate does; its turns reuse the cache

    def generate(ids):
        r: Result = decoder.generate(ids, s.max_new_tokens, s.sampling, generator=generator)
        return r.tokens, r.seconds, r.accepted

    return generate


def hf_generate(
    model, max_new_tokens: int, eos: set[int], sampling: Sampling | None = None, **kwargs
) -> Callable[[list[int]], tuple[list[int], float, list[int]]]:
    """Hugging Face `generate` as a timed ids -> (new tokens, seconds, []) function.

    Extra `kwargs` go to `generate` (prompt lookup, an assistant model, ...).
    """
    sampling = sampling or Sampling()
    if sampling.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p,
        )  # fmt: skip

    @torch.inference_mode()
    def generate(ids):
        x = torch.tensor([ids], device=model.device)
        start = time.perf_counter()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos),
            pad_token_id=sorted(eos)[0],
            **kwargs,
        )
        return out[0, len(ids) :].tolist(), time.perf_counter() - start, []

    return generate


@dataclass
class Run:
    tokens: list[list[int]]  # per turn
    seconds: float
    accepted: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def record(self) -> dict:
        return {
            "new_tokens": self.num_tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": self.num_tokens / self.seconds if self.seconds else 0.0,
        }


def _run(generate, tokenizer, question: Question) -> Run:
    turns = converse(generate, tokenizer, question.turns)
    return Run(
        [t for t, _, _ in turns],
        sum(sec for _, sec, _ in turns),
        [a for _, _, acc in turns for a in acc],
    )


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(turn, token index) where two outputs first differ, or None."""
    for turn, (x, y) in enumerate(zip(a, b, strict=True)):
        for i in range(max(len(x), len(y))):
            if i >= len(x) or i >= len(y) or x[i] != y[i]:
                return turn, i
    return None


def _logit_gap(target, question: Question, runs: tuple[Run, Run], where) -> dict:
    """At a divergence from HF: the target's top-2 logit gap there (a near tie = rounding)."""
    turn, index = where
    tokenizer = target.tokenizer
    messages = []
    for t in range(turn):
        reply = tokenizer.decode(runs[0].tokens[t], skip_special_tokens=True).strip()
        messages += [{"role": "user", "content": question.turns[t]}]
        messages += [{"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": question.turns[turn]})
    ids = chat_ids(tokenizer, messages) + runs[0].tokens[turn][:index]
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids], device=target.model.device)).logits[0, -1]
    top = logits.float().topk(2)
    ours, theirs = runs[0].tokens[turn], runs[1].tokens[turn]
    return {
        "turn": turn,
        "index": index,
        "ours": ours[index] if index < len(ours) else None,
        "hf": theirs[index] if index < len(theirs) else None,
        "top2_logit_gap": float(top.values[0] - top.values[1]),
    }


def evaluate_question(
    decoders: Decoders, s: Settings, question: Question, generator: torch.Generator
) -> dict:
    tokenizer = decoders.target.tokenizer
    base = _run(_ours(decoders.baseline, s, generator), tokenizer, question)
    record = {
        "id": question.id,
        "category": question.category,
        "turns": len(question.turns),
        "baseline": base.record(),
    }
    if decoders.speculative is not None:
        spec = _run(_ours(decoders.speculative, s, generator), tokenizer, question)
        record["speculative"] = spec.record() | {"accepted": spec.accepted}
        if s.sampling.greedy:
            diff = first_difference(spec.tokens, base.tokens)
            record["greedy_match"] = diff is None
            if diff is not None:
                record["baseline_difference"] = {"turn": diff[0], "index": diff[1]}
    if s.hf_baseline:
        hf_run = hf_generate(
            decoders.target.model, s.max_new_tokens, decoders.baseline.eos_ids, s.sampling
        )
        hf = _run(hf_run, tokenizer, question)
        record["hf_generate"] = hf.record()
        if s.sampling.greedy:
            diff = first_difference(base.tokens, hf.tokens)
            record["hf_match"] = diff is None
            if diff is not None:
                record["hf_difference"] = _logit_gap(decoders.target, question, (base, hf), diff)
    return record


def autotune(decoders: Decoders, s: Settings, questions: list[Question]) -> dict:
    """Time each tree shape of the grid on a few first turns; pick the best tokens/s."""
    assert decoders.speculative is not None
    spec = decoders.speculative
    draft, tokenizer = spec.draft, decoders.target.tokenizer
    sample = [Question(q.id, q.category, q.turns[:1]) for q in questions[: s.autotune_prompts]]
    trials, tried = [], []
    for topk, depth, n in AUTOTUNE_GRID:
        decoder = SpeculativeDecoder(
            decoders.runtime, draft, tokenizer, topk, depth, n, compile=spec.compiled
        )  # fmt: skip
        gen = torch.Generator(device=s.device).manual_seed(s.seed)
        runs = [_run(_ours(decoder, s, gen), tokenizer, q) for q in sample]
        tokens = sum(r.num_tokens for r in runs)
        seconds = sum(r.seconds for r in runs)
        steps = sum(len(r.accepted) for r in runs)
        trial = {
            "topk": topk,
            "depth": depth,
            "num_draft_tokens": n,
            "tokens_per_s": tokens / seconds,
            "tau": 1 + sum(sum(r.accepted) for r in runs) / max(steps, 1),
        }
        log.info("autotune %s", trial)
        trials.append(trial)
        tried.append(decoder)
    i = max(range(len(trials)), key=lambda j: trials[j]["tokens_per_s"])
    best, decoders.speculative = trials[i], tried[i]  # the decoder it timed, not a new one
    s.topk, s.depth, s.num_draft_tokens = best["topk"], best["depth"], best["num_draft_tokens"]
    return {"prompts": len(sample), "trials": trials, "best": best}


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def run_eval(
    s: Settings,
    questions: list[Question],
    decoders: Decoders | None = None,
    progress: bool = True,
) -> dict:
    """Every question through every decoder; returns the results dict (see eval.report)."""
    from tqdm.auto import tqdm

    from eagletools.eval import bandwidth
    from eagletools.eval.metrics import summarize

    decoders = decoders or load_decoders(s)
    at_start = machine()
    tuned = None
    if s.autotune:
        if decoders.speculative is None:
            raise UserError("--autotune needs --draft: it searches the speculative tree shape")
        tuned = autotune(decoders, s, questions)
    _warm_up(decoders, s, questions)
    generator = torch.Generator(device=s.device).manual_seed(s.seed)
    records = []
    for question in tqdm(questions, desc="eval", unit="prompt", disable=not progress):
        records.append(evaluate_question(decoders, s, question, generator))
    summary = summarize(records, s.depth)
    return {
        "settings": asdict(s),
        # other jobs on a shared machine skew timings: the load average says how much
        "machine": at_start | {"load_average_at_end": machine()["load_average_at_start"]},
        "summary": summary,
        "bandwidth": bandwidth.achieved(decoders.runtime, summary["tokens_per_s"], s.device),
        "autotune": tuned,
        "per_prompt": records,
    }


def _warm_up(decoders: Decoders, s: Settings, questions: list[Question]) -> None:
    """A KV cache for the longest conversation, then one short run each, so neither
    allocation nor compilation is timed: a compiled step (`--compile`) and a captured
    CUDA graph are made again for every cache allocation."""
    tokenizer = decoders.target.tokenizer
    longest = max(
        len(chat_ids(tokenizer, [{"role": "user", "content": t} for t in q.turns]))
        + len(q.turns) * (s.max_new_tokens + 16)  # each reply and its template
        for q in questions
    )
    decoders.runtime.reserve(longest + s.num_draft_tokens + 1)
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    for decoder in (decoders.baseline, decoders.speculative):
        if decoder is not None:
            decoder.generate(ids, 8, s.sampling)
            decoder.reset()
