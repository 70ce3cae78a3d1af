"""The draft head: RoPE against transformers, decode against a full causal pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_draft_config

from eagletools.draft import DraftConfig, DraftKVCache, Eagle3Draft
from eagletools.errors import UserError
from eagletools.rope import RotaryEmbedding, apply_rope


def small_config(**overrides) -> DraftConfig:
    fields = dict(
        intermediate_size=96, draft_vocab_size=80, target_hidden_size=48, aux_layer_ids=[2, 3, 5]
    )
    return tiny_draft_config(**{**fields, **overrides})


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 2.0},
    ],
)  # fmt: skip
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_type": "default", **(scaling or {}), "rope_theta": 5e5}
    hf_config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params
    )
    hf = LlamaRotaryEmbedding(hf_config)
    ours = RotaryEmbedding(16, 5e5, scaling, 512)
    positions = torch.tensor([[0, 1, 7, 100, 511]])
    x = torch.randn(1, 4, 5, 16)
    cos_hf, sin_hf = hf(x, positions)
    cos, sin = ours(positions, torch.float32)
    torch.testing.assert_close(cos, cos_hf)
    q_hf, _ = apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    torch.testing.assert_close(apply_rope(x, cos, sin), q_hf)


def layer_by_layer(draft, embeds, hidden, cos, sin, attend):
    """The training layers (`qkv`, `finish`, `head`) one after another, each layer's
    q/k/v through `attend(layer index, q, k, v)`."""
    q, k, v, res = draft.midlayer.qkv(embeds, hidden, cos, sin)
    out = draft.midlayer.finish(attend(0, q, k, v), res)
    for i, layer in enumerate(draft.later_layers(), 1):
        q, k, v, res = layer.qkv(out, cos, sin)
        out = layer.finish(attend(i, q, k, v), res)
    return draft.head(out)


@pytest.mark.parametrize("layers", [1, 3], ids=["1-layer", "3-layers"])
@pytest.mark.parametrize("flags", [False, True], ids=["plain", "all-norms"])
def test_decode_chain_equals_causal_forward(flags, layers):
    torch.manual_seed(0)
    norms = dict.fromkeys(("norm_before_residual", "qk_norm", "fc_norm", "norm_output"), flags)
    draft = Eagle3Draft(small_config(**norms, num_hidden_layers=layers)).eval()
    b, t = 2, 7
    aux = torch.randn(b, t, 3 * 48)
    ids = torch.randint(0, 256, (b, t))
    positions = torch.arange(t)
    with torch.no_grad():
        hidden = draft.fuse_aux(aux)
        cos, sin = draft.rope(positions, hidden.dtype)
        expected, expected_h = layer_by_layer(
            draft, draft.embed_tokens(ids), hidden, cos, sin,
            lambda i, q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            ),
        )  # fmt: skip

    cache = DraftKVCache.allocate(draft.config, b, 16, torch.float32, "cpu")
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    # prefill 4 tokens, then 3 one at a time against the cache
    logits, h = draft.decode(
        hidden[:, :4], ids[:, :4], positions[:4], cache, torch.arange(4), causal[:4, :4]
    )
    chunks, states = [logits], [h]
    for i in range(4, t):
        logits, h = draft.decode(
            hidden[:, i : i + 1], ids[:, i : i + 1], positions[i : i + 1], cache,
            torch.tensor([i]), causal[i : i + 1, : i + 1],
        )  # fmt: skip
        chunks.append(logits)
        states.append(h)
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(states, 1), expected_h, atol=1e-5, rtol=1e-5)


def unfused_decode(draft, hidden, ids, positions, cache, slots, mask):
    """`Eagle3Draft.decode` as it was before its fused products and RoPE table: the
    training layer (`rope`, `qkv`, `finish`, `head`) with SDPA over the cache."""
    cos, sin = draft.rope(positions, hidden.dtype)
    embeds = draft.embed_tokens(ids).to(hidden.dtype)

    def attend(i, q, k, v):
        cache.k[i, :, :, slots] = k
        cache.v[i, :, :, slots] = v
        length = mask.shape[-1]
        keys, values = cache.k[i, :, :, :length], cache.v[i, :, :, :length]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    return layer_by_layer(draft, embeds, hidden, cos, sin, attend)


@pytest.mark.parametrize("batch_positions", [False, True], ids=["positions[n]", "positions[B,n]"])
@pytest.mark.parametrize(
    "flags, layers", [(False, 1), (True, 1), (True, 2)], ids=["plain", "all-norms", "2-layers"]
)
def test_decode_equals_the_unfused_layer_bitwise(flags, layers, batch_positions):
    """fp32, a prefill then three tree levels of 3 rows: the same logits, hidden and
    cache, bit for bit, as the training layer's pieces run one by one."""
    torch.manual_seed(0)
    norms = dict.fromkeys(("norm_before_residual", "qk_norm", "fc_norm", "norm_output"), flags)
    draft = Eagle3Draft(small_config(**norms, num_hidden_layers=layers)).eval()
    for p in draft.parameters():  # norms away from 1, so a skipped one shows
        p.data.add_(torch.randn_like(p) * 0.1)
    b, start, k = 2, 5, 3
    caches = [DraftKVCache.allocate(draft.config, b, 16, torch.float32, "cpu") for _ in "ab"]
    hidden = draft.fuse_aux(torch.randn(b, start, 3 * 48))
    ids = torch.randint(0, 256, (b, start))
    slots = torch.arange(start)
    causal = torch.ones(start, start, dtype=torch.bool).tril()
    calls = [(hidden, ids, 100 + slots, slots, causal)]
    for j in range(3):  # the prefix, random earlier tree slots, each row's own slot
        rows = torch.cat([torch.ones(k, start), torch.rand(k, j * k).round(), torch.eye(k)], 1)
        slots = start + j * k + torch.arange(k)
        positions = torch.full((k,), 100 + start + j)
        calls.append(
            (torch.randn(b, k, 64), torch.randint(0, 256, (b, k)), positions, slots, rows.bool())
        )
    for hidden, ids, positions, slots, mask in calls:
        if batch_positions:
            positions = positions + torch.tensor([[0], [7]])
            mask = mask.expand(b, 1, *mask.shape)
        args = (hidden, ids, positions)
        got = draft.decode(*args, caches[0], slots, mask)
        with torch.no_grad():
            want = unfused_decode(draft, *args, caches[1], slots, mask)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_decode_weights_follow_the_module_and_stay_out_of_the_state_dict():
    torch.manual_seed(0)
    draft = Eagle3Draft(small_config()).eval()
    keys = list(draft.state_dict())
    cache = DraftKVCache.allocate(draft.config, 1, 4, torch.float32, "cpu")
    args = (torch.randn(1, 2, 64), torch.tensor([[3, 4]]), torch.arange(2))
    mask = torch.ones(2, 2, dtype=torch.bool).tril()
    before = draft.decode(*args, cache, torch.arange(2), mask)[0]
    assert list(draft.state_dict()) == keys
    other = Eagle3Draft(small_config()).eval()
    draft.load_state_dict(other.state_dict())  # copied in place: new versions
    want = other.decode(*args, cache, torch.arange(2), mask)[0]
    assert torch.equal(draft.decode(*args, cache, torch.arange(2), mask)[0], want)
    assert not torch.equal(before, want)


