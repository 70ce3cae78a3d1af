"""Speculative decoding is lossless: greedy token equality, sampling distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from eagletools.decode.engine import BaselineDecoder, SpeculativeDecoder
from eagletools.decode.model import Transformer
from eagletools.decode.sampling import Sampling
from eagletools.draft import Eagle3Draft
from eagletools.errors import UserError

V = 384  # a byte tokenizer needs 259 ids


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: two threads spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def repeat_draft(model, layers: int = 1) -> Eagle3Draft:
    """A draft that proposes the target's own last prediction again.

    fc passes the target's final state (aux id N, after its norm) through, the
    layers add nothing, and the draft's norm (the target's: ones in a tiny
    random target) leaves a normed state as it is, so the draft's logits are
    the target's: accepted exactly when the target repeats a token, which tiny
    random targets often do.
    """
    n = model.config.num_hidden_layers
    draft = Eagle3Draft.from_target(model, aux_layer_ids=[n, n, n], num_hidden_layers=layers)
    h = draft.config.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :h] = torch.eye(h)
        for layer in (draft.midlayer, *draft.later_layers()):
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return draft


def random_draft(model, seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    n = model.config.num_hidden_layers
    return Eagle3Draft.from_target(model, aux_layer_ids=[1, n // 2, n - 1])


@pytest.mark.parametrize("shape", [(1, 4, 5), (4, 3, 12), (8, 4, 40)])
def test_greedy_speculative_equals_baseline(family, shape, tokenizer):
    model = tiny_model(family, seed=3, vocab_size=V)
    runtime = Transformer.from_hf(model)
    baseline = BaselineDecoder(runtime, tokenizer)
    prompts = [list(range(10, 40)), [5, 9, 200, 17, 3, 250]]
    expected = [baseline.generate(p, 48).tokens for p in prompts]
    drafts = [(repeat_draft(model), True), (random_draft(model), False)]
    drafts.append((repeat_draft(model, layers=2), True))  # a K/V cache entry per layer
    for draft, accepts in drafts:
        spec = SpeculativeDecoder(runtime, draft, tokenizer, *shape)
        results = [spec.generate(p, 48) for p in prompts]
        assert [r.tokens for r in results] == expected
        if accepts:  # the tree paths, compaction and draft refresh were exercised
            assert max(r.tau for r in results) > 1.25


def test_only_paths_off_their_slots_are_compacted(monkeypatch, tokenizer):
    """A chain's accepted nodes already sit in their slots: its steps skip the KV
    compaction (2.3% of a SmolLM2 chain-1 step); a wider tree's paths move."""
    from eagletools.decode.model import KVCache

    moves = []
    compact = KVCache.compact
    monkeypatch.setattr(KVCache, "compact", lambda cache, *a: moves.append(a) or compact(cache, *a))
    model = tiny_model("llama", seed=3, vocab_size=V)
    runtime = Transformer.from_hf(model)
    prompt = list(range(10, 40))
    expected = BaselineDecoder(runtime, tokenizer).generate(prompt, 48).tokens
    for shape, compacts in (((1, 4, 5), False), ((4, 3, 12), True)):
        moves.clear()
        out = SpeculativeDecoder(runtime, repeat_draft(model), tokenizer, *shape).generate(
            prompt, 48
        )
        assert out.tokens == expected and out.tau > 1.25
        assert bool(moves) == compacts, shape


def test_multi_turn_reuses_the_cache(tokenizer):
    model = tiny_model("llama", seed=4, vocab_size=V)
    runtime = Transformer.from_hf(model)
    spec = SpeculativeDecoder(runtime, repeat_draft(model), tokenizer, 4, 3, 10)
    turn1 = list(range(20, 50))
    first = spec.generate(turn1, 20)
    turn2 = turn1 + first.tokens + list(range(60, 70))
    second = spec.generate(turn2, 20)
    assert first.reused_tokens == 0
    assert second.reused_tokens >= len(turn1)
    fresh_runtime = Transformer.from_hf(model)
    fresh = BaselineDecoder(fresh_runtime, tokenizer).generate(turn2, 20)
    assert second.tokens == fresh.tokens
    # a different conversation reuses only the common prefix
    third = spec.generate(turn1[:10] + [1, 2, 3], 5)
    assert third.reused_tokens <= 9
    # decoders sharing one runtime never reuse each other's cache
    baseline = BaselineDecoder(runtime, tokenizer)
    assert baseline.generate(turn2, 20).tokens == fresh.tokens
    again = spec.generate(turn2, 20)
    assert again.reused_tokens == 0 and again.tokens == fresh.tokens


