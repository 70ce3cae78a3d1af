"""Our C++ CPU kernels (eagletools/csrc): built on first use, once per machine.

torch's extension builder compiles them with the machine's C++ compiler into
torch's extension folder ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions),
keyed by the source, so a second run loads the built library in well under a
second, and concurrent first runs wait on one build. Where a kernel cannot be
built (no compiler, no AVX2) or disagrees with its reference, callers keep
torch's own op: these are speed paths, never the only path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "bf16_ops.cpp"


def bf16_linear() -> Callable | None:
    """`op(x, w, bias)`: `F.linear` of few bf16 rows, each row's result independent of the
    others (csrc/bf16_ops.cpp); None where it cannot run here."""
    ops = _ops()
    return None if ops is None else ops.bf16_linear


def rms_norm() -> Callable | None:
    """`op(x, w, eps)`: Hugging Face's bf16 RMSNorm in one call; None where it cannot run."""
    ops = _ops()
    return None if ops is None else ops.rms_norm


def few_query_attention() -> Callable | None:
    """`op(q, k, v, mask, scale)`: attention of few queries over an fp32 K cache, exact
    (`decode.model.attention`'s numerics, one call); None where it cannot run here."""
    ops = _ops()
    return None if ops is None else ops.few_query_attention


@functools.cache
def _ops():
    """The built ops' namespace, once they agree with their references; None otherwise."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        ops = _build()
    except Exception as err:  # a missing compiler, ninja or header: torch's op stays
        log.warning("eagletools' CPU kernels did not build (%s); torch's ops are used", err)
        return None
    if not _agrees(ops):
        log.warning("eagletools' CPU kernels disagree with their references here; not used")
        return None
    return ops


def source_digest() -> str:
    """The hash of our kernels' source: part of every key a measured speed is cached under."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


def _build() -> Callable:
    from torch.utils.cpp_extension import load

    log.info("loading eagletools' CPU kernels (built once per machine, ~20 s)")
    load(
        name=f"eagletools_cpu_{source_digest()}",
        sources=[str(_SOURCE)],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        is_python_module=False,
    )
    return torch.ops.eagletools_cpu


def _agrees(ops) -> bool:
    """On odd shapes (tails in every dimension), within a bf16 step of fp32 references."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(13, 37, generator=g).bfloat16(), torch.randn(13, generator=g).bfloat16()
    x = torch.randn(5, 37, generator=g).bfloat16()
    want = F.linear(x.float(), w.float(), b.float())
    linear_ok = ((ops.bf16_linear(x, w, b).float() - want).abs() <= want.abs() / 128 + 1e-3).all()
    want = F.rms_norm(x.float(), (37,), w[0].float(), 1e-6)
    norm_ok = ((ops.rms_norm(x, w[0], 1e-6).float() - want).abs() <= want.abs() / 64 + 1e-3).all()
    return bool(linear_ok and norm_ok)
