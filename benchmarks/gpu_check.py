"""One prepared check of eagletools on a GPU: kernels, decoding, training, FSDP checkpoints.

Made for a machine lent for minutes, maybe without network: everything runs
on random weights with real models' shapes (no downloads), each section is
timed and guarded on its own, every row is printed as it finishes, and the
results are rewritten to OUT/gpu_check.json and OUT/gpu_check.md after each
section, so a run cut short still leaves what it measured.

Sections (`--sections`, comma-separated; default all, in this order):
  env      GPU, versions, device copy bandwidth (the floor for memory-bound
           kernels) and bf16 matmul TFLOP/s
  kernels  each Triton kernel against its PyTorch reference on the kernel tests'
           inputs (eagletools.kernels.cases) at Llama-3.1-8B shapes (32/8 heads x
           128, prefix 2048, trees of 16/32/64, vocab 128256, draft vocab 32000),
           outputs poisoned first; error, times, GB/s against the floor
  decode   plain and speculative tokens/s of eagletools' decoder on a random
           SmolLM2-135M-shaped target with a random draft (tau ~ 1), greedy
           speculative output == plain output (bf16 and fp32), the speculative
           step with and without CUDA graphs; one forward of an 8B-shaped target
           cut to a few layers (weight GB/s)
  train    the trainer's own step (`Trainer.train_step` as recipes/llama3.1-8b.yaml
           sets it up: AdamW, its grad clip, bf16) of a Llama-3.1-8B-sized draft,
           the target (cut to 4 layers) in the loop, at batch 1 and 8 x 2048
           tokens: tokens/s, peak memory
  fsdp     1-process FSDP2 (`fully_shard`) save with the trainer's checkpoint
           writer, resume into a fresh model: identical state and next losses

    PYTHONPATH=. timeout 420 python3 benchmarks/gpu_check.py --out $OUT
    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc

On CPU the shapes are tiny and the Triton kernels run in the Triton
interpreter: that run checks the script, not the machine
(tests/test_gpu_check.py). What is not here, and why: HF `generate` and
MT-bench prompts (benchmarks/decode_speed.py) need the real checkpoint and its
tokenizer; the random target decodes token ids with no tokenizer at all.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import faulthandler
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file without PYTHONPATH: eagletools from this checkout
    sys.path.insert(0, str(ROOT))

from eagletools.kernels import cases  # noqa: E402  (after the checkout is on the path)

SECTIONS = ("env", "kernels", "decode", "train", "fsdp")

# Target shapes (LlamaConfig fields). Random weights: the timings depend only on shapes.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip
LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
LLAMA31_8B_CUT = dict(LLAMA31_8B, num_hidden_layers=4)  # its layers' and head's widths, fast
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What each section runs: real shapes on a GPU, tiny ones on CPU."""

    shape: cases.Shape  # kernels: the target's heads, head_dim and vocab
    prefix: int  # kernels: cached tokens before the tree
    tree_sizes: tuple[int, ...]  # kernels: tree nodes N
    topk_rows: tuple[int, ...]  # kernels: rows of draft logits per top-k call
    draft_vocab: int
    target: dict  # decode: the target's shapes
    prompt_len: int
    new_tokens: int
    tree: tuple[int, int, int]  # decode: topk, depth, num_draft_tokens
    big_target: dict | None  # decode: an 8B-shaped target with few layers (None: skip)
    train_target: dict  # train: the target whose draft is trained (in the loop)
    seq_len: int
    batches: tuple[int, ...]
    train_steps: int  # timed steps per batch size (after one warm-up step)
    fsdp_target: dict
    fsdp_seq_len: int


