"""Every kernel's inputs, made in one place: the kernel tests, benchmarks/kernel_bench.py
and benchmarks/gpu_check.py draw the same trees, caches and distributions, so a case
the benchmarks time is one the tests check, and the targets' shapes are those
`kernels.aot` compiles for.

Inputs are drawn on the CPU from a generator seeded by a key (`generator`), then moved
to the device: the same key gives the same case on any machine.
"""

from __future__ import annotations

import math
import statistics
import time
import zlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from eagletools.kernels import attention, draft_topk, greedy_verify, kv_compact, sampling_verify


@dataclass(frozen=True)
class Shape:
    """A target's widths, and the tree size its decoder verifies."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    tree_nodes: int


# Trees: the decoder's default 16 nodes, and 60 (EAGLE-3's setting) for the 70B, no
# multiple of 16, which Triton specialises differently (bf16 tiles spilled there on
# sm_80/120). Shapes alike in every specialisation compile once.
SHAPES = (
    Shape("Llama-3.1-8B", 32, 8, 128, 128_256, 32, 16),
    Shape("Qwen3-8B", 32, 8, 128, 151_936, 36, 16),
    Shape("Llama-3.1-70B", 64, 8, 128, 128_256, 80, 60),
)
LLAMA_8B = SHAPES[0]
DRAFT_VOCAB = 32_000
SENTINEL = -7777  # an integer output slot no kernel writes


@dataclass(frozen=True)
class Case:
    """One kernel call: its arguments, and the least it must read and write (the
    floor a memory-bound kernel is measured against)."""

    kernel: str  # the name in eagletools.kernels: tree_attention, verify_greedy, ...
    shape: str
    args: tuple
    bytes_moved: int


# each kernel by its name in eagletools.kernels, beside the module defining it
MODULES = {
    "tree_attention": attention,
    "verify_greedy": greedy_verify,
    "topk_d2t": draft_topk,
    "compact_kv": kv_compact,
    "verify_sampling": sampling_verify,
}


def triton_and_reference(kernel: str) -> tuple[Callable, Callable]:
    """`<kernel>_triton` and `<kernel>_reference`, looked up when called (so a test may
    swap either)."""
    module = MODULES[kernel]
    return getattr(module, f"{kernel}_triton"), getattr(module, f"{kernel}_reference")


def generator(*key: object) -> torch.Generator:
    """A generator seeded by `key` (a test's name and shape): each case draws its own."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def on(device: torch.device | str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


def poisoned(*like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Outputs pre-filled with NaN / `SENTINEL`, so an element a kernel skips shows up."""
    return tuple(
        torch.full_like(t, float("nan") if t.is_floating_point() else SENTINEL) for t in like
    )


# -- inputs -----------------------------------------------------------------------------


def random_tree(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """`parents [B,N]`: root -1, every other node a random earlier parent."""
    parents = torch.empty(batch, n, dtype=torch.long)
    parents[:, 0] = -1
    for j in range(1, n):
        parents[:, j] = torch.randint(0, j, (batch,), generator=gen)
    return parents


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """`[N,N]` ancestor-or-self mask of one tree."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for j in range(1, n):
        mask[j] |= mask[parents[j]]
    return mask


def attention_inputs(
    b: int, hq: int, hkv: int, n: int, prefix: int, d: int, dtype: torch.dtype,
    gen: torch.Generator, spare: int = 9,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(q, k_cache, v_cache, mask) as the decoder hands them over: q made `[B,N,Hq,D]` and
    transposed (not contiguous); `spare` cache slots past the tree hold NaN, which would
    leak into the output if a kernel read them."""
    q = torch.randn(b, n, hq, d, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, hkv, prefix + n + spare, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, prefix + n + spare, d, generator=gen).to(dtype)
    k[:, :, prefix + n :] = float("nan")
    v[:, :, prefix + n :] = float("nan")
    return q, k, v, ancestor_mask(random_tree(1, n, gen)[0])


def greedy_inputs(batch: int, n: int, vocab: int, gen: torch.Generator):
    """(tokens, parents, target_argmax): trees whose argmax often picks one of a node's
    children, so paths get long."""
    parents = random_tree(batch, n, gen)
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    target_argmax = torch.randint(0, vocab, (batch, n), generator=gen)
    follow = torch.rand(batch, n, generator=gen) < 0.8
    for b in range(batch):
        for j in range(n):
            kids = (parents[b] == j).nonzero().flatten()
            if len(kids) and follow[b, j]:
                pick = kids[torch.randint(0, len(kids), (1,), generator=gen)]
                target_argmax[b, j] = tokens[b, pick]
    return tokens, parents, target_argmax


def sampling_inputs(
    batch: int, n: int, vocab: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
):
    """(tokens, parents, probs, uniforms): peaked target distributions where drafted
    children carry most of the mass, so paths get long."""
    tokens, parents, _ = greedy_inputs(batch, n, vocab, gen)
    logits = torch.randn(batch, n, vocab, generator=gen) * 2
    for j in range(n):
        kids = parents == j
        boost = torch.zeros(batch, vocab).scatter_add_(
            1, tokens, kids.float() * (2 + math.log(vocab))
        )
        logits[:, j] += boost
    probs = logits.softmax(-1).to(dtype)
    uniforms = torch.rand(batch, n + 1, generator=gen)
    return tokens, parents, probs, uniforms


def random_d2t(draft_vocab: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """`d2t [Vd]`: the offsets of `draft_vocab` random target ids, as a draft vocabulary
    maps them (docs/design.md 3.6)."""
    selected = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    return selected - torch.arange(draft_vocab)


def accepted_paths(
    b: int, n: int, slots: int, gen: torch.Generator, ragged: bool = True
) -> torch.Tensor:
    """`[B,n]` increasing slots below `slots`, as accepted paths are; ragged: each row
    a random length, -1 past it."""
    src = torch.full((b, n), -1, dtype=torch.long)
    for i in range(b):
        length = int(torch.randint(1, n + 1, (1,), generator=gen)) if ragged else n
        src[i, :length] = torch.randperm(slots, generator=gen)[:length].sort().values
    return src


def compact_inputs(
    b: int, h: int, d: int, n: int, prefix: int, tree: int, dtype: torch.dtype,
    gen: torch.Generator, layers: tuple[int, ...] = (), ragged: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(k_cache, v_cache, src_slots): a `tree`-node tree after `prefix` cached tokens (4
    slots spare), and up to `n` accepted nodes per row to move to `prefix`."""
    k = torch.randn(*layers, b, h, prefix + tree + 4, d, generator=gen).to(dtype)
    v = torch.randn(*layers, b, h, prefix + tree + 4, d, generator=gen).to(dtype)
    src = accepted_paths(b, n, tree, gen, ragged)
    return k, v, torch.where(src >= 0, src + prefix, -1)


# -- cases: inputs on a device, with the bytes each kernel must move ---------------------


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention_case(
    b: int, n: int, prefix: int, device: torch.device, shape: Shape = LLAMA_8B,
    dtype: torch.dtype = torch.bfloat16,
) -> Case:  # fmt: skip
    """Tree attention over a prefix: reads the visible K/V once, q, the mask; writes out."""
    hq, hkv, d = shape.q_heads, shape.kv_heads, shape.head_dim
    gen = generator("attention", b, hq, hkv, n, prefix, d, dtype)
    q, k, v, mask = on(device, *attention_inputs(b, hq, hkv, n, prefix, d, dtype, gen))
    kv_read = 2 * b * hkv * (prefix + n) * d * k.element_size()
    label = f"B={b} Hq={hq} Hkv={hkv} D={d} N={n} prefix={prefix} {_name(dtype)}"
    return Case("tree_attention", label, (q, k, v, prefix, mask, d**-0.5),
                kv_read + 2 * q.nbytes + mask.nbytes)  # fmt: skip


def greedy_case(b: int, n: int, vocab: int, device: torch.device) -> Case:
    """Greedy verification: three `[B,N]` inputs read, path written, two ints a row."""
    args = on(device, *greedy_inputs(b, n, vocab, generator("greedy", b, n, vocab)))
    return Case("verify_greedy", f"B={b} N={n}", args, 4 * args[0].nbytes + 16 * b)


def topk_case(
    m: int, k: int, device: torch.device, draft_vocab: int = DRAFT_VOCAB,
    vocab: int = LLAMA_8B.vocab, dtype: torch.dtype = torch.bfloat16,
) -> Case:  # fmt: skip
    """The draft's top-k: the logits read once; per pick a log-prob and an id written, a
    `d2t` entry read."""
    gen = generator("topk", m, k, draft_vocab, vocab, dtype)
    d2t = random_d2t(draft_vocab, vocab, gen)
    logits = torch.randn(m, draft_vocab, generator=gen).to(dtype)
    logits, d2t = on(device, logits, d2t)
    label = f"M={m} Vd={draft_vocab} k={k} {_name(dtype)}"
    return Case("topk_d2t", label, (logits, d2t, k), logits.nbytes + m * k * (4 + 8 + 8))


def compact_case(
    b: int, n: int, tree: int, prefix: int, device: torch.device, shape: Shape = LLAMA_8B,
    dtype: torch.dtype = torch.bfloat16,
) -> Case:  # fmt: skip
    """One layer's accepted path moved into place: `n` nodes of K and V read and written."""
    hkv, d = shape.kv_heads, shape.head_dim
    gen = generator("compact", b, n, tree, prefix, hkv, d, dtype)
    k, v, src = on(device, *compact_inputs(b, hkv, d, n, prefix, tree, dtype, gen, ragged=False))
    moved = 2 * 2 * b * hkv * n * d * k.element_size() + src.nbytes
    label = f"B={b} Hkv={hkv} D={d}: {n} of {tree} nodes to {prefix} {_name(dtype)}"
    return Case("compact_kv", label, (k, v, src, prefix), moved)


def sampling_case(b: int, n: int, vocab: int, device: torch.device) -> Case:
    """Lossless sampling over the full vocab: at least each visited node's row read once."""
    args = on(device, *sampling_inputs(b, n, vocab, generator("sampling", b, n, vocab)))
    walked = int(sampling_verify.verify_sampling_reference(*args)[1].sum()) + b
    label = f"B={b} N={n} V={vocab} fp32 ({walked} rows walked)"
    return Case("verify_sampling", label, args, walked * vocab * args[2].element_size())


def llama_8b_sweep(device: torch.device, kernels: Collection[str] | None = None) -> Iterator[Case]:
    """Every kernel (or those in `kernels`) at Llama-3.1-8B's shapes, from one-token trees
    to batches (benchmarks/kernel_bench.py); made one at a time, so the largest inputs
    are freed before the next case."""
    sweep: dict[str, list[Callable[[], Case]]] = {
        "tree_attention": [
            partial(attention_case, b, n, prefix, device)
            for b, n, prefix in [(1, 16, 1), (1, 64, 1024), (1, 64, 8192), (1, 128, 8192),
                                 (8, 64, 2048)]
        ],
        "verify_greedy": [partial(greedy_case, b, 64, LLAMA_8B.vocab, device) for b in (1, 64)],
        "topk_d2t": [partial(topk_case, m, k, device) for m in (1, 64) for k in (1, 8)],
        "compact_kv": [partial(compact_case, b, 8, 64, 2048, device) for b in (1, 64)],
        "verify_sampling": [
            partial(sampling_case, b, 64, LLAMA_8B.vocab, device) for b in (1, 16)
        ],
    }  # fmt: skip
    for kernel, makers in sweep.items():
        if kernels is None or kernel in kernels:
            yield from (make() for make in makers)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second (read + write) of a plain device copy: 1 GiB timed by Triton on a
    GPU, 32 MiB by the wall clock on CPU; the floor `Case.bytes_moved` is set against."""
    src = torch.empty(2**30 if device.type == "cuda" else 2**25, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    else:
        dst.copy_(src)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
    return 2 * src.nbytes / (ms * 1e-3)
