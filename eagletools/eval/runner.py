"""`eagletools eval` with our decoders: the baseline, the speculative decoder, HF generate.

The three share one target and take each prompt in turn (eval.measure), so a
change in machine load hits them alike. `Settings` is every evaluation's
configuration, the serving engines' (eval.engine_runner) included.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import asdict, dataclass

import torch

from eagletools.data.chat import chat_ids, set_chat_template
from eagletools.decode import BaselineDecoder, Sampling, SpeculativeDecoder, Transformer
from eagletools.decode.model import compiled
from eagletools.devices import resolve_device
from eagletools.dtypes import dtype_name, parse_dtype
from eagletools.errors import UserError
from eagletools.eval.benchmarks import Question
from eagletools.eval.measure import Run, build_results, run_methods
from eagletools.eval.methods import Decoder, HuggingFace, Method
from eagletools.eval.metrics import acceptance

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

    @classmethod
    def of(cls, source: object, **fields) -> Settings:
        """Settings from whatever names some of them alike: an argparse namespace, a
        recipe's eval section; `fields` win. The one mapping every caller uses."""
        names = (f.name for f in dataclasses.fields(cls))
        return cls(**({n: getattr(source, n) for n in names if hasattr(source, n)} | fields))


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
        eos = decoders.baseline.eos_ids
        out.append(HuggingFace("hf_generate", decoders.target.model, s.max_new_tokens, eos,
                               s.sampling))  # fmt: skip
    return out


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
        method = Decoder("speculative", decoder, s.max_new_tokens, s.sampling, gen)
        measured = run_methods([[method]], sample, tokenizer, progress=False)
        runs = measured.runs["speculative"]
        tau, _ = acceptance([a for r in runs for a in r.accepted], depth)
        trial = {
            "topk": topk,
            "depth": depth,
            "num_draft_tokens": n,
            "tokens_per_s": sum(r.num_tokens for r in runs) / sum(r.seconds for r in runs),
            "tau": tau,
        }
        log.info("autotune %s", trial)
        trials.append(trial)
        tried.append(decoder)
    i = max(range(len(trials)), key=lambda j: trials[j]["tokens_per_s"])
    best, decoders.speculative = trials[i], tried[i]  # the decoder it timed, not a new one
    s.topk, s.depth, s.num_draft_tokens = best["topk"], best["depth"], best["num_draft_tokens"]
    return {"prompts": len(sample), "trials": trials, "best": best}


def run_eval(
    s: Settings,
    questions: list[Question],
    decoders: Decoders | None = None,
    progress: bool = True,
) -> dict:
    """Every question through every decoder; returns the results dict (see eval.report)."""
    from eagletools.eval import bandwidth

    decoders = decoders or load_decoders(s)
    tuned = None
    if s.autotune:
        if decoders.speculative is None:
            raise UserError("--autotune needs --draft: it searches the speculative tree shape")
        tuned = autotune(decoders, s, questions)
    reserve(decoders, s, questions)
    generator = torch.Generator(device=s.device).manual_seed(s.seed)
    timed = methods(decoders, s, generator)
    tokenizer = decoders.target.tokenizer
    measured = run_methods([timed], questions, tokenizer, progress)
    results = build_results(asdict(s), s.depth, questions, measured, timed, autotune=tuned)
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
    decoders.runtime.reserve(longest + s.num_draft_tokens + 1)
