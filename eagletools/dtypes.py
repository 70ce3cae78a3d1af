"""The one dtype parser: every flag and recipe field that names a dtype reads it here.

Users write `bf16` (accelerate, convert) as often as `bfloat16` (torch, HF
configs); both spellings are accepted everywhere and an unknown one is a
`UserError` naming the flag or field and listing the known spellings. Names are
resolved without importing torch, so argparse can use `dtype_arg` at parse time.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from eagletools.errors import UserError

if TYPE_CHECKING:
    import torch

# spelling -> torch attribute name (the canonical spelling)
SPELLINGS = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}  # fmt: skip


def dtype_name(text: str, where: str = "") -> str:
    """The canonical torch name ('bfloat16', 'float16', 'float32') of any known spelling.

    `where` names the flag or field (with its file) for the error message.
    """
    key = str(text).strip().lower().removeprefix("torch.")
    if key not in SPELLINGS:
        prefix = f"{where}: " if where else ""
        raise UserError(f"{prefix}unknown dtype {text!r}; known: {', '.join(SPELLINGS)}")
    return SPELLINGS[key]


def parse_dtype(text: str | torch.dtype, where: str = "") -> torch.dtype:
    """The torch dtype of `text` (any known spelling; a torch.dtype passes through)."""
    import torch

    if isinstance(text, torch.dtype):
        return text
    return getattr(torch, dtype_name(text, where))


def dtype_arg(text: str) -> str:
    """argparse `type=` of every dtype flag: the canonical name; argparse names the flag."""
    try:
        return dtype_name(text)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
