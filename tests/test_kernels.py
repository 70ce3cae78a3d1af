"""The kernels' PyTorch references against literal, loop-by-loop readings of their
spec, on the inputs every kernel test and benchmark draws (eagletools.kernels.cases)."""

from __future__ import annotations

import pytest
import torch

from eagletools.kernels import (
    compact_kv,
    compact_kv_reference,
    topk_d2t,
    topk_d2t_reference,
    tree_attention,
    tree_attention_reference,
    verify_greedy,
    verify_greedy_reference,
    verify_sampling,
    verify_sampling_reference,
)
from eagletools.kernels.cases import (
    attention_inputs,
    generator,
    greedy_inputs,
    random_d2t,
    sampling_inputs,
)


def naive_tree_attention(q, k_cache, v_cache, prefix_len, tree_mask, scale):
    b, hq, n, _ = q.shape
    group = hq // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            k = k_cache[bi, h // group, : prefix_len + n].double()
            v = v_cache[bi, h // group, : prefix_len + n].double()
            for i in range(n):
                visible = [True] * prefix_len + tree_mask[i].tolist()
                s = (k @ q[bi, h, i].double()) * scale
                s[~torch.tensor(visible)] = float("-inf")
                out[bi, h, i] = s.softmax(0) @ v
    return out


@pytest.mark.parametrize("b,hq,hkv,n,prefix,d", [(1, 4, 2, 1, 1, 8), (2, 6, 2, 7, 13, 16)])
def test_tree_attention_reference_matches_naive(b, hq, hkv, n, prefix, d):
    gen = generator("test_tree_attention_reference_matches_naive", b, hq, hkv, n, prefix, d)
    q, k, v, mask = attention_inputs(b, hq, hkv, n, prefix, d, torch.float32, gen)
    out = tree_attention_reference(q, k, v, prefix, mask, 0.3)
    torch.testing.assert_close(out, naive_tree_attention(q, k, v, prefix, mask, 0.3).float())
    torch.testing.assert_close(tree_attention(q, k, v, prefix, mask, 0.3), out)


def test_tree_attention_on_a_chain_is_causal_attention():
    """A chain tree is an ordinary continuation: causal attention over the sequence."""
    gen = generator("test_tree_attention_on_a_chain_is_causal_attention")
    q = torch.randn(1, 4, 5, 8, generator=gen)
    k = torch.randn(1, 4, 9, 8, generator=gen)
    v = torch.randn(1, 4, 9, 8, generator=gen)
    chain = torch.ones(5, 5, dtype=torch.bool).tril()
    out = tree_attention_reference(q, k, v, 4, chain, 8**-0.5)
    full_q = torch.cat([torch.zeros(1, 4, 4, 8), q], dim=2)
    causal = torch.nn.functional.scaled_dot_product_attention(full_q, k, v, is_causal=True)
    torch.testing.assert_close(out, causal[:, :, 4:])


def naive_greedy(tokens, parents, target_argmax):
    b, n = tokens.shape
    path = torch.full((b, n), -1)
    lens, bonus = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    for bi in range(b):
        cur, walked = 0, [0]
        while True:
            kids = [j for j in range(n) if parents[bi, j] == cur]
            hit = [j for j in kids if tokens[bi, j] == target_argmax[bi, cur]]
            if not hit:
                break
            cur = hit[0]
            walked.append(cur)
        path[bi, : len(walked)] = torch.tensor(walked)
        lens[bi], bonus[bi] = len(walked) - 1, target_argmax[bi, cur]
    return path, lens, bonus


@pytest.mark.parametrize("b,n,vocab", [(1, 1, 5), (3, 2, 2), (8, 11, 4), (4, 33, 3)])
def test_verify_greedy_reference_matches_naive(b, n, vocab):
    gen = generator("test_verify_greedy_reference_matches_naive", b, n, vocab)
    tokens, parents, am = greedy_inputs(b, n, vocab, gen)
    got = verify_greedy_reference(tokens, parents, am)
    for g, w in zip(got, naive_greedy(tokens, parents, am), strict=True):
        assert torch.equal(g, w)
    for g, w in zip(verify_greedy(tokens, parents, am), got, strict=True):
        assert torch.equal(g, w)


def test_verify_greedy_takes_the_first_of_duplicate_children():
    tokens = torch.tensor([[9, 5, 5, 7]])
    parents = torch.tensor([[-1, 0, 0, 2]])
    am = torch.tensor([[5, 1, 7, 3]])
    path, n_acc, bonus = verify_greedy_reference(tokens, parents, am)
    assert path.tolist() == [[0, 1, -1, -1]] and n_acc.item() == 1 and bonus.item() == 1


def test_topk_d2t_reference():
    gen = generator("test_topk_d2t_reference")
    logits = torch.randn(5, 37, generator=gen)
    d2t = random_d2t(37, 100, gen)
    lp, ids = topk_d2t_reference(logits, d2t, 4)
    want_lp, want = torch.sort(logits.double().log_softmax(-1), dim=-1, descending=True)
    torch.testing.assert_close(lp, want_lp[:, :4].float())
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, want[:, :4] + d2t[want[:, :4]])
    lp_id, ids_id = topk_d2t(logits.bfloat16(), None, 1)
    assert torch.equal(ids_id[:, 0], logits.bfloat16().argmax(-1))


