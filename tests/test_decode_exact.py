"""bf16 losslessness: a tree verify computes each path token's logits bit for bit as
plain one-token decoding does (batch-invariant attention, `decode.model.attention`)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import smollm2_shaped

from eagletools.cpu_ops import PackedLinear
from eagletools.decode.model import Transformer
from eagletools.decode.tree import ancestor_mask


@pytest.fixture(scope="module")
def runtime():
    # SmolLM2's attention shape (head_dim 64, 3 query heads per KV head), narrower
    model = smollm2_shaped(
        hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=256
    )
    return Transformer.from_hf(model, torch.bfloat16)


def random_tree(rng: random.Random, n: int) -> tuple[torch.Tensor, list[int]]:
    """(parents [n], the root-to-leaf path ending at the last node)."""
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    path, node = [], n - 1
    while node >= 0:
        path.append(node)
        node = parents[node]
    return torch.tensor(parents), path[::-1]


def path_mismatches(runtime: Transformer, seed: int, trials: int, forward=None) -> int:
    """Trees whose path logits differ from one-token decoding of the same tokens;
    `forward` (default: the runtime) runs both, the prefix the runtime itself."""
    forward = forward or runtime
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab = runtime.args.vocab_size
    runtime.setup_caches(1, 768)
    bad = 0
    for _ in range(trials):
        start, n = rng.randrange(20, 600), 16
        parents, path = random_tree(rng, n)
        mask = ancestor_mask(parents)
        tokens = torch.randint(0, vocab, (n,), generator=g)
        runtime(torch.randint(0, vocab, (1, start), generator=g), torch.arange(start), 0)
        one_by_one = torch.stack(
            [
                forward(tokens[node].view(1, 1), torch.tensor([start + d]), start + d)[0][0, -1]
                for d, node in enumerate(path)
            ]
        )
        tree, _ = forward(tokens[None], start + mask.sum(1) - 1, start, mask)
        bad += not torch.equal(tree[0, path], one_by_one)
    return bad


@torch.inference_mode()
def test_tree_verify_equals_one_token_decoding_in_bf16(runtime):
    """The check can fail: with fp32 attention sums (`set_exact(False)`) it found
    mismatching trees here on this machine's CPU (and 4 of 12 trees of the real
    SmolLM2); another CPU's kernels may happen to agree, so that control is
    not a test."""
    runtime.set_exact(True)
    assert path_mismatches(runtime, seed=0, trials=24) == 0


@torch.inference_mode()
def test_switching_numerics_converts_the_v_cache_and_keeps_its_values(runtime):
    """Exact attention keeps V in float64 (no per-step conversion), fast attention in
    float32; a switch mid-conversation converts the cache once, losing nothing."""
    runtime.set_exact(True)
    runtime.setup_caches(1, 64)
    runtime(torch.arange(10)[None], torch.arange(10), 0)
    v = runtime.kv_cache.v.clone()
    assert v.dtype == torch.float64 and v.abs().sum() > 0
    runtime.set_exact(False)
    assert runtime.kv_cache.v.dtype == torch.float32
    assert torch.equal(runtime.kv_cache.v.double(), v)  # bf16 values: exact in both
    runtime.set_exact(True)
    assert torch.equal(runtime.kv_cache.v, v)


def test_switching_numerics_switches_every_linear(runtime):
    """Lone rows run as pairs (`cpu_ops.packed_linear`) under exact numerics only."""
    linears = [m for m in runtime.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * len(runtime.layers) + 1
    runtime.set_exact(False)
    assert not any(m.invariant for m in linears)
    runtime.set_exact(True)
    assert all(m.invariant for m in linears)


@pytest.mark.parametrize("keys", [37, 300, 513])
def test_a_lone_query_gets_the_bits_it_gets_among_others(keys):
    """Exact attention is batch-invariant at one query too: on an EPYC (Zen 4) a
    lone query's fp32 score product took another GEMM kernel and rounded apart
    (`make demo` then matched plain decoding on 0 of 5 MT-bench prompts)."""
    from eagletools.decode.model import attention

    g = torch.Generator().manual_seed(keys)
    q = torch.randn(2, 9, 24, 64, generator=g).bfloat16()
    k = torch.randn(2, 3, keys, 64, generator=g).bfloat16()
    v = torch.randn(2, 3, keys, 64, generator=g).bfloat16().double()
    mask = torch.rand(24, keys, generator=g) < 0.9
    together = attention(q, k, v, mask)
    for i in range(24):
        alone = attention(q[:, :, i : i + 1], k, v, mask[i : i + 1])
        assert torch.equal(alone, together[:, :, i : i + 1]), f"query {i}"
    rows = mask[None, :5].expand(2, 5, keys)  # a left-padded batch's per-row masks
    assert torch.equal(
        attention(q[:, :, :1], k, v, rows[:, :1]), attention(q[:, :, :5], k, v, rows)[:, :, :1]
    )