def test_stops_on_eos_stop_string_and_max_tokens(tokenizer):
    model = tiny_model("qwen3", seed=5, vocab_size=V)
    runtime = Transformer.from_hf(model)
    prompt = list(range(30, 60))
    for decoder in (
        BaselineDecoder(runtime, tokenizer),
        SpeculativeDecoder(runtime, repeat_draft(model), tokenizer, 4, 4, 16),
    ):
        decoder.session.eos_ids = set()
        full = decoder.generate(prompt, 40)
        assert full.stop_reason == "max_tokens" and len(full.tokens) == 40
        eos = full.tokens[7]
        decoder.session.eos_ids = {eos}
        cut = decoder.generate(prompt, 40)
        first = full.tokens.index(eos)
        assert cut.stop_reason == "eos" and cut.tokens == full.tokens[: first + 1]
        decoder.session.eos_ids = set()
        stop = full.text[10:13]
        streamed = []
        cut = decoder.generate(prompt, 40, stop_strings=[stop], on_text=streamed.append)
        assert cut.stop_reason == "stop_string"
        assert cut.text == full.text[: full.text.find(stop)]
        assert "".join(streamed) == cut.text
        assert stop in tokenizer.decode(cut.tokens) and stop not in tokenizer.decode(
            cut.tokens[:-1]
        )


def test_stops_when_the_context_is_full(tokenizer):
    model = tiny_model("mistral", seed=7, vocab_size=V)
    runtime = Transformer.from_hf(model)
    prompt = list(range(40, 70))
    for decoder in (
        BaselineDecoder(runtime, tokenizer, max_seq_len=40),
        SpeculativeDecoder(runtime, random_draft(model), tokenizer, 2, 2, 4, max_seq_len=40),
    ):
        decoder.session.eos_ids = set()
        r = decoder.generate(prompt, 30)
        assert r.stop_reason == "context"
        assert len(prompt) + len(r.tokens) <= 40 + 1  # the last token needs no cache slot


def _exact_first_tokens(model, prompt, sampling, n=3):
    """The target's distribution over its first n sampled tokens, by enumeration."""
    v = model.config.vocab_size
    seqs = torch.tensor([prompt])
    probs = torch.ones(1)
    for _ in range(n):
        p = sampling.probs(model(seqs).logits[:, -1])  # [S, V]
        probs = (probs[:, None] * p).flatten()
        seqs = torch.cat(
            [seqs.repeat_interleave(v, 0), torch.arange(v).repeat(len(seqs))[:, None]], 1
        )
    return probs  # index = x1 * v^2 + x2 * v + x3


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs - exp)[keep] ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution():
    model = tiny_model("llama", seed=6, vocab_size=12, hidden_size=32, num_hidden_layers=3)
    with torch.no_grad():  # sharper than a random init: ~40 outcomes carry 90% of the mass
        model.lm_head.weight.mul_(12)
    runtime = Transformer.from_hf(model)
    prompt = [3, 1, 4, 1, 5]
    sampling = Sampling(temperature=0.7, top_p=0.9)
    with torch.no_grad():
        exact = _exact_first_tokens(model, prompt, sampling)
    draft = random_draft(model, seed=1)
    spec = SpeculativeDecoder(runtime, draft, None, topk=3, depth=3, num_draft_tokens=8)
    spec.session.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(exact)
    accepted = []
    for _ in range(1500):
        r = spec.generate(prompt, 3, sampling=sampling, generator=g)
        x1, x2, x3 = r.tokens
        counts[x1 * 144 + x2 * 12 + x3] += 1
        accepted += r.accepted
    assert 0 in accepted and max(accepted) >= 1  # both rejection and acceptance happened
    assert _chi_square_p(counts, exact) > 0.01
    # the test has power: the same samples reject a slightly different temperature
    with torch.no_grad():
        other = _exact_first_tokens(model, prompt, Sampling(temperature=0.9, top_p=0.9))
    assert _chi_square_p(counts, other) < 1e-3


