"""A decoding session: its settings, our decoders and draft loaded, the tree shape chosen.

`generate`, `eval` and the benchmarks load through here, so each runs the same
decoders in the same shape. `Settings` is every evaluation's configuration,
the serving engines' (eval.engine_runner) included. Given no tree shape, a
run drafts with the one `choose_tree` takes from `tuned_shapes.json` in the
eagletools cache, kept under everything it depends on (`tune_key`: the
target, a hash of the draft's files, the machine and threads, dtype,
numerics, sampling, the versions of eagletools and torch), or times now over
plain decoding and the shapes of the draft's kind (`DraftKind.shapes`); plain
decoding when no shape beat it. `--no-tune`
(`eval.tune: false`) drafts FIXED_SHAPE, the default before the tune;
`--autotune` times the same grid on the benchmark's own prompts instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eagletools import cpu_ops, native
from eagletools.data.chat import set_chat_template
from eagletools.decode.engine import BaselineDecoder, SpeculativeDecoder
from eagletools.decode.model import Transformer, compiled
from eagletools.decode.sampling import Sampling
from eagletools.decode.timing import loaded_by_others, machine_key
from eagletools.decode.tuning import (
    DROP_BELOW,
    FIXED_SHAPE,
    MIN_GAIN,
    TUNE_PROMPTS,
    TUNE_ROUNDS,
    TUNE_TOKENS,
    Shape,
    TreeChoice,
    cached_choice,
    draft_identity,
    keep_choice,
    shape_label,
    time_shapes,
    trial_shape,
)
from eagletools.devices import resolve_device
from eagletools.dtypes import dtype_name, parse_dtype
from eagletools.engines import ENGINE_TIMEOUT, OURS
from eagletools.errors import UserError
from eagletools.kinds import kind_of

log = logging.getLogger(__name__)


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
    topk: int | None = None  # the tree; None in all three: choose_tree's
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
    engine: str = OURS  # or a serving engine (eagletools.engines): vllm, llama.cpp
    engine_port: int | None = None  # a free one is chosen when busy or unset
    engine_timeout: float = ENGINE_TIMEOUT  # seconds a server may take to become ready

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype, "--dtype")
        self.device = str(resolve_device(self.device))
        given = (self.topk, self.depth, self.num_draft_tokens)
        if any(g is not None for g in given) or self.engine != OURS:
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
        tune_tree(decoders, s)
    return decoders


def tune_tree(decoders: Decoders, s: Settings, prompts: Sequence[str] | None = None) -> None:
    """Draft from now on in the shape `choose_tree` takes (`prompts`: an --autotune search's),
    a decoder it timed in that shape kept (its compiled step is not made again)."""

    def measure(prompts: Sequence[str], max_new_tokens: int) -> dict:
        def decoder(shape: Shape | None) -> BaselineDecoder | SpeculativeDecoder:
            return decoders.baseline if shape is None else _speculative(decoders, shape, s)

        tune, tried = time_shapes(grid, decoder, prompts, decoders.target.tokenizer,
                                  max_new_tokens, s.sampling, s.seed, s.device)  # fmt: skip
        chosen = trial_shape(tune["best"])
        decoders.speculative = None if chosen is None else tried[chosen]
        return tune

    grid = (None, *kind_of(decoders.draft.config).shapes)
    tree = choose_tree(s, measure, grid, prompts)
    if line := tree.line():
        log.info(line)
    use_tree(decoders, s, tree)


def _speculative(decoders: Decoders, shape: Shape, s: Settings) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        decoders.runtime, decoders.draft, decoders.target.tokenizer, *shape, compile=s.compile
    )


def use_tree(decoders: Decoders, s: Settings, tree: TreeChoice) -> None:
    """Draft in `tree`'s shape from now on, or decode plainly when it has none; a decoder a
    tune timed in that shape is kept."""
    decoders.tree = tree
    s.topk, s.depth, s.num_draft_tokens = tree.shape or (None, None, None)
    spec = decoders.speculative
    if tree.shape is None:
        decoders.speculative = None
    elif spec is None or (spec.topk, spec.depth, spec.num_draft_tokens) != tree.shape:
        decoders.speculative = _speculative(decoders, tree.shape, s)


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


def tune_key(s: Settings, grid: Sequence[Shape | None]) -> dict:
    """Everything the fastest shape depends on (call after the run set its threads)."""
    from eagletools import __version__

    return {
        "target": s.target, "draft": draft_identity(s.draft), "dtype": s.dtype,
        "machine": machine_key(torch.device(s.device)), "compile": s.compile,
        "fast_numerics": s.fast_numerics, "sampling": [s.temperature, s.top_k, s.top_p],
        "eagletools": __version__, "torch": torch.__version__,
        "grid": [shape_label(g) for g in grid], "prompts": len(TUNE_PROMPTS),
        "tokens": TUNE_TOKENS, "rounds": TUNE_ROUNDS, "drop_below": DROP_BELOW,
        "min_gain": MIN_GAIN, "cpu_ops": cpu_ops_key(s.device),
    }  # fmt: skip


def cpu_ops_key(device: str) -> str | None:
    """How a CPU step runs: its products' route (`cpu_ops.product_route`) and our C++
    kernels by their source's hash, or none."""
    if device != "cpu":
        return None
    built = native.source_digest() if native.bf16_linear() else "none"
    return f"products {cpu_ops.product_route()}, kernels {built}"


def choose_tree(
    s: Settings,
    measure: Callable[[Sequence[str], int], dict],
    grid: Sequence[Shape | None],
    prompts: Sequence[str] | None = None,
) -> TreeChoice:
    """The one tree shape choice. With --autotune, `grid` timed by `measure` on `prompts`
    (the benchmark's; before they are known, FIXED_SHAPE untimed). Else the shape `s` gives;
    `--no-tune`: FIXED_SHAPE; else the one tuned for `tune_key(s)`: from the cache, or
    `measure`d now on TUNE_PROMPTS and cached."""
    if s.autotune and prompts is not None:
        tune = measure(prompts, s.max_new_tokens)
        return TreeChoice(trial_shape(tune["best"]), "autotune", tune)
    if s.shape is not None:
        return TreeChoice(s.shape, "given")
    if s.autotune:  # its search over the benchmark replaces this shape before any timing
        return TreeChoice(FIXED_SHAPE, "autotune")
    if not s.tune:
        return TreeChoice(FIXED_SHAPE, "fixed")
    key = tune_key(s, grid)
    if (hit := cached_choice(key)) is not None:
        return hit
    start = time.perf_counter()
    tune = measure(TUNE_PROMPTS, TUNE_TOKENS)
    tune["seconds"] = round(time.perf_counter() - start, 1)
    chosen = trial_shape(tune["best"])
    if loaded_by_others(tune["load_during_timing"], os.cpu_count()):
        # a choice timed beside other work would stay wrong for every later run: not kept
        log.warning("other processes kept %s CPUs busy during the tree shape tune: its "
                    "choice serves this run only, and the next run tunes again",
                    tune["load_during_timing"]["others"])  # fmt: skip
        return TreeChoice(chosen, "tuned", tune)
    keep_choice(key, chosen, tune)
    return TreeChoice(chosen, "tuned", tune)
