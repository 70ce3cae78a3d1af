"""Each Triton kernel against its reference: in the interpreter on CPU, or
compiled on a GPU with EAGLETOOLS_KERNEL_TEST_DEVICE=cuda (benchmarks/kernel_bench.py --check).

Inputs are drawn per test; outputs are poisoned (NaN / a sentinel) before each
run so a kernel that skips an element fails. Tolerances: fp32 1e-5 relative,
bf16 1e-2, integers exact.
"""

# ruff: noqa: E402  (TRITON_INTERPRET must be set before the imports below)
from __future__ import annotations

import os
import subprocess
import sys

DEVICE = os.environ.get("EAGLETOOLS_KERNEL_TEST_DEVICE", "cpu")
# Triton reads TRITON_INTERPRET when it is imported. eagletools.kernels never
# imports it before a launch, so this holds unless another test imported
# Triton first; then this file runs again in a fresh process.
TRITON_ALREADY_COMPILING = (
    DEVICE == "cpu" and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
)
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from eagletools.kernels import (
    attention,
    compact_kv,
    topk_d2t,
    tree_attention,
    verify_greedy,
    verify_sampling,
)
from eagletools.kernels.attention import tree_attention_reference, tree_attention_triton
from eagletools.kernels.cases import (
    attention_inputs,
    compact_inputs,
    generator,
    greedy_inputs,
    poisoned,
    random_d2t,
    sampling_inputs,
)
from eagletools.kernels.dispatch import use_triton
from eagletools.kernels.draft_topk import topk_d2t_reference, topk_d2t_triton
from eagletools.kernels.greedy_verify import verify_greedy_reference, verify_greedy_triton
from eagletools.kernels.kv_compact import compact_kv_reference, compact_kv_triton
from eagletools.kernels.sampling_verify import verify_sampling_reference, verify_sampling_triton

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.fixture(autouse=True)
def _interpreter_in_this_process(request):
    if TRITON_ALREADY_COMPILING and request.node.name != "test_kernels_in_a_fresh_process":
        pytest.skip("Triton was imported without its interpreter: run in a fresh process")


def on_device(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def assert_same_ints(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


@pytest.mark.parametrize(
    "b,hq,hkv,n,prefix,d,dtype",
    [
        (1, 2, 1, 1, 1, 16, torch.float32),  # one node, prefix of one
        (2, 6, 2, 7, 13, 24, torch.float32),  # head_dim and sizes not powers of two
        (1, 8, 2, 19, 70, 32, torch.float32),  # 4 heads x 19 nodes span two row blocks
        (1, 4, 4, 33, 100, 64, torch.bfloat16),
        (2, 4, 1, 5, 1, 128, torch.bfloat16),
        (1, 4, 1, 128, 3, 16, torch.float32),  # the largest tree: 512 rows, 8 row blocks
        (1, 4, 1, 60, 100, 16, torch.float32),  # 3 key splits: the last holds only tree nodes
    ],
)
def test_tree_attention(b, hq, hkv, n, prefix, d, dtype):
    check_tree_attention(b, hq, hkv, n, prefix, d, dtype)


@pytest.mark.parametrize("arch", [80, 90, 120])
def test_tree_attention_with_each_archs_tiles(arch, monkeypatch):
    """The tiles `tree_attention_triton` picks on each GPU (sm_90: 64 bf16 keys a step)."""
    monkeypatch.setattr(attention, "target_arch", lambda: arch)
    check_tree_attention(1, 8, 2, 33, 100, 64, torch.bfloat16)


def check_tree_attention(b, hq, hkv, n, prefix, d, dtype):
    gen = generator("test_tree_attention", b, hq, hkv, n, prefix, d, dtype)
    q, k, v, mask = on_device(*attention_inputs(b, hq, hkv, n, prefix, d, dtype, gen))
    (out,) = poisoned(q)
    got = tree_attention_triton(q, k, v, prefix, mask, d**-0.5, out=out)
    assert got is out
    want = tree_attention_reference(q, k, v, prefix, mask, d**-0.5)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(tree_attention(q, k, v, prefix, mask, d**-0.5), want, **TOL[dtype])
    (prefix_on_device,) = on_device(torch.tensor(prefix))  # as a CUDA graph passes it
    got = tree_attention_triton(q, k, v, prefix_on_device, mask, d**-0.5, out=poisoned(q)[0])
    torch.testing.assert_close(got, want, **TOL[dtype])
    # keys split over programs (as on a GPU with idle SMs), merged by a second launch
    for prefix_arg in (prefix, prefix_on_device):
        got = tree_attention_triton(q, k, v, prefix_arg, mask, d**-0.5, poisoned(q)[0], 3)
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("b,n,vocab", [(1, 1, 5), (3, 2, 2), (8, 11, 4), (4, 33, 3), (2, 64, 3)])
def test_verify_greedy(b, n, vocab):
    gen = generator("test_verify_greedy", b, n, vocab)
    tokens, parents, am = on_device(*greedy_inputs(b, n, vocab, gen))
    want = verify_greedy_reference(tokens, parents, am)
    got = verify_greedy_triton(tokens, parents, am, out=poisoned(*want))
    assert_same_ints(got, want)
    assert_same_ints(verify_greedy(tokens, parents, am), want)


def distinct_logits(m: int, v: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """Logits without ties, so the top-k order (and so the ids) is unique."""
    pool = torch.linspace(-8, 8, 400_001).to(dtype).unique()
    assert len(pool) >= v
    rows = [pool[torch.randperm(len(pool), generator=gen)[:v]] for _ in range(m)]
    return torch.stack(rows)


@pytest.mark.parametrize(
    "m,v,k,dtype,with_d2t",
    [
        (1, 1, 1, torch.float32, True),
        (3, 37, 5, torch.float32, True),
        (2, 50, 10, torch.float32, True),  # k not a power of two
        (4, 5003, 3, torch.float32, True),  # two blocks of 4096
        (2, 1000, 8, torch.bfloat16, True),
        (5, 300, 1, torch.bfloat16, False),  # argmax, identity vocab
    ],
)
def test_topk_d2t(m, v, k, dtype, with_d2t):
    gen = generator("test_topk_d2t", m, v, k, dtype, with_d2t)
    logits = distinct_logits(m, v, dtype, gen)
    d2t = random_d2t(v, 4 * v, gen) if with_d2t else None
    logits, d2t = on_device(logits, d2t)
    want = topk_d2t_reference(logits, d2t, k)
    got = topk_d2t_triton(logits, d2t, k, out=poisoned(*want))
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float32])
    assert_same_ints(got[1:], want[1:])
    assert_same_ints(topk_d2t(logits, d2t, k)[1:], want[1:])


def test_topk_d2t_breaks_ties_by_lower_id():
    (logits,) = on_device(torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]]))
    _, ids = topk_d2t_triton(logits, None, 4)
    assert ids.tolist() == [[1, 3, 4, 2]]