def make_plan(device: torch.device, quick: bool) -> Plan:
    if device.type == "cpu":
        return Plan(
            shape=cases.Shape("tiny", 4, 2, 16, 1000, 4, 8), prefix=24, tree_sizes=(8,),
            topk_rows=(2,), draft_vocab=300, target=TINY, prompt_len=8, new_tokens=8, tree=(2, 3, 6),
            big_target=dict(TINY, num_hidden_layers=2), train_target=TINY, seq_len=32, batches=(1, 2), train_steps=1,
            fsdp_target=TINY, fsdp_seq_len=16,
        )  # fmt: skip
    return Plan(
        shape=cases.LLAMA_8B, prefix=2048, tree_sizes=(64,) if quick else (16, 32, 64),
        topk_rows=(1, 8), draft_vocab=cases.DRAFT_VOCAB, target=SMOLLM2_135M,
        prompt_len=32, new_tokens=64 if quick else 128, tree=(4, 5, 16),
        big_target=LLAMA31_8B_CUT, train_target=LLAMA31_8B_CUT,
        seq_len=2048, batches=(1, 8), train_steps=1 if quick else 2,
        fsdp_target=SMOLLM2_135M, fsdp_seq_len=512,
    )  # fmt: skip


# -- results: printed as they come, saved after every section --------------------------


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    return str(value)


@dataclass
class Section:
    name: str
    columns: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    status: str = "not run"  # ok | failed | skipped | not run
    reason: str = ""
    seconds: float = 0.0


