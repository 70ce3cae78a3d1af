"""The one device policy: every command that runs a model takes `--device`, default `auto`.

`auto` is accelerate's device for this process: under `accelerate launch` each
rank's own GPU, CUDA where torch sees one, else the CPU. Asking for CUDA that
torch cannot see is a `UserError` that says how to get it, not a CUDA traceback
later.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from typing import TYPE_CHECKING

from eagletools.errors import UserError

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "auto (default: CUDA where torch sees it, else CPU), cpu, cuda or cuda:N"


def resolve_device(spec: str = "auto", where: str = "--device") -> torch.device:
    """The torch device for `spec` (auto, cpu, cuda, cuda:N); `where` names the flag or field."""
    import torch

    text = str(spec).strip().lower()
    try:
        device = None if text == "auto" else torch.device(text)
    except RuntimeError:
        raise UserError(f"{where} {spec!r}: not a device; use {DEVICE_HELP}") from None
    cuda = torch.cuda.is_available()
    if device is not None and device.type == "cuda":
        if not cuda:
            raise UserError(
                f"{where} {spec}: torch {torch.__version__} sees no CUDA device "
                f"(CUDA build: {torch.version.cuda or 'none'}); use {where} cpu, or install "
                "a CUDA torch: make setup TORCH_SPEC=torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(
                f"{where} {spec}: torch sees {torch.cuda.device_count()} CUDA device(s); "
                "give an index below that"
            )
    if device is None or (device.type == "cuda" and device.index is None):
        from accelerate import PartialState

        device = PartialState(cpu=not cuda).device  # under accelerate launch: this rank's GPU
    if device.type == "cuda" and device.index is not None:
        # current for the whole command: Triton launches, CUDA-graph capture and the rest
        # follow the current device, not their tensors' (`device_guard`)
        torch.cuda.set_device(device)
    return device


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` made the current CUDA device while the context lasts (nothing off CUDA).

    Triton launches and CUDA-graph capture and replay go to the current device and its
    stream, whatever device their tensors are on: on device 0 with `cuda:1`'s pointers,
    a kernel fails or reads the wrong memory. The decode runtime enters this around its
    work, so a model on `cuda:1` runs there even when no command resolved the device.
    """
    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def fast_matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype whose large matmuls run fastest on `device`.

    bf16 on CUDA and on CPUs with AMX tiles, fp32 on CPUs without bf16 dot
    products. CPUs with AVX-512 bf16 dot products and no AMX differ (on some bf16
    is the slower, on others the faster: docs/lab.md, Part 3), so one product is
    timed in both dtypes, once per process, at [512, 576] x [576, 1536]
    (`cpu_bf16_speedup`). Compute-bound work that
    may choose its dtype (training under `precision: auto`, Muon's Newton-Schulz
    iterations) asks here.
    """
    import torch

    if device.type != "cpu" or torch.cpu._is_amx_tile_supported():
        return torch.bfloat16
    if not torch.cpu._is_avx512_bf16_supported():
        return torch.float32
    return torch.bfloat16 if cpu_bf16_speedup() >= BF16_MARGIN else torch.float32


# bf16 must win by this much: a close call keeps fp32's precision
BF16_MARGIN = 1.25


@functools.cache
def cpu_bf16_speedup(rounds: int = 7) -> float:
    """fp32 over bf16 time of one [512, 576] x [576, 1536] product on this CPU, medians
    of interleaved rounds (a loaded machine slows both alike)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 576, generator=g), torch.randn(576, 1536, generator=g)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in pairs}
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        for dtype, (x, y) in pairs.items():
            start = time.perf_counter()
            x @ y
            times[dtype].append(time.perf_counter() - start)
    median = {dtype: statistics.median(t[1:]) for dtype, t in times.items()}
    return median[torch.float32] / median[torch.bfloat16]
