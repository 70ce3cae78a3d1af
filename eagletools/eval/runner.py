"""`eagletools eval` with our decoders: the baseline, the speculative decoder, HF generate.

The three share one target and take each prompt in turn (eval.measure), so a
change in machine load hits them alike. `Settings` is every evaluation's
configuration, the serving engines' (eval.engine_runner) included. Given no
tree shape, a run drafts with the one `eval.tuning.choose_tree` measured
fastest here, or decodes plainly when none beat plain decoding.
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
from eagletools.eval.tuning import (
    FIXED_SHAPE,
    TUNE_GRID,
    TUNE_TOKENS,
    Shape,
    TreeChoice,
    choose_tree,
    shape_label,
    trial_shape,
    tune_questions,
)

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
    topk: int | None = None  # the tree; None in all three: eval.tuning.choose_tree's
    depth: int | None = None
    num_draft_tokens: int | None = None
    tune: bool = True  # False (--no-tune): no shape given drafts FIXED_SHAPE, untimed
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
        given = (self.topk, self.depth, self.num_draft_tokens)
        if any(g is not None for g in given) or self.engine != "ours":
            # a shape given in part keeps the old defaults for the rest; engines draft a
            # chain of --depth, untuned
            self.topk, self.depth, self.num_draft_tokens = (
                f if g is None else g for g, f in zip(given, FIXED_SHAPE, strict=True)
            )

    @property
    def shape(self) -> Shape | None:
        """The tree shape, or None while none is chosen (and once plain decoding was)."""
        if self.topk is None or self.depth is None or self.num_draft_tokens is None:
            return None
        return self.topk, self.depth, self.num_draft_tokens

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
    target: object  # eagletools.targets.Target
    runtime: Transformer
    baseline: BaselineDecoder
    speculative: SpeculativeDecoder | None  # None without a draft, or when plain was faster
    draft: object | None = None  # eagletools.draft.Eagle3Draft
    tree: TreeChoice | None = None  # the speculative decoder's shape and whence it came


def load_decoders(s: Settings) -> Decoders:
    """The target's runtime and plain decoder; with a draft, the speculative decoder in the
    shape `s` gives or, given none, the one `choose_tree` found fastest here."""
    from eagletools.targets import load_target

    if s.threads:
        torch.set_num_threads(s.threads)
    dtype = parse_dtype(s.dtype)
    target = load_target(s.target, dtype=dtype, device=s.device)
    set_chat_template(target.tokenizer, s.chat_template)
    runtime = Transformer.from_hf(target.model, dtype)
    runtime.set_exact(not s.fast_numerics)
    forward = compiled(runtime) if s.compile else runtime
    baseline = BaselineDecoder(runtime, target.tokenizer, forward=forward)
    decoders = Decoders(target, runtime, baseline, None)
    if s.draft:
        decoders.draft = load_any_draft(s.draft, target, dtype, s.device, s.allow_pickle)
        tree = choose_tree(
            s, lambda: autotune(decoders, s, tune_questions(), TUNE_GRID, TUNE_TOKENS)
        )
        if line := tree.line():
            log.info(line)
        use_tree(decoders, s, tree)
    return decoders


def _speculative(decoders: Decoders, shape: Shape, compile: bool) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        decoders.runtime, decoders.draft, decoders.target.tokenizer, *shape, compile=compile
    )


def use_tree(decoders: Decoders, s: Settings, tree: TreeChoice) -> None:
    """Draft in `tree`'s shape from now on, or decode plainly when it has none; a decoder a
    tune timed in that shape is kept (its compiled step is not made again)."""
    decoders.tree = tree
    s.topk, s.depth, s.num_draft_tokens = tree.shape or (None, None, None)
    spec = decoders.speculative
    if tree.shape is None:
        decoders.speculative = None
    elif spec is None or (spec.topk, spec.depth, spec.num_draft_tokens) != tree.shape:
        decoders.speculative = _speculative(decoders, tree.shape, s.compile)


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
        eos = decoders.baseline.session.eos_ids
        out.append(HuggingFace("hf_generate", decoders.target.model, s.max_new_tokens, eos,
                               s.sampling))  # fmt: skip
    return out


def autotune(
    decoders: Decoders,
    s: Settings,
    questions: list[Question],
    grid: tuple[Shape | None, ...] = AUTOTUNE_GRID,
    max_new_tokens: int | None = None,
) -> dict:
    """Time each shape of `grid` (None: plain decoding) on the first turns of `questions`,
    every shape taking each prompt in turn (a change in load hits them alike). The fastest
    becomes `decoders.speculative` (None: plain), the decoder it timed, not a new one."""
    tokenizer = decoders.target.tokenizer
    sample = [Question(q.id, q.category, q.turns[:1]) for q in questions]
    tried = {
        shape: decoders.baseline if shape is None else _speculative(decoders, shape, s.compile)
        for shape in grid
    }
    timed = [
        Decoder(shape_label(shape), decoder, max_new_tokens or s.max_new_tokens, s.sampling,
                torch.Generator(device=s.device).manual_seed(s.seed))
        for shape, decoder in tried.items()
    ]  # fmt: skip
    measured = run_methods([timed], sample, tokenizer, progress=False)
    trials = [_trial(shape, measured.runs[shape_label(shape)]) for shape in grid]
    for trial in trials:
        log.debug("autotune %s", trial)
    best = max(trials, key=lambda t: t["tokens_per_s"])  # the first of equals: plain leads
    chosen = trial_shape(best)
    decoders.speculative = None if chosen is None else tried[chosen]
    return {"prompts": len(sample), "max_new_tokens": max_new_tokens or s.max_new_tokens,
            "trials": trials, "best": best,
            "load_during_timing": measured.machine["load_during_timing"]}  # fmt: skip


def _trial(shape: Shape | None, runs: list[Run]) -> dict:
    """One shape's figures in a tune: tokens/s over its prompts, and tau (plain: 1)."""
    topk, depth, nodes = shape or (None, None, None)
    accepted = [a for r in runs for a in r.accepted or []]
    return {
        "topk": topk, "depth": depth, "num_draft_tokens": nodes,
        "tokens_per_s": sum(r.num_tokens for r in runs) / sum(r.seconds for r in runs),
        "tau": acceptance(accepted, depth)[0] if shape else 1.0,
    }  # fmt: skip


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
        if decoders.draft is None:
            raise UserError("--autotune needs --draft: it searches the speculative tree shape")
        tuned = autotune(decoders, s, questions[: s.autotune_prompts])
        use_tree(decoders, s, TreeChoice(trial_shape(tuned["best"]), "autotune"))
    reserve(decoders, s, questions)
    generator = torch.Generator(device=s.device).manual_seed(s.seed)
    timed = methods(decoders, s, generator)
    tokenizer = decoders.target.tokenizer
    measured = run_methods([timed], questions, tokenizer, progress)
    tree = decoders.tree and decoders.tree.record()
    depth = s.depth or 0  # 0: plain decoding, nothing drafted
    results = build_results(asdict(s), depth, questions, measured, timed, autotune=tuned, tree=tree)
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