class Report:
    """The tables: each row printed (flushed) when added; json + md rewritten per section."""

    def __init__(self, out: Path, meta: dict[str, Any]):
        self.out, self.meta = out, meta
        self.sections: dict[str, Section] = {}
        self.current: Section | None = None

    def begin(self, name: str) -> Section:
        self.current = self.sections[name] = Section(name)
        print(f"\n## {name}", flush=True)
        return self.current

    def columns(self, *names: str) -> None:
        """Declare the current section's table and print its header."""
        self.current.columns = list(names)
        print(" | ".join(f"{c:<{self._width(c)}}" for c in names), flush=True)

    def row(self, **values: Any) -> None:
        section = self.current
        section.rows.append(values)
        cells = [self._cell(values.get(c), self._width(c)) for c in section.columns]
        extra = [f"{k}={fmt(v)}" for k, v in values.items()
                 if k not in section.columns and v is not None]  # fmt: skip
        print(" | ".join(cells + extra), flush=True)

    @staticmethod
    def _width(column: str) -> int:
        return max(len(column), 9)

    @staticmethod
    def _cell(value: Any, width: int) -> str:
        text = fmt(value)  # numbers to the right, words to the left
        return f"{text:>{width}}" if isinstance(value, int | float) else f"{text:<{width}}"

    def end(self, status: str, reason: str, seconds: float) -> None:
        section = self.current
        section.status, section.reason, section.seconds = status, reason, seconds
        why = f": {reason}" if reason else ""
        print(f"-- {section.name}: {status} in {seconds:.1f} s{why}", flush=True)
        self.save()

    def save(self) -> None:
        from eagletools.atomic import write_text

        self.out.mkdir(parents=True, exist_ok=True)
        data = {"meta": self.meta, "sections": {n: vars(s) for n, s in self.sections.items()}}
        write_text(self.out / "gpu_check.json", json.dumps(data, indent=1, default=str) + "\n")
        write_text(self.out / "gpu_check.md", self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = [
            "# eagletools GPU check",
            "",
            f"{m['date']} on {m['device_name']} ({m['host']}); torch {m['torch']}, "
            f"triton {m['triton']}, transformers {m['transformers']}; "
            f"`{' '.join(m['argv'])}`",
        ]
        for s in self.sections.values():
            why = f": {s.reason}" if s.reason else ""
            lines += ["", f"## {s.name} ({s.status}, {s.seconds:.1f} s{why})", ""]
            if s.columns and s.rows:
                lines.append("| " + " | ".join(s.columns) + " |")
                lines.append("|" + "---|" * len(s.columns))
                for r in s.rows:
                    lines.append("| " + " | ".join(fmt(r.get(c)) for c in s.columns) + " |")
        return "\n".join(lines) + "\n"


@dataclass
class Context:
    device: torch.device
    plan: Plan
    deadline: float  # time.perf_counter() after which nothing new starts
    _bandwidth: float | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def bandwidth(self) -> float:
        """Device copy bandwidth, bytes/s (read + write), measured once."""
        if self._bandwidth is None:
            self._bandwidth = cases.copy_bandwidth(self.device)
        return self._bandwidth

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def time_ms(fn: Callable[[], object], ctx: Context) -> float:
    """Median milliseconds of `fn`: `triton.testing.do_bench` on a GPU (L2 flushed between
    runs), a few wall-clock runs on CPU."""
    if ctx.cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# -- 1. environment ---------------------------------------------------------------------


def section_env(ctx: Context, report: Report) -> None:
    report.columns("item", "value")
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        report.row(item="device", value=props.name)
        report.row(item="compute capability", value=f"{props.major}.{props.minor}")
        report.row(item="memory GiB", value=props.total_memory / 2**30)
        report.row(item="SMs", value=props.multi_processor_count)
        report.row(item="CUDA (torch)", value=torch.version.cuda)
    else:
        report.row(item="device", value=f"cpu ({os.cpu_count()} cores)")
    report.row(item="copy GB/s (floor)", value=ctx.bandwidth() / 1e9)
    n = 8192 if ctx.cuda else 256
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = time_ms(lambda: a @ b, ctx)
    report.row(item=f"bf16 matmul {n}^3 TFLOP/s", value=2 * n**3 / (ms * 1e-3) / 1e12)


# -- 2. kernels -------------------------------------------------------------------------


@dataclass
class KernelCase:
    kernel: str
    shape: str
    triton: Callable[[], object]  # the kernel as the decoder launches it (timed)
    reference: Callable[[], object]  # its PyTorch reference (timed)
    error: Callable[[], float]  # max abs error of a run with poisoned outputs
    bytes_moved: int  # the least the kernel must read and write
    tol: float


def max_error(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    """Largest |got - want| over all outputs; NaN (an unwritten element) counts as inf."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        diff = (g.double() - w.double()).abs().nan_to_num(float("inf"))
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst


def checked(
    case: cases.Case, tol: float = 0.0, error: Callable[[], float] | None = None
) -> KernelCase:
    """A case of `eagletools.kernels.cases` with its check: by default the kernel writes
    into poisoned outputs (a slot it forgets keeps its poison) and must match its
    reference within `tol`."""
    triton_fn, reference_fn = cases.triton_and_reference(case.kernel)
    args = case.args

    def poisoned_error() -> float:
        want = reference_fn(*args)
        if isinstance(want, torch.Tensor):  # tree attention: one output
            return max_error((triton_fn(*args, out=cases.poisoned(want)[0]),), (want,))
        return max_error(triton_fn(*args, out=cases.poisoned(*want)), want)

    return KernelCase(
        case.kernel, case.shape, lambda: triton_fn(*args), lambda: reference_fn(*args),
        error or poisoned_error, case.bytes_moved, tol,
    )  # fmt: skip


def kernel_cases(ctx: Context) -> list[KernelCase]:
    """Every kernel at the plan's sizes, from the cases the kernel tests draw too."""
    p, dev, shape = ctx.plan, ctx.device, ctx.plan.shape
    attention = [cases.attention_case(1, n, p.prefix, dev, shape) for n in p.tree_sizes]
    # as a CUDA graph replays it: the prefix length read on the device
    q, k, v, prefix, mask, scale = attention[-1].args
    on_device = (q, k, v, torch.tensor(prefix, device=dev), mask, scale)
    attention.append(replace(attention[-1], shape=attention[-1].shape + " (device tensor)",
                             args=on_device))  # fmt: skip
    k_top, accepted = (8, 8) if ctx.cuda else (4, 3)
    topk = [cases.topk_case(m, k_top, dev, p.draft_vocab, shape.vocab) for m in p.topk_rows]
    compact = cases.compact_case(1, accepted, max(p.tree_sizes), p.prefix, dev, shape)
    return [
        *(checked(c, 2e-2) for c in attention),  # bf16
        *(checked(cases.greedy_case(1, n, shape.vocab, dev)) for n in p.tree_sizes),
        *(checked(c, 1e-4, partial(topk_error, c.args)) for c in topk),
        checked(compact, error=partial(compact_error, *compact.args)),
        *(checked(cases.sampling_case(1, n, shape.vocab, dev)) for n in p.tree_sizes),
    ]


def topk_error(args: tuple) -> float:
    """Log-prob error, or inf when the kernel's ids do not pick logits equal to the reference's.

    Random bf16 logits tie often, and tied entries may come in either order, so
    the ids are compared by the logit values they select.
    """
    from eagletools.kernels import draft_topk

    logits, d2t, _ = args
    selected = torch.arange(len(d2t), device=d2t.device) + d2t  # the draft's target ids
    want = draft_topk.topk_d2t_reference(*args)
    got = draft_topk.topk_d2t_triton(*args, out=cases.poisoned(*want))
    err = max_error(got[:1], want[:1])
    picked = []
    for ids in (got[1], want[1]):
        draft_ids = torch.searchsorted(selected, ids.clamp(min=0)).clamp(max=len(selected) - 1)
        if not torch.equal(selected[draft_ids], ids):
            return float("inf")  # not a draft-vocab id: unwritten or wrongly mapped
        picked.append(logits.gather(1, draft_ids).float())
    return max(err, max_error(picked[:1], picked[1:]))


def compact_error(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: int) -> float:
    """The kernel and the reference on copies of one cache. Every destination slot starts
    with other random data, so a skipped copy shows."""
    from eagletools.kernels import kv_compact

    want = k.clone(), v.clone()
    kv_compact.compact_kv_reference(*want, src, dst)
    got = k.clone(), v.clone()
    kv_compact.compact_kv_triton(*got, src, dst)
    return max_error(got, want)


def section_kernels(ctx: Context, report: Report) -> None:
    report.columns("kernel", "shape", "ok", "max err", "kernel us", "ref us", "ref/kernel",
                   "MB moved", "GB/s", "% copy bw", "note")  # fmt: skip
    bandwidth = ctx.bandwidth()
    for case in kernel_cases(ctx):
        if ctx.time_left() < 0:
            report.row(kernel=case.kernel, shape=case.shape, note="skipped: out of time")
            continue
        row = dict(kernel=case.kernel, shape=case.shape)
        try:
            err = case.error()
            row.update({"ok": err <= case.tol, "max err": err})
            t_kernel, t_ref = time_ms(case.triton, ctx) * 1e3, time_ms(case.reference, ctx) * 1e3
        except Exception as exc:  # one case failing leaves the others to run
            row.update(ok=False, note=f"{type(exc).__name__}: {exc}"[:300])
            report.row(**row)
            continue
        achieved = case.bytes_moved / (t_kernel * 1e-6)
        row.update({"kernel us": t_kernel, "ref us": t_ref, "ref/kernel": t_ref / t_kernel,
                    "MB moved": case.bytes_moved / 1e6, "GB/s": achieved / 1e9,
                    "% copy bw": 100 * achieved / bandwidth})  # fmt: skip
        report.row(**row)
    if any(r.get("ok") is False for r in report.current.rows):
        raise RuntimeError("a kernel disagrees with its reference (see the rows above)")


# -- 3. decode --------------------------------------------------------------------------


def random_target(fields: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A randomly initialised HF LlamaForCausalLM with these shapes, made on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**fields))
    return model.to(dtype).eval()


def section_decode(ctx: Context, report: Report) -> None:
    """The decoders' speed and equality, then the 8B-shaped forward, each on its own."""
    report.columns("run", "dtype", "tokens", "tok/s", "ms/step", "tau", "same as plain",
                   "GB/s", "% copy bw", "note")  # fmt: skip
    failed = []
    for part in (decoder_speed, big_forward):
        if part is big_forward and (not ctx.plan.big_target or ctx.time_left() < 30):
            continue
        try:
            part(ctx, report)
        except Exception as exc:
            traceback.print_exc()
            failed.append(f"{part.__name__}: {type(exc).__name__}: {exc}")
            if ctx.cuda:
                torch.cuda.empty_cache()
    if failed:
        raise RuntimeError("; ".join(failed))


def decoder_speed(ctx: Context, report: Report) -> None:
    """Plain and speculative decoding in bf16 and fp32, one prompt, greedy."""
    from eagletools.decode import BaselineDecoder, SpeculativeDecoder, Transformer
    from eagletools.draft import Eagle3Draft
    from eagletools.eval.measure import first_difference
    from eagletools.kernels import use_triton
    from eagletools.vocab import DraftVocab

    p, dev = ctx.plan, ctx.device
    topk, depth, n_draft = p.tree
    hf = random_target(p.target, dev, torch.bfloat16)
    v, vd = p.target["vocab_size"], min(p.draft_vocab, p.target["vocab_size"])
    gen = torch.Generator().manual_seed(1)
    vocab = DraftVocab.from_selected(torch.randperm(v, generator=gen)[:vd], v)
    draft = Eagle3Draft.from_target(hf, vocab).to(dev)
    prompt = torch.randint(0, v, (p.prompt_len,), generator=gen).tolist()
    max_len = p.prompt_len + p.new_tokens + 2 * n_draft + 8
    name = "135M-shaped" if ctx.cuda else "tiny"
    kernel_kind = "Triton" if use_triton(torch.empty(0, device=dev)) else "reference"
    for dtype in (torch.bfloat16, torch.float32):
        runtime = Transformer.from_hf(hf, dtype=dtype)
        plain = BaselineDecoder(runtime, None, max_seq_len=max_len)  # no tokenizer: ids only
        decoders = [("plain", plain, "")]
        # on CUDA the step's verify forward and draft refresh replay CUDA graphs; beside
        # them the same decoder eager, so the table shows what the graphs save
        for graphs in (True, False) if ctx.cuda else (True,):
            spec = SpeculativeDecoder(runtime, copy.deepcopy(draft), None, topk, depth, n_draft,
                                      max_seq_len=max_len, cuda_graphs=graphs)  # fmt: skip
            how = ("; CUDA graphs" if graphs else "; eager") if ctx.cuda else ""
            decoders.append((f"speculative (tree {topk}/{depth}/{n_draft})", spec, how))
        results = {}
        for label, decoder, how in decoders:
            decoder.generate(prompt, max_new_tokens=min(16, p.new_tokens))  # allocate, capture
            decoder.reset()
            results[label] = r = decoder.generate(prompt, max_new_tokens=p.new_tokens)
            diff = first_difference([r.tokens], [results["plain"].tokens])  # one turn
            same = None if label == "plain" else diff is None
            report.row(**{
                "run": f"{name} {label}", "dtype": str(dtype).removeprefix("torch."),
                "tokens": len(r.tokens), "tok/s": r.tokens_per_s,
                "ms/step": 1e3 * r.seconds / (r.steps + 1), "tau": r.tau, "same as plain": same,
                "note": f"{kernel_kind} kernels{how}" + ("" if diff is None
                                                         else f"; first difference at token {diff[1]}"),
            })  # fmt: skip
        del runtime, decoders


def big_forward(ctx: Context, report: Report) -> None:
    """One target forward of a few Llama-3.1-8B-shaped layers: a decode step (1 token) and a
    tree verify (N tokens), prefix 2048; weight bytes read per forward over its time."""
    from eagletools.decode import Transformer

    p, dev = ctx.plan, ctx.device
    hf = random_target(p.big_target, dev, torch.bfloat16)
    runtime = Transformer.from_hf(hf, dtype=torch.bfloat16)
    del hf
    runtime.setup_caches(1, p.prefix + 128)
    weights = sum(t.nbytes for n, t in runtime.named_parameters() if "tok_embeddings" not in n)
    layers = p.big_target["num_hidden_layers"]
    shape = "8B-shaped" if ctx.cuda else "tiny"
    for n in (1, max(p.tree_sizes)):
        ids = torch.randint(0, p.big_target["vocab_size"], (1, n), device=dev)
        positions = torch.arange(p.prefix, p.prefix + n, device=dev)
        tree = cases.random_tree(1, n, cases.generator("big", n))[0]
        mask = None if n == 1 else cases.ancestor_mask(tree).to(dev)
        ms = time_ms(lambda i=ids, pos=positions, m=mask: runtime(i, pos, p.prefix, m), ctx)
        achieved = weights / (ms * 1e-3)
        report.row(**{
            "run": f"{shape} forward, {layers} layers + head, {n} token(s) after {p.prefix}",
            "dtype": "bfloat16", "tokens": n, "ms/step": ms, "GB/s": achieved / 1e9,
            "% copy bw": 100 * achieved / ctx.bandwidth(),
        })  # fmt: skip


# -- 4. training ------------------------------------------------------------------------


def recipe_trainer(target: Any, batch: int, ctx: Context, out: Path) -> Any:
    """The `Trainer` that `eagletools train recipes/llama3.1-8b.yaml` builds (its optimizer,
    clip, precision and unroll), here at `batch` rows of the plan's length, on random
    tokens: what a GPU run of the recipe would step through, the target in the loop."""
    import datasets

    from eagletools.train.inputs import online_inputs
    from eagletools.train.recipe import load_config
    from eagletools.train.trainer import Trainer

    p, vocab = ctx.plan, target.info.vocab_size
    config = load_config(ROOT / "recipes" / "llama3.1-8b.yaml", [
        f"data.max_length={p.seq_len}", "data.eval_samples=1", "tracking.report_to=none",
        f"vocab.draft_vocab_size={min(p.draft_vocab, vocab)}", f"training.batch_size={batch}",
        "training.grad_accum=1", "training.max_steps=1000",
    ])  # fmt: skip
    rows = batch * (p.train_steps + 1) + 1  # every step on new rows, one held out
    ids = torch.randint(0, vocab, (rows, p.seq_len), generator=torch.Generator().manual_seed(0))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(),
                                       "loss_mask": [[1] * p.seq_len] * rows})  # fmt: skip
    return Trainer(config, out, online_inputs(config, target, data))


