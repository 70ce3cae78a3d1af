"""The decode runtime against Hugging Face: logits, aux states, cache, tree masks."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from eagletools.decode.model import Transformer
from eagletools.decode.tree import ancestor_mask
from eagletools.errors import UserError


def _runtime(model, max_len=128) -> Transformer:
    runtime = Transformer.from_hf(model)
    runtime.setup_caches(1, max_len)
    return runtime


def test_logits_and_aux_match_hf(family):
    model = tiny_model(family, seed=1)
    runtime = _runtime(model)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = model(ids, output_hidden_states=True)
    logits, aux = runtime(ids, torch.arange(24), 0, aux_layer_ids=[3, 1, 2])
    assert (logits - ref.logits).abs().max() <= 1e-4
    expected = torch.cat([ref.hidden_states[i] for i in (3, 1, 2)], dim=-1)
    assert (aux - expected).abs().max() <= 1e-5


def test_incremental_decode_matches_full_forward(family):
    model = tiny_model(family, seed=2)
    runtime = _runtime(model)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    pieces = [runtime(ids[:, :12], torch.arange(12), 0)[0]]
    for t in range(12, 20):  # one token at a time, as the baseline decodes
        pieces.append(runtime(ids[:, t : t + 1], torch.tensor([t]), t)[0])
    assert (torch.cat(pieces, dim=1) - ref).abs().max() <= 1e-4


def test_tree_mask_sees_only_ancestors():
    model = tiny_model("qwen2", seed=3)
    runtime = _runtime(model)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits
    prefix = 16
    runtime(ids[:, :prefix], torch.arange(prefix), 0)
    # two branches under the root: the true continuation (nodes 0,2,4) and decoys (1,3)
    tokens = torch.stack([ids[0, 16], torch.tensor(5), ids[0, 17], torch.tensor(7), ids[0, 18]])
    parents = torch.tensor([-1, 0, 0, 1, 2])
    mask = ancestor_mask(parents)
    depths = mask.sum(1) - 1
    assert depths.tolist() == [0, 1, 1, 2, 2]
    logits, _ = runtime(tokens[None], prefix + depths, prefix, mask)
    assert (logits[0, [0, 2, 4]] - ref[0, 16:19]).abs().max() <= 1e-4


def test_cache_mask_is_the_extend_mask_over_the_whole_cache():
    from eagletools.decode.model import cache_mask, extend_mask

    tree = ancestor_mask(torch.tensor([-1, 0, 0, 1, 2]))
    for start, tree_mask in [(0, None), (7, tree), (11, None), (11, tree)]:
        n = 5
        got = cache_mask(torch.tensor(start), n, 16, tree_mask)
        assert torch.equal(got[:, : start + n], extend_mask(start, n, tree_mask))
        assert not got[:, start + n :].any()


def test_a_start_on_the_device_gives_the_same_forward(family):
    """The start as a 0-d tensor (a CUDA graph replaying new lengths): the K/V land in
    the same slots and the logits agree, though attention reads the whole cache."""
    model = tiny_model(family, seed=4)
    by_int, by_tensor = _runtime(model, 64), _runtime(model, 64)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    tree = ancestor_mask(torch.tensor([-1, 0, 0, 1, 2]))
    start = torch.tensor(0)
    for runtime in (by_int, by_tensor):
        runtime(ids[:, :20], torch.arange(20), 0)
        for cache in (runtime.kv_cache.k, runtime.kv_cache.v):
            cache[..., 20:, :] = 1e4  # stale entries the mask must hide
    for begin, n, mask in [(20, 5, tree), (25, 3, None), (28, 1, None)]:
        positions = begin + (tree.sum(1) - 1 if mask is not None else torch.arange(n))
        want = by_int(ids[:, begin : begin + n], positions, begin, mask, aux_layer_ids=[1, 4])
        start.fill_(begin)
        got = by_tensor(ids[:, begin : begin + n], positions, start, mask, aux_layer_ids=[1, 4])
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in [
        (by_tensor.kv_cache.k, by_int.kv_cache.k),
        (by_tensor.kv_cache.v, by_int.kv_cache.v),
    ]:
        # the same slots written and the rest untouched; the first layer's K/V are
        # bitwise equal, later ones read attention outputs summed over a longer
        # (masked) row, so they may differ by a rounding
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[..., 29:, :], b[..., 29:, :])
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_growing_the_cache_keeps_every_layer():
    runtime = _runtime(tiny_model("llama", seed=6), max_len=16)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(6))
    runtime(ids, torch.arange(16), 0)
    before = runtime.kv_cache.k.clone(), runtime.kv_cache.v.clone()
    runtime.reserve(40, limit=300)
    cache = runtime.kv_cache
    assert runtime.cache_len == cache.size == 256 and cache.k.shape == (4, 1, 2, 256, 16)
    assert torch.equal(cache.k[..., :16, :], before[0]) and torch.equal(
        cache.v[..., :16, :], before[1]
    )
    assert all(k.data_ptr() == cache.k[i].data_ptr() for i, (k, _) in enumerate(cache.layers))


def test_sequence_beyond_the_cache_is_a_user_error():
    runtime = _runtime(tiny_model("llama"), max_len=16)
    with pytest.raises(UserError, match="exceeds the KV cache"):
        runtime(torch.zeros(1, 17, dtype=torch.long), torch.arange(17), 0)


def test_unsupported_family_is_named():
    from transformers import AutoConfig

    from eagletools.decode.model import ModelArgs

    with pytest.raises(UserError, match="gpt2"):
        ModelArgs.from_hf_config(AutoConfig.for_model("gpt2"))


@pytest.mark.integration
def test_smollm2_logits_match_hf():
    from eagletools.targets import load_target

    target = load_target("smollm2-135m", dtype=torch.float32)
    runtime = _runtime(target.model, max_len=256)
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")
    ids = ids.input_ids
    ref = target.model(ids).logits
    logits, _ = runtime(ids, torch.arange(ids.shape[1]), 0)
    assert (logits - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_aux_states_equal_training_capture_for_every_id(family):
    """Aux id k means HF `hidden_states[k]` in both: the features a draft is trained on
    (`capture_aux`) are the ones the decoder feeds it, up to id N (after the final norm)."""
    from eagletools.targets import capture_aux

    model = tiny_model(family, seed=5)
    every = list(range(model.config.num_hidden_layers + 1))
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    trained = capture_aux(model, ids, layer_ids=every).aux
    _, decoded = _runtime(model)(ids, torch.arange(9), 0, aux_layer_ids=every)
    hf = torch.cat(model(ids, output_hidden_states=True).hidden_states, dim=-1)
    torch.testing.assert_close(trained, hf, rtol=0, atol=0)
    for i in every:
        part = slice(64 * i, 64 * (i + 1))
        torch.testing.assert_close(decoded[..., part], trained[..., part], rtol=0, atol=1e-5)


def test_llama31_rope_matches_hf_in_both_transformers_spellings():
    from conftest import llama31_model, transformers4_spelling

    model = llama31_model(seed=6)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(9000, 9012)  # beyond the original 8192: the scaling matters
    ref = model(ids, position_ids=positions[None]).logits
    hf_inv_freq = model.model.rotary_emb.inv_freq
    for config in (model.config, transformers4_spelling(model.config)):
        model.config = config
        runtime = Transformer.from_hf(model)
        torch.testing.assert_close(runtime.rotary.inv_freq, hf_inv_freq, rtol=0, atol=0)
        runtime.setup_caches(1, 16)
        logits, _ = runtime(ids, positions, 0)
        assert (logits - ref).abs().max() <= 1e-4


def test_runtime_shares_the_weights_it_does_not_fuse_with_the_hf_model():
    """Eval keeps the HF model beside the runtime: the embedding, head and o/down
    projections are shared, not copied (2.4 GB of a 2-layer 8B-wide target)."""
    from conftest import tiny_model

    hf = tiny_model("llama", dtype=torch.bfloat16)
    runtime = Transformer.from_hf(hf, torch.bfloat16)
    layer, block = hf.model.layers[0], runtime.layers[0]
    for ours, theirs in ((runtime.tok_embeddings, hf.model.embed_tokens),
                         (runtime.output, hf.lm_head), (block.attention.wo, layer.self_attn.o_proj),
                         (block.feed_forward.w2, layer.mlp.down_proj)):  # fmt: skip
        assert ours.weight.data_ptr() == theirs.weight.data_ptr()
    assert Transformer.from_hf(hf, torch.float32).output.weight.dtype == torch.float32  # a copy
