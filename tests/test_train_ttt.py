"""Training-time test: the chunked attention against a dense reference, the
loss against a step-by-step dense unroll, memory, teacher and metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_draft_config

from eagletools.draft import Eagle3Draft
from eagletools.train.ttt import (
    StepStats,
    TTTModel,
    chain_lengths,
    simulated_acceptance_length,
    step_counts,
    summarize,
    teacher_targets,
    ttt_attention,
)


def dense_attention(q, k0, v0, diag_k, diag_v):
    """Keys [step0 | step1 | ... | stepj] with a causal block and j diagonals."""
    t = q.shape[2]
    keys = torch.cat([k0, *diag_k], dim=2)
    values = torch.cat([v0, *diag_v], dim=2)
    eye = torch.eye(t, dtype=torch.bool)
    mask = torch.cat([torch.ones(t, t, dtype=torch.bool).tril(), *[eye] * len(diag_k)], dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("chunk", [3, 8, 64])
@pytest.mark.parametrize("j", [0, 1, 3])
def test_ttt_attention_matches_dense_mask(chunk, j):
    torch.manual_seed(0)
    b, nh, nkv, t, hd = 2, 4, 2, 13, 8
    q = torch.randn(b, nh, t, hd, requires_grad=True)
    ks = [torch.randn(b, nkv, t, hd, requires_grad=True) for _ in range(j + 1)]
    vs = [torch.randn(b, nkv, t, hd, requires_grad=True) for _ in range(j + 1)]
    out = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], chunk=chunk)
    ref = dense_attention(q, ks[0], vs[0], ks[1:], vs[1:])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, *ks, *vs], grad)
    want = torch.autograd.grad(ref, [q, *ks, *vs], grad)
    for a, b_ in zip(got, want, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-5)


def tiny_draft(vocab=64, draft_vocab=32, seed=0, **flags) -> Eagle3Draft:
    torch.manual_seed(seed)
    config = tiny_draft_config(
        **flags,
        hidden_size=32,
        intermediate_size=64,
        head_dim=8,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=24,
        max_position_embeddings=512,
    )
    draft = Eagle3Draft(config)
    selected = torch.randperm(vocab)[:draft_vocab].sort().values
    with torch.no_grad():
        draft.d2t.copy_(selected - torch.arange(draft_vocab))
        draft.t2d.zero_()
        draft.t2d[selected] = True
        draft.embed_tokens.weight.normal_()
    return draft


def dense_unroll(draft, input_ids, aux, loss_mask, probs, argmax, steps, decay, train_oov=False):
    """Step-by-step reference: explicit shifted copies and a dense mask."""
    b, t = input_ids.shape
    c = draft.config
    if c.norm_before_fc:  # one RMSNorm over the whole concatenation, written out
        rms = aux.pow(2).mean(-1, keepdim=True).add(c.rms_norm_eps).rsqrt()
        aux = aux * rms * draft.input_norm.weight
    if c.fc_norm:  # EAGLE-3.1: each aux state through its own norm before fc
        chunks = aux.split(c.target_hidden_size, dim=-1)
        aux = torch.cat([n(x) for n, x in zip(draft.fc_norm, chunks, strict=True)], dim=-1)
    hidden = draft.fc(aux)
    layers = draft.draft_layers()
    ks, vs, loss = [[] for _ in layers], [[] for _ in layers], 0.0
    for j in range(steps):
        ids = torch.zeros_like(input_ids)
        ids[:, : t - 1 - j] = input_ids[:, 1 + j :]
        cos, sin = draft.rope(torch.arange(t) + j, hidden.dtype)
        out = None
        for i, layer in enumerate(layers):
            if i == 0:
                q, k, v, res = layer.qkv(draft.embed_tokens(ids), hidden, cos, sin)
            else:
                q, k, v, res = layer.qkv(out, cos, sin)
            ks[i].append(k)
            vs[i].append(v)
            attended = dense_attention(q, ks[i][0], vs[i][0], ks[i][1:], vs[i][1:])
            out = layer.finish(attended, res)
        logp = torch.log_softmax(draft.lm_head(draft.norm(out)), -1)
        hidden = draft.norm(out) if c.norm_output else out  # EAGLE-3.1 carries the normed one
        terms = []
        for bi in range(b):
            for pos in range(t):
                src = pos + 1 + j
                if pos + 2 + j >= t or not loss_mask[bi, pos + 2 + j]:
                    continue
                if not train_oov and not draft.t2d[argmax[bi, src]]:
                    terms.append(torch.zeros(()))
                    continue
                terms.append(-(probs[bi, src] * logp[bi, pos]).sum())
        count = max(len(terms), 1)
        loss = loss + decay**j * torch.stack(terms).sum() / count
    return loss


def batch(draft, b=2, t=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    vocab = draft.config.vocab_size
    input_ids = torch.randint(0, vocab, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * draft.config.target_hidden_size, generator=g)
    loss_mask = (torch.rand(b, t, generator=g) > 0.3).long()
    if b > 1:
        loss_mask[1, 9:] = 0  # a padded tail
    last_hidden = torch.randn(b, t, draft.config.target_hidden_size, generator=g)
    lm_head = torch.randn(vocab, draft.config.target_hidden_size, generator=g)
    probs, argmax = teacher_targets(last_hidden, lm_head, draft.d2t)
    return input_ids, aux, loss_mask, probs, argmax


def test_unroll_with_norm_before_fc_matches_dense_reference():
    draft = tiny_draft(norm_before_fc=True, norm_output=True)
    with torch.no_grad():  # away from 1, so that a missing or misplaced norm shows
        draft.input_norm.weight.uniform_(0.5, 2.0)
    inputs = batch(draft)
    loss, _ = TTTModel(draft, steps=3, decay=0.8, chunk=5)(*inputs)
    ref = dense_unroll(draft, *inputs, steps=3, decay=0.8)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(loss, [draft.input_norm.weight, draft.fc.weight])
    refs = torch.autograd.grad(ref, [draft.input_norm.weight, draft.fc.weight])
    for a, b_ in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layers", [1, 2], ids=["1-layer", "2-layers"])
@pytest.mark.parametrize("train_oov", [False, True], ids=["in-vocab", "train-oov"])
@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_unroll_matches_dense_reference(eagle31, train_oov, layers):
    draft = tiny_draft(fc_norm=eagle31, norm_output=eagle31, num_hidden_layers=layers)
    if eagle31:  # norm weights away from 1, so that a missing or misplaced norm shows
        with torch.no_grad():
            for p in [*draft.fc_norm.parameters(), draft.norm.weight]:
                p.uniform_(0.5, 2.0)
    inputs = batch(draft)
    model = TTTModel(draft, steps=4, decay=0.8, chunk=5, train_oov=train_oov)
    loss, stats = model(*inputs)
    ref = dense_unroll(draft, *inputs, steps=4, decay=0.8, train_oov=train_oov)
    # half the target vocab is outside the draft's: the two losses must differ
    assert not draft.t2d[inputs[4]].all()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    weights = [*draft.fc.parameters(), draft.lm_head.weight, draft.midlayer.mlp.up_proj.weight]
    weights += [layer.self_attn.q_proj.weight for layer in draft.later_layers()]
    grads = torch.autograd.grad(loss, weights)
    refs = torch.autograd.grad(ref, weights)
    for a, b_ in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-4)
    assert stats.count.sum(0).tolist() == step_counts(inputs[2], 4).tolist()
    assert stats.count.shape == (2, 4) and stats.count[0, 0] > stats.count[0, -1] > 0


def test_global_norm_splits_exactly():
    """Two half-batches with the joint count as norm sum to the whole batch's loss."""
    draft = tiny_draft()
    inputs = batch(draft)
    model = TTTModel(draft, steps=3, chunk=4)
    whole, _ = model(*inputs)
    norm = step_counts(inputs[2], 3)
    halves = sum(model(*(x[i : i + 1] for x in inputs), norm=norm)[0] for i in range(2))
    torch.testing.assert_close(halves, whole, atol=1e-6, rtol=1e-6)