def timed_steps(trainer: Any, batch: int, ctx: Context) -> dict[str, Any]:
    """A warm-up step (optimizer state, autotuning), then the plan's timed steps."""
    p, dev = ctx.plan, ctx.device
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    trainer.train_step()
    ctx.sync()
    start = time.perf_counter()
    for _ in range(p.train_steps):
        metrics = trainer.train_step()
    ctx.sync()
    seconds = (time.perf_counter() - start) / p.train_steps
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if ctx.cuda else None
    return {"tok/s": batch * p.seq_len / seconds, "ms/step": 1e3 * seconds,
            "peak GiB": peak, "loss": metrics["loss"]}  # fmt: skip


def section_train(ctx: Context, report: Report) -> None:
    from eagletools.targets import Target, TargetInfo

    report.columns("draft", "batch", "seq", "steps", "tok/s", "ms/step", "peak GiB", "loss",
                   "note")  # fmt: skip
    p, dev = ctx.plan, ctx.device
    hf = random_target(p.train_target, dev, torch.bfloat16)
    target = Target(hf, None, TargetInfo.from_config(hf.config, "random"))
    note = f"target in the loop: {hf.config.num_hidden_layers} layers"
    for batch in p.batches:
        row = dict(batch=batch, seq=p.seq_len, steps=p.train_steps, note=note)
        if ctx.time_left() < 20:
            report.row(**row | {"note": "skipped: out of time"})
            continue
        try:
            with tempfile.TemporaryDirectory() as out:
                trainer = recipe_trainer(target, batch, ctx, Path(out))
                cfg, params = trainer.draft.config, trainer.draft.parameters()
                trained = sum(q.numel() for q in params if q.requires_grad) / 1e6
                row["draft"] = (
                    f"H={cfg.hidden_size} Vd={cfg.draft_vocab_size} ({trained:.3g}M trained)"
                )
                row.update(timed_steps(trainer, batch, ctx))
        except torch.OutOfMemoryError as exc:
            row.update(note=f"out of memory: {str(exc)[:200]}")
        finally:
            trainer = None
            if ctx.cuda:
                torch.cuda.empty_cache()
        report.row(**row)


