"""Kernel tests: Triton runs in its interpreter on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

# Read by triton.jit when a kernel is first launched (eagletools.kernels.dispatch.lazy_jit).
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded per test, so each test draws its own fixed inputs."""
    seed = sum(map(ord, request.node.nodeid)) % 2**31
    return torch.Generator().manual_seed(seed)
