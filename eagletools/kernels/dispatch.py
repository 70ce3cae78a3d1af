"""Choosing between a Triton kernel and its PyTorch reference.

Triton runs when every tensor is on CUDA and `EAGLETOOLS_KERNELS` is not
`reference`; the CPU decoder and anyone debugging a kernel get the reference.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernel should run on these inputs.

    `EAGLETOOLS_KERNELS=reference` forces the references; `=triton` forces the
    kernels, on CPU tensors too under `TRITON_INTERPRET=1`, so the decoder's
    whole Triton path can be checked on a machine without a GPU.
    """
    mode = os.environ.get("EAGLETOOLS_KERNELS", "")
    if mode == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if mode == "triton" and not on_cuda and not interpreting():
        raise RuntimeError(
            "EAGLETOOLS_KERNELS=triton with CPU tensors needs TRITON_INTERPRET=1 "
            "(set before Triton is imported)"
        )
    return on_cuda or mode == "triton"


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (`TRITON_INTERPRET=1`).

    Its `tl.dot` multiplies bf16 operands as their raw bits (triton 3.9), so
    kernels upcast dot operands there, after rounding them as the GPU would.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def target_arch() -> int:
    """The compute capability Triton compiles for now (86 = sm_86); 0 in the interpreter.

    Triton's active driver answers: the current CUDA device, or under
    `kernels.aot` the arch being compiled for, so tiles chosen from it are
    the tiles that arch's compile check sees.
    """
    if interpreting():
        return 0
    from triton.runtime import driver

    return driver.active.get_current_target().arch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int, floor: int = 1) -> int:
    """Smallest power of two >= max(x, floor): Triton block sizes."""
    return max(floor, 1 << (max(x, 1) - 1).bit_length())


def verify_outputs(
    batch: int, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(path [B,N], accept_len [B], token [B])`, int64: what both verifications return."""
    path = torch.empty(batch, n, dtype=torch.long, device=device)
    return path, path.new_empty(batch), path.new_empty(batch)


def lazy_jit(fn: Callable) -> Callable[[], Callable]:
    """`triton.jit(fn)`, applied at first launch rather than at import.

    Triton reads `TRITON_INTERPRET` when it is imported, so importing this
    package never imports Triton: the kernel's module gets its `tl` here (it
    holds `tl = None` until then). The CPU decoder never imports Triton at all.
    """

    @functools.cache
    def compiled():
        import triton
        import triton.language

        fn.__globals__["tl"] = triton.language
        return triton.jit(fn)

    return compiled