# -- 5. FSDP checkpoint -----------------------------------------------------------------


def draft_config(target: dict, draft_vocab: int):
    """The DraftConfig `Eagle3Draft.from_target` would make for this target."""
    from eagletools.draft import DraftConfig

    n_layers = target["num_hidden_layers"]
    heads = target["num_attention_heads"]
    return DraftConfig(
        hidden_size=target["hidden_size"], intermediate_size=target["intermediate_size"],
        num_attention_heads=heads, num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["hidden_size"] // heads, vocab_size=target["vocab_size"],
        draft_vocab_size=min(draft_vocab, target["vocab_size"]),
        target_hidden_size=target["hidden_size"], num_aux_states=3,
        aux_layer_ids=[2, n_layers // 2, n_layers - 3],
        max_position_embeddings=target["max_position_embeddings"],
    )  # fmt: skip


def random_draft(config, device: torch.device, seed: int = 0):
    """An fp32 Eagle3Draft made on `device`, with a random draft vocabulary."""
    from eagletools.draft import Eagle3Draft
    from eagletools.vocab import DraftVocab

    torch.manual_seed(seed)
    with torch.device(device):
        draft = Eagle3Draft(config)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(config.vocab_size, generator=gen)[: config.draft_vocab_size]
    vocab = DraftVocab.from_selected(ids, config.vocab_size)
    with torch.no_grad():
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
    return draft


def ttt_batch(draft, batch: int, seq: int, device: torch.device, seed: int) -> tuple:
    """Random `TTTModel` inputs: (ids, aux, loss_mask, teacher_probs, target_argmax)."""
    cfg = draft.config
    gen = torch.Generator(device).manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen)
    aux = torch.randn(batch, seq, cfg.num_aux_states * cfg.target_hidden_size, device=device,
                      generator=gen).to(torch.bfloat16)  # fmt: skip
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    logits = torch.randn(batch, seq, cfg.draft_vocab_size, device=device, generator=gen)
    probs = (2 * logits).softmax(-1)
    del logits
    picks = torch.randint(0, cfg.draft_vocab_size, (batch, seq), device=device, generator=gen)
    return ids, aux, mask, probs, picks + draft.d2t[picks]


