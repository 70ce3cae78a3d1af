"""One dtype parser: both spellings everywhere, and an error that lists the known ones."""

from __future__ import annotations

import pytest
import torch

from eagletools.dtypes import SPELLINGS, dtype_name, parse_dtype
from eagletools.errors import UserError


@pytest.mark.parametrize(
    "text, dtype",
    [
        ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
        ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
        ("fp32", torch.float32), ("float32", torch.float32), ("float", torch.float32),
        ("torch.bfloat16", torch.bfloat16), (torch.float16, torch.float16),
    ],
)  # fmt: skip
def test_parse_dtype_spellings(text, dtype):
    assert parse_dtype(text) is dtype


def test_unknown_dtype_names_where_and_lists_known():
    with pytest.raises(UserError) as err:
        dtype_name("bf17", "--dtype")
    message = str(err.value)
    assert message.startswith("--dtype: unknown dtype 'bf17'")
    assert all(spelling in message for spelling in SPELLINGS)
