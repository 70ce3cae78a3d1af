"""Choosing between a Triton kernel and its PyTorch reference.

Triton runs when every tensor is on CUDA and `EAGLETOOLS_KERNELS` is not
`reference`; the CPU decoder and anyone debugging a kernel get the reference.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

try:
    import triton.language as tl  # the kernel modules' `tl`
except ImportError:  # no Triton wheels outside Linux: the references still work
    tl = None


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernel should run on these inputs."""
    if os.environ.get("EAGLETOOLS_KERNELS", "") == "reference":
        return False
    return all(t.is_cuda for t in tensors)


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (`TRITON_INTERPRET=1`).

    Its `tl.dot` multiplies bf16 operands as their raw bits (triton 3.9), so
    kernels upcast dot operands there, after rounding them as the GPU would.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(x: int, floor: int = 1) -> int:
    """Smallest power of two >= max(x, floor): Triton block sizes."""
    return max(floor, 1 << (max(x, 1) - 1).bit_length())


def lazy_jit(fn: Callable) -> Callable[[], Callable]:
    """`triton.jit(fn)`, applied at first launch rather than at import.

    `triton.jit` reads `TRITON_INTERPRET` when it decorates; deferring it lets
    tests switch the interpreter on after this package was imported elsewhere.
    """

    @functools.cache
    def compiled():
        import triton

        return triton.jit(fn)

    return compiled