def same_state(a: Any, b: Any) -> bool:
    """Nested dicts/lists of tensors and numbers, equal exactly."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def section_fsdp(ctx: Context, report: Report) -> None:
    """Train 2 steps under `fully_shard`, save with the trainer's checkpoint code, load into
    a fresh scrambled model, compare state and the next two steps' losses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from eagletools.engines.server import free_port
    from eagletools.train import checkpoint as ckpt
    from eagletools.train.ttt import TTTModel

    report.columns("check", "ok", "value", "detail")
    p, dev = ctx.plan, ctx.device
    config = draft_config(p.fsdp_target, p.draft_vocab)
    if ctx.cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if ctx.cuda else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}",
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        mesh = init_device_mesh(dev.type, (1,))

        def sharded(scramble: bool):
            draft = random_draft(config, dev)
            if scramble:  # every trained weight must then come from the checkpoint
                with torch.no_grad():
                    for q in draft.parameters():
                        if q.requires_grad:
                            q.normal_()
            model = TTTModel(draft, steps=3, chunk=512)
            fully_shard(model, mesh=mesh)
            params = [q for q in draft.parameters() if q.requires_grad]
            return model, torch.optim.AdamW(params, lr=1e-3)

        def step(model, optimizer, seed: int) -> float:
            """A plain step: what is checked is the checkpoint's round trip, and the
            trainer's own step runs under FSDP only in a launched process group."""
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss, _ = model(*ttt_batch(model.draft, 2, p.fsdp_seq_len, dev, seed))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss)

        model, optimizer = sharded(scramble=False)
        report.row(check="parameters are FSDP2 DTensors",
                   ok=type(model.draft.fc.weight).__name__ == "DTensor",
                   detail=type(model.draft.fc.weight).__name__)  # fmt: skip
        for s in range(2):
            step(model, optimizer, s)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            # a copy: on CPU the gathered tensors can share storage with the live parameters
            saved = copy.deepcopy(ckpt.full_state(model.draft, optimizer))
            path = ckpt.save_checkpoint(Path(tmp), 2, saved, config.to_dict(), {"step": 2}, 1)
            size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
            report.row(check="save (gather + write)", ok=True, value=time.perf_counter() - start,
                       detail=f"seconds; {size:.1f} MiB in {path.name}/")  # fmt: skip
            expected = [step(model, optimizer, s) for s in (2, 3)]

            fresh, fresh_optimizer = sharded(scramble=True)
            start = time.perf_counter()
            ckpt.load_checkpoint(path, fresh.draft, fresh_optimizer)
            loaded = ckpt.full_state(fresh.draft, fresh_optimizer)
            report.row(check="load", ok=True, value=time.perf_counter() - start,
                       detail="seconds")  # fmt: skip
        report.row(check="weights identical after resume", ok=same_state(saved[0], loaded[0]),
                   value=len(saved[0]), detail="tensors")  # fmt: skip
        report.row(check="optimizer state identical", ok=same_state(saved[1], loaded[1]))
        got = [step(fresh, fresh_optimizer, s) for s in (2, 3)]
        for i, (want, have) in enumerate(zip(expected, got, strict=True)):
            diff = abs(want - have)
            report.row(check=f"loss of step {3 + i} after resume", ok=diff <= 1e-5 * abs(want),
                       value=have, detail=f"uninterrupted {want:.6g}, |diff| {diff:.2e}")  # fmt: skip
    finally:
        dist.destroy_process_group()
    if not all(r["ok"] for r in report.current.rows):
        raise RuntimeError("the resumed run differs (see the rows above)")