def test_decode_rotates_with_fp32_frequencies_in_bf16():
    """`.to(bfloat16)` rounds the module's `inv_freq` (up to 0.3%: radians apart after
    a thousand positions); decoding rotates as training does, from fp32 frequencies."""
    config = small_config(rope_theta=5e5, max_position_embeddings=4096)
    draft = Eagle3Draft(config)
    positions = torch.tensor([0, 1, 999, 4095])
    cos, sin = draft.rope(positions, torch.bfloat16)
    table = draft.to(torch.bfloat16).decode_weights().rope[positions, :, 0]
    half = config.head_dim // 2
    assert torch.equal(table[:, 0], cos)
    assert torch.equal(table[:, 1], torch.cat([-sin[:, :half], sin[:, half:]], -1))
    rounded_cos, _ = draft.rope(positions, torch.bfloat16)  # the module's, rounded
    assert not torch.equal(rounded_cos, cos)


def test_fc_norm_normalises_each_aux_state_on_its_own():
    torch.manual_seed(0)
    draft = Eagle3Draft(small_config(fc_norm=True))
    assert [k for k in draft.state_dict() if k.startswith("fc_norm")] == [
        "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"
    ]  # fmt: skip
    aux = torch.randn(2, 5, 3 * 48)
    scaled = aux.clone()
    scaled[..., :48] *= 0.1  # a low layer's small states (well above eps)
    scaled[..., 48:96] *= 1e3  # a massive activation
    torch.testing.assert_close(draft.fuse_aux(scaled), draft.fuse_aux(aux), atol=1e-4, rtol=1e-4)
    plain = Eagle3Draft(small_config())
    plain.load_state_dict({k: v for k, v in draft.state_dict().items() if "fc_norm" not in k})
    assert not torch.allclose(plain.fuse_aux(scaled), plain.fuse_aux(aux), atol=1e-2)