def test_sampling_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    p = Sampling(temperature=1.0, top_k=3).probs(logits)
    assert (p[0, 3:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    p = Sampling(temperature=1.0, top_p=0.8).probs(logits)[0]
    kept = int((p > 0).sum())  # smallest prefix whose mass reaches 0.8
    assert full[: kept - 1].sum() < 0.8 <= full[:kept].sum()
    with pytest.raises(UserError, match="top-p"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(TypeError):  # regeneration's old order (max_new_tokens first) fails
        Sampling(512, 0.7, 1.0, 0)


def test_another_cache_writer_invalidates_the_decoders_prefix(tokenizer):
    """No pointer from the runtime to a decoder: a writer takes a new cache version, and a
    decoder reuses its prefix only while the runtime still holds the version it took."""
    model = tiny_model("llama", seed=4, vocab_size=V)
    runtime = Transformer.from_hf(model)
    spec = SpeculativeDecoder(runtime, repeat_draft(model), tokenizer, 2, 3, 6)
    turn = list(range(20, 50))
    first = spec.generate(turn, 8)
    assert spec.generate(turn, 8).reused_tokens > 0
    runtime.setup_caches(1, runtime.cache_len)  # same shape: the cache object stays
    again = spec.generate(turn, 8)
    assert again.reused_tokens == 0 and again.tokens == first.tokens


def test_bad_inputs(tokenizer):
    model = tiny_model("llama", vocab_size=V)
    runtime = Transformer.from_hf(model)
    other = tiny_model("llama", vocab_size=V, hidden_size=32)
    with pytest.raises(UserError, match="hidden_size 32 != target hidden_size 64"):
        SpeculativeDecoder(runtime, random_draft(other), tokenizer)
    wrong_vocab = tiny_model("llama", vocab_size=300)
    with pytest.raises(UserError, match="vocab_size 300 != target vocab_size 384"):
        SpeculativeDecoder(runtime, random_draft(wrong_vocab), tokenizer)
    with pytest.raises(UserError, match="--num-draft-tokens 64"):
        SpeculativeDecoder(runtime, random_draft(model), tokenizer, 2, 3, 64)
    spec = SpeculativeDecoder(runtime, random_draft(model), tokenizer, 2, 3, 8)
    with pytest.raises(UserError, match="empty"):
        spec.generate([], 5)
    with pytest.raises(UserError, match="prompt has 600 tokens but the context holds 512"):
        spec.generate([5] * 600, 5)


@pytest.mark.integration
@pytest.mark.slow
def test_smollm2_greedy_lossless_and_equal_to_hf():
    """fp32: speculative == our baseline == HF generate on two MT-bench first turns."""
    from eagletools.eval.questions import load_benchmark
    from eagletools.eval.runner import chat_ids
    from eagletools.targets import load_target

    target = load_target("smollm2-135m", dtype=torch.float32)
    runtime = Transformer.from_hf(target.model)
    baseline = BaselineDecoder(runtime, target.tokenizer, max_seq_len=1024)
    spec = SpeculativeDecoder(runtime, random_draft(target.model), target.tokenizer, 4, 4, 12)
    eos = sorted(baseline.session.eos_ids)
    for question in load_benchmark("mt-bench", num_prompts=2):
        ids = chat_ids(target.tokenizer, [{"role": "user", "content": question.turns[0]}])
        expected = baseline.generate(ids, 32).tokens
        assert spec.generate(ids, 32).tokens == expected
        hf = target.model.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos
        )
        assert hf[0, len(ids) :].tolist() == expected


def test_kv_cache_holds_the_run_not_the_context(tokenizer):
    """A target whose config says 131,072 positions (Llama-3.1) gets K/V for prompt +
    new tokens + tree, grown when a conversation needs more, never the whole context."""
    from conftest import llama31_model

    from eagletools.decode.model import CACHE_BLOCK

    model = llama31_model(seed=8, vocab_size=V)
    runtime = Transformer.from_hf(model)
    spec = SpeculativeDecoder(runtime, repeat_draft(model), tokenizer, 2, 3, 6)

    def slots():
        cache = runtime.kv_cache
        # CPU: what exact attention computes in, so no step converts the cache
        assert (cache.k.dtype, cache.v.dtype) == (torch.float32, torch.float64)
        return {t.shape[3] for t in (cache.k, cache.v)}, spec.cache.k.shape[-2]

    turn1 = list(range(20, 60))
    first = spec.generate(turn1, 16)
    assert slots() == ({CACHE_BLOCK}, CACHE_BLOCK + spec.tree_slots)  # 40 + 16 + 7 needed
    turn2 = turn1 + first.tokens + list(range(60, 380))  # a longer second turn
    second = spec.generate(turn2, 16)
    assert second.reused_tokens >= len(turn1)  # grown with its contents kept
    assert slots() == ({2 * CACHE_BLOCK}, 2 * CACHE_BLOCK + spec.tree_slots)
    fresh = BaselineDecoder(Transformer.from_hf(model), tokenizer).generate(turn2, 16)
    assert second.tokens == fresh.tokens


def test_a_speculative_step_waits_on_the_device_once():
    """One host read per step, the new tokens: on CUDA the rest of the step stays queued
    (counted at the dispatcher on CPU, where every op would be a sync there)."""
    from test_decode_tree import HostReads, ToList

    model = tiny_model("llama", seed=3, vocab_size=V)
    spec = SpeculativeDecoder(Transformer.from_hf(model), repeat_draft(model), None, 4, 3, 12)
    reads, step = [], spec._step

    def counted(*args):
        with HostReads() as seen, ToList(seen.seen):
            out = step(*args)
        reads.append(seen.seen)
        return out

    spec._step = counted
    result = spec.generate(list(range(10, 40)), 32)
    assert len(reads) == result.steps >= 4 and max(result.accepted) > 0
    assert all(seen == ["tolist"] for seen in reads), reads


@torch.inference_mode()
def _refresh(spec: SpeculativeDecoder, aux, tokens, start: int) -> list[torch.Tensor]:
    """The draft's refresh: logits, hidden and the cache entries it wrote, one row per token."""
    logits, hidden = spec._refresh(aux, tokens, start)
    written = [  # layer 0, batch row 0: [n, nkv, hd]
        c[0, 0, :, start : start + len(tokens)].transpose(0, 1)
        for c in (spec.cache.k, spec.cache.v)
    ]
    return [logits, hidden, *(t.clone() for t in written)]


def test_padded_refresh_keeps_the_real_rows():
    """The draft's refresh runs depth + 1 rows whatever was accepted: the rows after
    the real ones change nothing in them. bf16 (packed products of up to 32 rows do
    not depend on the row count) equals the unpadded refresh bit for bit; fp32 CPU
    products round by row count, so there the padding's contents are what must not
    matter, bit for bit, and the unpadded refresh agrees to rounding."""
    from eagletools.cpu_ops import packing_available

    model = tiny_model("llama", seed=3, vocab_size=V)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        spec = SpeculativeDecoder(
            Transformer.from_hf(model, dtype=dtype), random_draft(model), None, 4, 5, 16
        )
        spec.generate(list(range(10, 40)), 8)
        start, rows = spec.session.last.draft_len, spec.path_rows
        aux = torch.randn(rows, 3 * 64, generator=g).to(dtype)
        tokens = torch.randint(0, V, (rows,), generator=g)
        for n in range(1, rows):
            padded = [t[:n] for t in _refresh(spec, aux, tokens, start)]
            other_tokens = torch.cat([tokens[:n], (tokens[n:] + 1) % V])
            other = _refresh(spec, torch.cat([aux[:n], -aux[n:]]), other_tokens, start)
            assert all(torch.equal(a, b[:n]) for a, b in zip(padded, other, strict=True))
            unpadded = _refresh(spec, aux[:n], tokens[:n], start)
            if dtype == torch.bfloat16 and packing_available():
                assert all(map(torch.equal, padded, unpadded))
            for a, b in zip(padded, unpadded, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_cuda_graphs_only_on_cuda():
    from eagletools.decode.graphs import StaticCall, graphed

    def fn():
        return ()

    assert graphed(fn, torch.device("cpu"), tuple) is fn
    assert isinstance(graphed(fn, torch.device("cuda"), tuple), StaticCall)  # captures when called
    model = tiny_model("llama", vocab_size=V)
    spec = SpeculativeDecoder(Transformer.from_hf(model), random_draft(model), None, 2, 3, 6)
    assert spec.verify_forward == spec._verify_forward and spec.refresh == spec._refresh


def test_the_graph_path_short_of_capture_equals_the_baseline(tokenizer):
    """What a CUDA graph replays, eagerly on CPU: the start as a device tensor, attention over
    the whole cache under a mask, inputs and outputs in static tensors reused across steps,
    set up again when the cache grows."""
    from eagletools.decode.graphs import StaticCall

    model = tiny_model("llama", seed=3, vocab_size=V)
    runtime = Transformer.from_hf(model)
    spec = SpeculativeDecoder(runtime, repeat_draft(model), tokenizer, 2, 3, 6)
    cpu = torch.device("cpu")
    for name in ("verify_forward", "refresh"):
        call = StaticCall(getattr(spec, f"_{name}"), cpu, spec._caches, capture=False)
        setattr(spec, name, call)
    turn1 = list(range(20, 60))
    first = spec.generate(turn1, 16)
    turn2 = turn1 + first.tokens + list(range(60, 380))  # grows the caches
    second = spec.generate(turn2, 16)
    assert spec.verify_forward.key[0][0] == runtime.kv_cache.k.data_ptr()  # set up again
    assert sum(first.accepted) > 0 and second.reused_tokens >= len(turn1)
    baseline = BaselineDecoder(Transformer.from_hf(model), tokenizer)
    assert first.tokens == baseline.generate(turn1, 16).tokens
    assert second.tokens == baseline.generate(turn2, 16).tokens


def _full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: the whole vocabulary sorted; ties of the last kept token kept too."""
    sorted_p, order = probs.sort(-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p
    keep = ~drop.scatter(-1, order, drop)
    floor = probs.masked_fill(~keep, 2.0).min(-1, keepdim=True).values
    return probs.masked_fill(probs < floor, 0.0)


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 30.0])  # flat (long candidate sort) to peaked
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_without_a_full_sort_equals_the_full_sort(scale, top_p):
    from eagletools.decode.sampling import nucleus_floor

    g = torch.Generator().manual_seed(int(scale * 10))
    logits = (torch.randn(12, 49152, generator=g) * scale).bfloat16().float()  # bf16: many ties
    probs = logits.softmax(-1)
    got = probs.masked_fill(probs < nucleus_floor(probs, top_p), 0.0)
    assert torch.equal(got, _full_sort_top_p(probs, top_p))
    expected = _full_sort_top_p(probs, top_p)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(Sampling(temperature=1.0, top_p=top_p).probs(logits), expected)


def _streamed_by_full_decodes(tokenizer, steps, stop_strings):
    """The reference: decode every token so far at every step (what `Stopper` did)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    tokens, chunks, streamed, hold = [], [], 0, max(map(len, stop_strings), default=1) - 1
    for step in steps:
        for n in range(len(tokens) + 1, len(tokens) + len(step) + 1):
            if any(s in decode((tokens + step)[:n]) for s in stop_strings):
                text = decode((tokens + step)[:n])
                final = text[: min(text.find(s) for s in stop_strings if s in text)]
                return chunks + [final[streamed:]] * (len(final) > streamed), final
        tokens += step
        text = decode(tokens).rstrip("\ufffd")
        text = text[: len(text) - hold]
        if len(text) > streamed:
            chunks.append(text[streamed:])
            streamed = len(text)
    final = decode(tokens)
    return chunks + [final[streamed:]] * (len(final) > streamed), final


@pytest.mark.parametrize("name", ["byt5", "smollm2"])
def test_incremental_text_streams_what_full_decodes_stream(name, tokenizer):
    from eagletools.decode.stopping import Stopper

    if name == "smollm2":
        from eagletools.targets import load_tokenizer

        tokenizer = load_tokenizer("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    text = "Größe 👍🏽 naïve — «quoted» , ok . Hello ,world!\n\n  def f(x):\n\treturn x ** 2 ⚡"
    ids = tokenizer(text * 3, add_special_tokens=False).input_ids
    # split into runs of 1-5 tokens (accepted drafts), bytes of characters split between runs
    cuts = torch.randint(1, 6, (len(ids),), generator=g).cumsum(0).tolist()
    steps = [ids[a:b] for a, b in zip([0, *cuts], cuts, strict=False) if a < len(ids)]
    for stop_strings in ([], ["Hello ,w"], ["ö"], ["x ** 2 ⚡"]):
        stopper = Stopper(
            tokenizer, set(), len(ids) + 1, stop_strings, on_text=(chunks := []).append
        )
        seq, kept = [], 0
        for step in steps:
            seq += step
            kept, reason = stopper.check(seq, kept)
            if reason:
                break
        else:
            stopper.emit("context")
        assert (chunks, stopper.text) == _streamed_by_full_decodes(tokenizer, steps, stop_strings)
