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

_SOURCE = Path(__file__).parent / "csrc" / "bf16_linear.cpp"


@functools.cache
def bf16_linear() -> Callable | None:
    """`op(x, w, bias)`: `F.linear` of few bf16 rows, each row's result independent of the
    others (csrc/bf16_linear.cpp); None where it cannot run here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        op = _build()
    except Exception as err:  # a missing compiler, ninja or header: torch's op stays
        log.warning("eagletools' CPU kernels did not build (%s); torch's products are used", err)
        return None
    if not _agrees(op):
        log.warning("eagletools' bf16 linear disagrees with its reference here; not used")
        return None
    return op


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
    return torch.ops.eagletools_cpu.bf16_linear


def _agrees(op: Callable) -> bool:
    """On an odd shape (tails in both dimensions), within a bf16 step of the fp32 product."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(13, 37, generator=g).bfloat16(), torch.randn(13, generator=g).bfloat16()
    x = torch.randn(5, 37, generator=g).bfloat16()
    want = F.linear(x.float(), w.float(), b.float())
    return bool(((op(x, w, b).float() - want).abs() <= want.abs() / 128 + 1e-3).all())