def test_norm_before_fc_is_one_norm_over_the_concatenation():
    """`input_norm` [A*Ht] (vLLM's and speculators' name) RMS-normalises the whole
    concatenated aux input, then `fc`: as written out by hand."""
    torch.manual_seed(0)
    c = small_config(norm_before_fc=True, rms_norm_eps=1e-5)
    draft = Eagle3Draft(c)
    extra = set(draft.state_dict()) - set(Eagle3Draft(small_config()).state_dict())
    assert extra == {"input_norm.weight"} and draft.input_norm.weight.shape == (3 * 48,)
    with torch.no_grad():
        draft.input_norm.weight.copy_(torch.rand(3 * 48) + 0.5)
    aux = torch.randn(2, 5, 3 * 48) * torch.tensor([0.1, 1.0, 1e3]).repeat_interleave(48)
    rms = aux.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()
    expected = (aux * rms * draft.input_norm.weight) @ draft.fc.weight.T
    torch.testing.assert_close(draft.fuse_aux(aux), expected, atol=1e-5, rtol=1e-5)
    # one norm over all states: a state's scale relative to the others survives it
    scaled = aux.clone()
    scaled[..., 96:] *= 1e-3  # the massive state brought down to the others' scale
    plain = Eagle3Draft(small_config())
    plain.load_state_dict({k: v for k, v in draft.state_dict().items() if k != "input_norm.weight"})
    assert not torch.allclose(draft.fuse_aux(scaled), draft.fuse_aux(aux), atol=1e-2)
    assert not torch.allclose(plain.fuse_aux(aux), draft.fuse_aux(aux), atol=1e-2)


def test_norm_before_fc_with_fc_norm_is_refused_naming_both():
    with pytest.raises(UserError, match=r"'norm_before_fc' and 'fc_norm' are both true.*set one"):
        small_config(norm_before_fc=True, fc_norm=True)


def test_norm_output_carries_the_normed_state():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 64) * 30
    for norm_output in (False, True):
        draft = Eagle3Draft(small_config(norm_output=norm_output))
        logits, carried = draft.head(h)
        torch.testing.assert_close(logits, draft.lm_head(draft.norm(h)))
        torch.testing.assert_close(carried, draft.norm(h) if norm_output else h)


def test_state_dict_keys_are_the_eagle_layout():
    draft = Eagle3Draft(small_config(qk_norm=False))
    shapes = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
    assert shapes["fc.weight"] == (64, 3 * 48)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 16, 2 * 64)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (2 * 16, 2 * 64)
    assert shapes["lm_head.weight"] == (80, 64)
    assert shapes["d2t"] == (80,) and shapes["t2d"] == (256,)
    assert not draft.embed_tokens.weight.requires_grad


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_key_value_heads", 3, "must divide"),
        ("draft_vocab_size", 300, "exceeds"),
        ("aux_layer_ids", [1, 2], "num_aux_states"),
        ("hidden_size", 0, "positive integer"),
    ],
)
def test_config_rejects_bad_fields(field, value, message):
    with pytest.raises(UserError, match=message):
        small_config(**{field: value})


def test_config_round_trips_and_rejects_unknown_keys():
    config = small_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert DraftConfig.from_dict(config.to_dict()) == config
    with pytest.raises(UserError, match="unknown fields \\['hiden_size'\\]"):
        DraftConfig.from_dict({**config.to_dict(), "hiden_size": 3}, source="x/config.json")


def test_from_target_keeps_llama31_rope_in_both_transformers_spellings():
    """Under transformers 4 (`rope_theta` + `rope_scaling`) the llama3 scaling used to be
    dropped: the draft then rotated long prompts unlike its target."""
    from conftest import LLAMA31_ROPE, llama31_model, transformers4_spelling

    model = llama31_model()
    hf_inv_freq = model.model.rotary_emb.inv_freq
    for config in (model.config, transformers4_spelling(model.config)):
        model.config = config
        draft = Eagle3Draft.from_target(model)
        c = draft.config
        assert (c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (
            500000.0, LLAMA31_ROPE, 131072,
        )  # fmt: skip
        torch.testing.assert_close(draft.rotary.inv_freq, hf_inv_freq, rtol=0, atol=0)