def test_compact_kv_reference():
    gen = generator("test_compact_kv_reference")
    k = torch.randn(2, 3, 20, 4, generator=gen)
    v = torch.randn(2, 3, 20, 4, generator=gen)
    src = torch.tensor([[6, 7, 9, 12], [6, 8, -1, -1]])
    want_k, want_v = k.clone(), v.clone()
    for b in range(2):
        for i, s in enumerate(src[b].tolist()):
            if s >= 0:
                want_k[b, :, 6 + i] = k[b, :, s]
                want_v[b, :, 6 + i] = v[b, :, s]
    compact_kv_reference(k, v, src, 6)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    compact_kv(k, v, torch.tensor([[7], [6]]), 6)
    assert torch.equal(k[0, :, 6], want_k[0, :, 7]) and torch.equal(k[1, :, 6], want_k[1, :, 6])
    # every layer stacked [L,B,H,S,D]: each layer moves as its own cache would
    k, v = torch.randn(2, 3, 2, 3, 20, 4, generator=gen).unbind()
    want = [(k[i].clone(), v[i].clone()) for i in range(3)]
    for layer_k, layer_v in want:
        compact_kv_reference(layer_k, layer_v, src, 6)
    compact_kv_reference(k, v, src, 6)
    assert torch.equal(k, torch.stack([w[0] for w in want]))
    assert torch.equal(v, torch.stack([w[1] for w in want]))


def naive_sampling(tokens, parents, probs, uniforms):
    b, n = tokens.shape
    path = torch.full((b, n), -1)
    lens, nxt = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    for bi in range(b):
        cur, walked = 0, [0]
        while True:
            p = probs[bi, cur].double().clone()
            for j in range(n):
                if parents[bi, j] != cur:
                    continue
                x = tokens[bi, j]
                if uniforms[bi, j].double() * p.sum() < p[x]:
                    cur = j
                    break
                p[x] = 0.0
            else:
                break
            walked.append(cur)
        cdf = p.cumsum(0)
        nxt[bi] = int((cdf <= uniforms[bi, n].double() * cdf[-1]).sum())
        path[bi, : len(walked)] = torch.tensor(walked)
        lens[bi] = len(walked) - 1
    return path, lens, nxt


@pytest.mark.parametrize("b,n,vocab", [(1, 1, 7), (6, 5, 6), (5, 17, 11)])
def test_verify_sampling_reference_matches_naive(b, n, vocab):
    gen = generator("test_verify_sampling_reference_matches_naive", b, n, vocab)
    inputs = sampling_inputs(b, n, vocab, gen)
    got = verify_sampling_reference(*inputs)
    for g, w in zip(got, naive_sampling(*inputs), strict=True):
        assert torch.equal(g, w)
    for g, w in zip(verify_sampling(*inputs), got, strict=True):
        assert torch.equal(g, w)


def test_verify_sampling_is_lossless():
    """The first emitted token follows the target distribution at the root,
    whatever the drafts (here with a duplicate child and a zero-probability one)."""
    gen = generator("test_verify_sampling_is_lossless")
    trials, vocab = 40000, 6
    tokens = torch.tensor([0, 2, 2, 5, 1, 3]).expand(trials, 6)
    parents = torch.tensor([-1, 0, 0, 0, 1, 0]).expand(trials, 6)
    p_root = torch.tensor([0.1, 0.05, 0.4, 0.3, 0.15, 0.0])
    probs = torch.softmax(torch.randn(6, vocab, generator=gen), -1)
    probs[0] = p_root
    probs = probs.expand(trials, 6, vocab)
    path, n_acc, nxt = verify_sampling_reference(
        tokens, parents, probs, torch.rand(trials, 7, generator=gen)
    )
    first_node = path[:, 1].clamp(min=0)
    first = torch.where(n_acc > 0, tokens.gather(1, first_node[:, None]).squeeze(1), nxt)
    freq = torch.bincount(first, minlength=vocab).double() / trials
    sigma = (p_root * (1 - p_root) / trials).sqrt()
    assert (freq - p_root).abs().le(5 * sigma + 1e-9).all(), (freq, p_root)
    assert freq[5] == 0