# -- main -------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Context, Report], None]] = {
    "env": section_env, "kernels": section_kernels, "decode": section_decode,
    "train": section_train, "fsdp": section_fsdp,
}  # fmt: skip


def parse_sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown or [text]}; known: {','.join(SECTIONS)}"
        )
    return names


def versions() -> dict[str, str]:
    found = {}
    for name in ("triton", "transformers", "accelerate", "safetensors"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[8:]),
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"),
                        help="folder for gpu_check.json and gpu_check.md (default %(default)s)")  # fmt: skip
    parser.add_argument("--sections", type=parse_sections, default=list(SECTIONS),
                        help=f"comma-separated, from {','.join(SECTIONS)} (default: all)")  # fmt: skip
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when present (default)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes and steps (on CPU the shapes are always tiny)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds after which no new section starts (default %(default)s); "
                             "the process dumps its stacks and exits at budget + 90")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("warning: Triton was imported before its interpreter was set", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"  # read by Triton at import: the kernels on CPU

    start = time.perf_counter()
    faulthandler.dump_traceback_later(args.budget + 90, exit=True)  # a hang still ends, loudly
    ctx = Context(device, make_plan(device, args.quick), deadline=start + args.budget)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "device_name": torch.cuda.get_device_name(device) if cuda else f"cpu x{os.cpu_count()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        **versions(),
        "argv": sys.argv,
        "plan": vars(ctx.plan),
    }
    report = Report(args.out, meta)
    print(f"eagletools GPU check on {meta['device_name']}: torch {meta['torch']}, "
          f"triton {meta['triton']}, transformers {meta['transformers']}", flush=True)  # fmt: skip
    for name in args.sections:
        report.begin(name)
        begun = time.perf_counter()
        if ctx.time_left() < 0:
            report.end("skipped", f"budget of {args.budget:.0f} s spent", 0.0)
            continue
        try:
            RUNNERS[name](ctx, report)
            status, reason = "ok", ""
        except ModuleNotFoundError as exc:
            status, reason = "skipped", f"needs the package {exc.name!r}, not installed here"
        except Exception as exc:  # every section gets its turn
            traceback.print_exc()
            status, reason = "failed", f"{type(exc).__name__}: {exc}"[:500]
        finally:
            if cuda:
                torch.cuda.empty_cache()
        report.end(status, reason, time.perf_counter() - begun)
    faulthandler.cancel_dump_traceback_later()
    statuses = {n: s.status for n, s in report.sections.items()}
    print(f"\n{statuses} in {time.perf_counter() - start:.0f} s; "
          f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}", flush=True)  # fmt: skip
    return 0 if all(s != "failed" for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