def saved_numel(draft, t: int) -> int:
    """Elements kept alive for backward by one unroll at length t."""
    model = TTTModel(draft, steps=3, chunk=32)
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = model(*batch(draft, b=1, t=t))
    loss.backward()
    return sum(sizes)


@pytest.mark.parametrize("layers", [1, 2])
def test_memory_linear_in_length(layers):
    """A dense [T, T*j] score per step would make this ratio ~2.9, not 2; a second layer
    keeps it linear (its chunked attention too) and adds at most one layer's worth."""
    draft = tiny_draft(num_hidden_layers=layers)
    ratio = saved_numel(draft, 384) / saved_numel(draft, 192)
    assert ratio < 2.2, ratio
    if layers == 2:
        one = saved_numel(tiny_draft(), 384)
        assert saved_numel(draft, 384) < 2 * one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_teacher_allocates_one_distribution(dtype):
    """On a GPU the teacher is [N, Vd] fp32: 4 GB at 32k tokens x 32k draft ids, so the
    softmax (a chunk of rows at a time) must reuse it: at its peak it holds one fp32
    distribution, a chunk, and the bf16 product it is widened from."""
    from torch.profiler import ProfilerActivity, profile

    hidden, weight = torch.randn(4, 256, 16, dtype=dtype), torch.randn(3000, 16, dtype=dtype)
    d2t = torch.zeros(2048, dtype=torch.long)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        teacher_targets(hidden, weight, d2t, chunk_tokens=256, full_argmax=False)
    held = most = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        most = max(most, held)
    distribution = 4 * 256 * 2048 * 4
    assert most < distribution * (1.5 if dtype == torch.float32 else 1.75)  # + the bf16 product