@pytest.mark.parametrize(
    "layers,b,h,d,n,prefix,dtype",
    [
        ((), 1, 1, 1, 1, 1, torch.float32),
        ((), 2, 3, 24, 5, 7, torch.float32),
        ((), 3, 2, 128, 9, 40, torch.bfloat16),
        ((4,), 2, 3, 16, 6, 11, torch.float32),  # every layer's cache stacked: one launch
    ],
)
def test_compact_kv(layers, b, h, d, n, prefix, dtype):
    gen = generator("test_compact_kv", layers, b, h, d, n, prefix, dtype)
    tree = n + 6
    k, v, src = compact_inputs(b, h, d, n, prefix, tree, dtype, gen, layers)
    k[..., prefix + tree :, :] = float("nan")  # untouched slots must stay as they are
    k, v, src = on_device(k, v, src)
    want_k, want_v = k.clone(), v.clone()
    compact_kv_reference(want_k, want_v, src, prefix)
    got_k, got_v = k.clone(), v.clone()
    compact_kv_triton(got_k, got_v, src, prefix)
    assert torch.equal(got_k.nan_to_num(), want_k.nan_to_num()) and torch.equal(got_v, want_v)
    compact_kv(k, v, src, prefix)
    assert torch.equal(k.nan_to_num(), want_k.nan_to_num()) and torch.equal(v, want_v)


@pytest.mark.parametrize(
    "b,n,vocab,dtype",
    [
        (1, 1, 7, torch.float32),
        (6, 5, 6, torch.float32),  # tiny vocab: duplicate sibling tokens
        (5, 17, 1100, torch.float32),  # two vocab blocks of 1024
        (4, 9, 3000, torch.bfloat16),
    ],
)
def test_verify_sampling(b, n, vocab, dtype):
    gen = generator("test_verify_sampling", b, n, vocab, dtype)
    inputs = on_device(*sampling_inputs(b, n, vocab, gen, dtype))
    want = verify_sampling_reference(*inputs)
    got = verify_sampling_triton(*inputs, out=poisoned(*want))
    assert_same_ints(got, want)
    assert_same_ints(verify_sampling(*inputs), want)


def test_dispatch(monkeypatch):
    (t,) = on_device(torch.zeros(2))
    assert use_triton(t) == t.is_cuda
    assert not use_triton(t, torch.zeros(2))
    monkeypatch.setenv("EAGLETOOLS_KERNELS", "reference")
    assert not use_triton(t)


@pytest.mark.skipif(not TRITON_ALREADY_COMPILING, reason="the tests above ran in this process")
def test_kernels_in_a_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
