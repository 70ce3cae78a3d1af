"""The one device policy: every command that runs a model takes `--device`, default `auto`.

`auto` is accelerate's device for this process: under `accelerate launch` each
rank's own GPU, CUDA where torch sees one, else the CPU. Asking for CUDA that
torch cannot see is a `UserError` that says how to get it, not a CUDA traceback
later.
"""

from __future__ import annotations

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

        return PartialState(cpu=not cuda).device  # under accelerate launch: this rank's GPU
    return device


def fast_matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype whose large matmuls run fastest on `device`.

    bf16 on CUDA and on CPUs with AMX tiles; float32 on other CPUs, where
    oneDNN's bf16 GEMMs run at ~0.6x fp32's (AVX-512 with bf16 dot products, 2
    cores: 159 against 257 GFLOPS at [512, 576] x [576, 1536]). Compute-bound
    work that may choose its dtype (Muon's Newton-Schulz iterations) asks here.
    """
    import torch

    if device.type == "cpu" and not torch.cpu._is_amx_tile_supported():
        return torch.float32
    return torch.bfloat16