def test_teacher_targets_restricted_and_full_argmax():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8)
    weight = torch.randn(20, 8)
    d2t = torch.tensor([0, 0, 2, 5])  # ids 0, 1, 4, 8
    probs, argmax = teacher_targets(hidden, weight, d2t, chunk_tokens=3)
    logits = hidden @ weight.T
    torch.testing.assert_close(probs, torch.softmax(logits[..., [0, 1, 4, 8]], -1))
    assert torch.equal(argmax, logits.argmax(-1))
    # without the full product: the same probs, the argmax over the draft vocab as ids
    same, inside = teacher_targets(hidden, weight, d2t, full_argmax=False)
    torch.testing.assert_close(same, probs)
    ids = torch.tensor([0, 1, 4, 8])
    assert torch.equal(inside, ids[logits[..., ids].argmax(-1)])
    in_vocab = torch.isin(argmax, ids)
    assert torch.equal(inside[in_vocab], argmax[in_vocab]) and not in_vocab.all()


def test_simulated_acceptance_and_summary():
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_acceptance_length([1.0] * 3) == 4.0
    # two samples; the per-step sums over both are loss (2, 3), hits (1, 2), counts (2, 4)
    stats = StepStats(
        loss_sum=torch.tensor([[2.0, 1.0], [0.0, 2.0]]),
        correct=torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
        count=torch.tensor([[1.0, 2.0], [1.0, 2.0]]),
        chain=torch.tensor([2.0, 1.0]),
    )
    out = summarize(stats, decay=0.5)
    assert out["acc_0"] == 0.5 and out["acc_1"] == 0.5
    assert out["loss"] == pytest.approx(1.0 + 0.5 * 0.75)
    assert out["simulated_acceptance_length"] == pytest.approx(1.75)
    assert out["exact_acceptance_length"] == pytest.approx(3 / 2)


def test_chain_lengths_by_hand():
    """Roots are step-0 positions; a chain counts its tokens until the first miss."""
    hits = [
        torch.tensor([[1, 1, 0, 1]]),
        torch.tensor([[1, 0, 1, 1]]),
        torch.tensor([[0, 1, 1, 1]]),
    ]
    masks = [
        torch.tensor([[1, 1, 1, 0]]),
        torch.tensor([[1, 1, 1, 0]]),
        torch.tensor([[1, 1, 0, 0]]),
    ]
    # t=0: hits 1,1,0 -> 3; t=1: 1,0 -> 2; t=2: 0 -> 1; t=3: no root
    assert chain_lengths(hits, masks).tolist() == [6.0]
    # t=2 hits at steps 1 and 2 do not count after its step-0 miss; the mask ends t=1's
    # chain at step 2 although its hit is 1
    hits[0][0, 2], masks[2][0, 1] = 1, 0
    assert chain_lengths(hits, masks).tolist() == [3 + 2 + 3]


def test_exact_length_of_one_step_is_one_plus_its_accuracy():
    """With one step, the chain is 1 + hit, so exact and simulated agree."""
    draft = tiny_draft()
    _, stats = TTTModel(draft, steps=1)(*batch(draft))
    out = summarize(stats, decay=0.8)
    assert out["exact_acceptance_length"] == pytest.approx(1 + out["acc_0"])
    _, stats = TTTModel(draft, steps=4)(*batch(draft))
    out = summarize(stats, decay=0.8)
    assert 1 <= out["exact_acceptance_length"] <= 5


def test_perfect_teacher_gives_full_acceptance():
    """If the draft's head reproduces the teacher exactly, acc_j must be 1."""
    draft = tiny_draft(vocab=32, draft_vocab=32)
    with torch.no_grad():
        draft.d2t.zero_()
        draft.t2d.fill_(True)
    input_ids, aux, loss_mask, _, _ = batch(draft)
    with torch.no_grad():
        model = TTTModel(draft, steps=3)
        # teacher = the draft's own argmax at each step: run once to read them
        logits = []
        draft.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out))
        uniform = torch.full((*input_ids.shape, 32), 1 / 32)
        model(input_ids, aux, loss_mask, uniform, torch.zeros_like(input_ids))
    # step 0's argmax at position t is the teacher at t+1
    argmax = torch.zeros_like(input_ids)
    argmax[:, 1:] = logits[0].argmax(-1)[:, :-1]
    with torch.no_grad():
        _, stats = model(input_ids, aux, loss_mask, uniform, argmax)
    assert stats.correct[:, 0].sum() == stats.count[:, 0].sum() > 0
