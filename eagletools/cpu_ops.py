"""Faster CPU forms of the ops that decoding runs hot.

Linears: `F.linear` in bf16 on CPU reorders the weight into oneDNN's blocked
layout at every call. Packing it once (what inductor's CPU freezing does) makes
products of 1 to 64 rows (a decoded token, a draft tree, a regeneration batch)
faster than `F.linear` (benchmarks/gemv.py times it; figures in docs/lab.md,
Part 3). From a few hundred rows (training) plain `F.linear` wins again. Up to 64 rows the
packed bf16 product of a row does not depend on how many rows share the call
(bitwise); fp32 products do. That takes two cares. oneDNN has its own kernel for
a single row, which on AVX-512 CPUs without AMX rounds some outputs apart from
the many-row kernel (6 of 64 rows at [576, 1536], SmolLM2's down projection),
so under exact numerics a lone row runs as two, which makes a token's linears
slower on such CPUs (docs/lab.md, Part 3). And on a Xeon with AMX, products of 33 to 64 rows
rounded apart from 32 or fewer (every such row count, at all three of
SmolLM2's shapes tested): rows run in blocks of at most 32, on every CPU.
`--fast-numerics` skips both. The packed copy lives
beside the weight and is remade when the weight changes, so it doubles the
memory of the layers that use it. Without grad only: it has no backward.
Where oneDNN cannot pack bf16 (AVX2 CPUs), few rows go through our own
kernel (`native.bf16_linear`): 1.1-1.4x torch's product at one row and
2.1-3.6x at 3 to 8 (benchmarks/gemv.py, docs/lab.md Part 8), and a row's
result never depends on the others.

Attention's batched products under `torch.compile` on CPU: one opaque op
(`batched_product`), since the compiled step builds every product it sees from
inductor's C++ GEMM template (`compiling.compile_frozen`), which has no form for
these (a dynamic key count, float64).

RMSNorm: one C++ call eagerly in bf16 (`rms_norm`); so is the attention of few
queries over the decoder's caches (`attention_op`): ~15 ops a layer before.

Argmax over a vocabulary: `max(dim).indices` is faster than `argmax` on CPU
(bf16 and fp32; docs/lab.md, Part 3) and keeps its rule for ties, the first
maximum.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from eagletools import native

# id(weight) -> ((data_ptr, version), packed copy); outside the weight, so deepcopy and
# pickling never meet the opaque packed tensor; an entry goes when its weight does
_PACKED: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}


@functools.cache
def packing_available() -> bool:
    """oneDNN packs bf16 here, and its product equals `F.linear` on a random case."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=g).bfloat16()
        x = torch.randn(5, 64, generator=g).bfloat16()
        got = _packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None)
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    invariant: bool = True,
) -> torch.Tensor:
    """`F.linear` through the packed copy of a bf16 CPU `weight` (no grad); `invariant`:
    rows go in blocks of at most `INVARIANT_ROWS`, a lone row as two (module docstring)."""
    packed = packed_weight(weight)
    if not invariant:
        return _packed_linear(x.contiguous(), packed, bias)
    rows = x.reshape(-1, x.shape[-1])
    if len(rows) <= INVARIANT_ROWS:  # a decoded token or a tree: one call, no split
        out = _invariant_block(rows, packed, bias)
    else:
        out = torch.cat([_invariant_block(b, packed, bias) for b in rows.split(INVARIANT_ROWS)])
    return out.view(*x.shape[:-1], -1)


def _invariant_block(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    if len(rows) == 1:  # oneDNN's lone-row kernel rounds apart from the many-row one
        return _packed_linear(rows.expand(2, -1).contiguous(), packed, bias)[:1]
    return _packed_linear(rows.contiguous(), packed, bias)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of `weight`, made again after any change to it."""
    # inference tensors keep no version counter: only their storage tells them apart
    key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)
    hit = _PACKED.get(id(weight))
    if hit is None or hit[0] != key:
        if hit is None:
            weakref.finalize(weight, _PACKED.pop, id(weight), None)
        hit = _PACKED[id(weight)] = (
            key,
            torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
        )
    return hit[1]


PACKED_MAX_ROWS = 64  # beyond, F.linear's own packing pays off (2 threads, bf16)
# above 32 rows oneDNN's AMX kernel takes over where the CPU has AMX, and rounds apart
INVARIANT_ROWS = 32


def _bf16_cpu_no_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where our CPU ops may stand in for torch's: bf16 on CPU, no gradient to carry."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


@functools.cache
def product_route() -> str:
    """How this process multiplies few bf16 rows on CPU, eagerly: `packed` (oneDNN, which
    packs bf16 here), `native` (our kernel: AVX2 CPUs) or `torch` (`F.linear`)."""
    return "packed" if packing_available() else "native" if native.bf16_linear() else "torch"


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool = True
) -> torch.Tensor:
    """`F.linear`, through the packed weight (`packed_linear`) or our kernel where faster.

    Under `torch.compile` plain `F.linear`: inductor's freezing packs the weight
    itself (`decode.model.compiled` never gives it a lone row). Our kernel called
    from a compiled step made it slower (docs/lab.md, Part 8).
    """
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    if x.numel() <= PACKED_MAX_ROWS * weight.shape[1] and _bf16_cpu_no_grad(x, weight):
        route = product_route()
        if route == "packed":
            return packed_linear(x, weight, bias, invariant)
        if route == "native":
            return native.bf16_linear()(x, weight, bias)
    return F.linear(x, weight, bias)


class PackedLinear(nn.Linear):
    """nn.Linear that runs through `linear` (same weights, same state dict)."""

    invariant = True  # per instance after `Transformer.set_exact` (pack_linears runs no __init__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.invariant)


def pack_linears(model: nn.Module) -> nn.Module:
    """Make every `nn.Linear` of a model a `PackedLinear` (same weights and state dict)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
    return model


def batched_product(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`alpha * a @ b` over a batch; under `torch.compile` a call inductor keeps whole."""
    if torch.compiler.is_compiling():
        return _opaque_product(a, b, alpha)
    return _product(a, b, alpha)


def _product(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    if alpha == 1.0:
        return torch.bmm(a, b)
    return torch.baddbmm(a.new_empty(()), a, b, beta=0, alpha=alpha)


@torch.library.custom_op("eagletools::batched_product", mutates_args=())
def _opaque_product(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    return _product(a, b, alpha)


@_opaque_product.register_fake
def _(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. Eagerly in bf16 on CPU without grad, our one-call op
    (`native.rms_norm`, Hugging Face's roundings): torch's takes ~50 us of small ops at
    one row, 61 times a SmolLM2 token. Else `F.rms_norm`, the weight in x's dtype."""
    if (
        not torch.compiler.is_compiling()
        and _bf16_cpu_no_grad(x, weight)
        and (op := native.rms_norm())
    ):
        return op(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable | None:
    """Our one-call attention of few queries (`native.few_query_attention`) where it takes
    these eagerly: CPU, an fp32 K and an fp32 or fp64 V (the decoder's caches); else None."""
    if (
        torch.compiler.is_compiling()
        or q.device.type != "cpu"
        or k.dtype != torch.float32
        or v.dtype not in (torch.float32, torch.float64)
        or k.stride(-1) != 1
        or v.stride(-1) != 1
    ):
        return None
    return native.few_query_attention()


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`x.argmax(dim)`, through `max`: the same index, ties included."""
    return x.max(dim).indices
