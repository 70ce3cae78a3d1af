"""Checkpoint formats: round trips, conventions pinned from the real ecosystems, bad input.

Builders here (`make_ckpt`, `safeailab_release`, `specforge_export`) are also
used by tests/test_convert.py and tests/test_inspect.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import tiny_draft_config
from hypothesis import given, settings
from hypothesis import strategies as st

from eagletools.draft import DraftConfig, Eagle3Draft
from eagletools.errors import UserError
from eagletools.formats import (
    Checkpoint,
    detect_format,
    load_checkpoint,
    load_draft,
    save_checkpoint,
)
from eagletools.formats import speculators as spec_format
from eagletools.vocab import DraftVocab

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def random_vocab(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> DraftVocab:
    g = torch.Generator().manual_seed(seed)
    return DraftVocab.from_selected(
        torch.randperm(vocab_size, generator=g)[:draft_vocab_size], vocab_size
    )


def make_ckpt(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> Checkpoint:
    """A random draft (norms too, so no tensor is trivially equal) with a random vocab."""
    config = tiny_draft_config(**overrides)
    torch.manual_seed(seed)
    model = Eagle3Draft(config)
    vocab = random_vocab(config.vocab_size, config.draft_vocab_size, seed)
    tensors = {}
    for k, v in model.state_dict().items():
        tensors[k] = torch.randn(v.shape).to(dtype) if v.is_floating_point() else v.clone()
    tensors["d2t"], tensors["t2d"] = vocab.d2t, vocab.t2d
    return Checkpoint("memory", config, tensors, "memory")


def save_target_folder(folder: Path, model) -> Path:
    """A local HF target folder (`--target`): the model and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)
    return folder


def save_raw(folder: Path, config: dict, tensors: dict, pickle: bool = False) -> Path:
    """A checkpoint folder written the way other tools write them (not through eagletools)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if pickle:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors")
        )
    return folder


def eagle_release_tensors(dtype: torch.dtype, with_embed: bool, seed: int = 0) -> dict:
    """The documented `eagle` key set (docs/design.md 3.4), shapes written out by hand."""
    g = torch.Generator().manual_seed(seed)
    h, i, v, vd, hd, nh, nkv = 64, 128, 256, 100, 16, 4, 2

    def w(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    t = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, nh * hd),
        "midlayer.mlp.gate_proj.weight": w(i, h),
        "midlayer.mlp.up_proj.weight": w(i, h),
        "midlayer.mlp.down_proj.weight": w(h, i),
        "midlayer.input_layernorm.weight": w(h),
        "midlayer.hidden_norm.weight": w(h),
        "midlayer.post_attention_layernorm.weight": w(h),
        "norm.weight": w(h),
        "lm_head.weight": w(vd, h),
    }
    vocab = random_vocab(v, vd, seed)
    t["d2t"], t["t2d"] = vocab.d2t, vocab.t2d
    if with_embed:
        t["embed_tokens.weight"] = w(v, h)
    return t


def safeailab_release(folder: Path, pickle: bool = False) -> Path:
    """Shaped like a public SafeAILab EAGLE-3 release: fp16, midlayer.*, d2t/t2d, no
    embeddings, a transformers-4.28 config without head_dim or RoPE fields."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": 256,
        "draft_vocab_size": 100,
    }
    return save_raw(folder, config, eagle_release_tensors(torch.float16, False), pickle)


def specforge_export(folder: Path, num_target_layers: int = 4) -> Path:
    """Shaped like a SpecForge export: bf16 safetensors, aux ids as decoder-layer outputs in
    `eagle_config` (default [1, N//2-1, N-4]), RoPE fields, the frozen embeddings kept."""
    n = num_target_layers
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": 256,
        "draft_vocab_size": 100,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4],
            "use_aux_hidden_state": True,
        },
    }
    return save_raw(folder, config, eagle_release_tensors(torch.bfloat16, True))


def assert_same(a: Checkpoint, b: Checkpoint) -> None:
    """Every tensor bit-exact (same dtype), every config field except `extra` equal."""
    assert set(a.tensors) == set(b.tensors)
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype, k
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    assert dataclasses.replace(a.config, extra={}) == dataclasses.replace(b.config, extra={})


ROUND_TRIP_CONFIGS = [
    dict(aux_layer_ids=[1, 3, 4], norm_before_residual=True, rope_theta=500000.0,
         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5),
    dict(aux_layer_ids=[2, 2, 1], qk_norm=True, target_hidden_size=48, draft_vocab_size=256),
    dict(aux_layer_ids=None, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(aux_layer_ids=[1, 2, 3], fc_norm=True, norm_output=True),
    dict(aux_layer_ids=[1, 2, 3], num_hidden_layers=3, qk_norm=True),
    dict(aux_layer_ids=None, norm_before_fc=True, norm_output=True, target_hidden_size=48),
]  # fmt: skip
ROUND_TRIP_IDS = ["llama3-rope", "qwen3", "no-aux", "eagle3.1", "3-layers", "norm-before-fc"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overrides", ROUND_TRIP_CONFIGS, ids=ROUND_TRIP_IDS)
def test_round_trip_eagle_speculators_eagle(tmp_path, dtype, overrides):
    src = make_ckpt(dtype, **overrides)
    save_checkpoint(src, tmp_path / "e1", "eagle", with_embeddings=True)
    e1 = load_checkpoint(tmp_path / "e1")
    save_checkpoint(e1, tmp_path / "s", "speculators", with_embeddings=True, verifier="v")
    s = load_checkpoint(tmp_path / "s")
    save_checkpoint(s, tmp_path / "e2", "eagle", with_embeddings=True)
    e2 = load_checkpoint(tmp_path / "e2")
    assert (e1.format, s.format, e2.format) == ("eagle", "speculators", "eagle")
    for ckpt in (e1, s, e2):
        assert_same(src, ckpt)
    # the files themselves are identical too
    assert (tmp_path / "e1/config.json").read_text() == (tmp_path / "e2/config.json").read_text()
    assert (tmp_path / "e1/model.safetensors").read_bytes() == (
        tmp_path / "e2/model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overrides", ROUND_TRIP_CONFIGS, ids=ROUND_TRIP_IDS)
def test_round_trip_speculators_eagle_speculators(tmp_path, dtype, overrides):
    save_checkpoint(make_ckpt(dtype, **overrides), tmp_path / "s1", "speculators", verifier="v",
                    with_embeddings=True)  # fmt: skip
    s1 = load_checkpoint(tmp_path / "s1")
    save_checkpoint(s1, tmp_path / "e", "eagle", with_embeddings=True)
    e = load_checkpoint(tmp_path / "e")
    save_checkpoint(e, tmp_path / "s2", "speculators", verifier="v", with_embeddings=True)
    s2 = load_checkpoint(tmp_path / "s2")
    assert_same(s1, e)
    assert_same(s1, s2)
    assert s2.config.extra == s1.config.extra
    assert json.loads((tmp_path / "s1/config.json").read_text()) == json.loads(
        (tmp_path / "s2/config.json").read_text()
    )


def test_training_format_round_trip_is_lossless(tmp_path):
    src = make_ckpt(torch.float32, aux_layer_ids=[1, 2, 3], norm_before_residual=True)
    save_checkpoint(src, tmp_path / "t", "training", with_embeddings=True)
    # the trainer's resume files sit beside the draft and are ignored
    (tmp_path / "t/trainer_state.json").write_text("{}")
    t = load_checkpoint(tmp_path / "t")
    assert t.format == "training"
    assert_same(src, t)


def test_aux_layer_ids_convert_between_conventions(tmp_path):
    """eagle_config holds decoder-layer outputs (HF - 1), speculators HF indexing (3.1)."""
    ckpt = make_ckpt(aux_layer_ids=[2, 16, 29])
    save_checkpoint(ckpt, tmp_path / "e", "eagle")
    save_checkpoint(ckpt, tmp_path / "s", "speculators")
    eagle_cfg = json.loads((tmp_path / "e/config.json").read_text())
    spec_cfg = json.loads((tmp_path / "s/config.json").read_text())
    assert eagle_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert load_checkpoint(tmp_path / "e").config.aux_layer_ids == [2, 16, 29]
    assert load_checkpoint(tmp_path / "s").config.aux_layer_ids == [2, 16, 29]


def test_speculators_config_has_what_vllm_and_speculators_read(tmp_path):
    ckpt = make_ckpt(norm_before_residual=False)
    save_checkpoint(ckpt, tmp_path / "s", "speculators", verifier=str(tmp_path))
    cfg = json.loads((tmp_path / "s/config.json").read_text())
    assert "model_type" not in cfg  # speculators configs have none at top level
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3DraftModel"]  # what speculators 0.9.0 writes
    assert cfg["norm_before_residual"] is False  # written even when False
    layer = cfg["transformer_layer_config"]
    assert layer["vocab_size"] == 256 and layer["num_hidden_layers"] == 1
    assert layer["model_type"] == "llama" and layer["head_dim"] == 16
    assert cfg["draft_vocab_size"] == 100 and cfg["target_hidden_size"] == 64
    method = cfg["speculators_config"]["proposal_methods"][0]
    assert method["proposal_type"] == "greedy" and method["verifier_accept_k"] == 1
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s/model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in keys
    assert not any(k.startswith("midlayer.") for k in keys)
    assert "embed_tokens.weight" not in keys  # only with --with-embeddings


def test_eagle31_fields_and_keys_are_what_the_engines_read(tmp_path):
    """SpecForge/SGLang/vLLM (eagle) and speculators >= 0.7 both read top-level
    `fc_norm` / `norm_output` and bare `fc_norm.{i}.weight` keys (engines add `model.`)."""
    from safetensors import safe_open

    ckpt = make_ckpt(aux_layer_ids=[1, 2, 3], fc_norm=True, norm_output=True)
    for fmt in ("eagle", "speculators"):
        save_checkpoint(ckpt, tmp_path / fmt, fmt, verifier="v")
        cfg = json.loads((tmp_path / fmt / "config.json").read_text())
        assert cfg["fc_norm"] is True and cfg["norm_output"] is True
        with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        norms = sorted(k for k in keys if "fc_norm" in k)
        assert norms == ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
    save_checkpoint(make_ckpt(), tmp_path / "p", "eagle")
    plain = json.loads((tmp_path / "p/config.json").read_text())
    assert plain["fc_norm"] is False and plain["norm_output"] is False
    # a config that leaves out fc_norm while its file holds the norms is refused, naming them
    cfg = json.loads((tmp_path / "eagle/config.json").read_text())
    (tmp_path / "eagle/config.json").write_text(json.dumps({**cfg, "fc_norm": False}))
    with pytest.raises(UserError, match="unexpected tensor.*fc_norm.0.weight"):
        load_checkpoint(tmp_path / "eagle")


def test_norm_before_fc_is_written_where_each_engine_reads_it(tmp_path):
    """One norm over all aux states, tensor `input_norm.weight` [A*Ht] in both layouts.
    speculators: top-level `norm_before_fc` (speculators 0.9.0; vLLM's
    configs/speculators/algos.py:36 copies it). eagle: top-level (llama.cpp's converter,
    vLLM's fallback) and `eagle_config.norm_before_fc` (TensorRT-LLM's only place, vLLM's
    first: models/llama_eagle3.py:184-188)."""
    from safetensors import safe_open

    ckpt = make_ckpt(aux_layer_ids=None, norm_before_fc=True, target_hidden_size=48)
    for fmt in ("eagle", "speculators"):
        save_checkpoint(ckpt, tmp_path / fmt, fmt, verifier="v")
        cfg = json.loads((tmp_path / fmt / "config.json").read_text())
        assert cfg["norm_before_fc"] is True and cfg["fc_norm"] is False
        with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
            assert f.get_slice("input_norm.weight").get_shape() == [3 * 48]
        assert load_checkpoint(tmp_path / fmt).config.norm_before_fc is True
    eagle = json.loads((tmp_path / "eagle/config.json").read_text())
    assert eagle["eagle_config"] == {"norm_before_fc": True}  # no aux ids: only the flag
    save_checkpoint(make_ckpt(aux_layer_ids=[1, 2, 3]), tmp_path / "p", "eagle")
    plain = json.loads((tmp_path / "p/config.json").read_text())
    assert plain["norm_before_fc"] is False and "norm_before_fc" not in plain["eagle_config"]


@pytest.mark.parametrize(
    "spelling, read",
    [({"norm_before_fc": True}, True), ({"eagle_config": {"norm_before_fc": True}}, True),
     ({"norm_before_fc": False, "eagle_config": {"norm_before_fc": True}}, True),
     ({"norm_before_fc": True, "eagle_config": {"norm_before_fc": False}}, False), ({}, False)],
)  # fmt: skip
def test_eagle_layout_reads_norm_before_fc_as_vllm_does(tmp_path, spelling, read):
    """vLLM 0.32.0 (models/llama_eagle3.py:184-188): `eagle_config["norm_before_fc"]`
    when present, else the top-level field, else false."""
    folder = tmp_path / "e"
    save_checkpoint(make_ckpt(aux_layer_ids=None, norm_before_fc=read), folder, "eagle")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("norm_before_fc")
    cfg.pop("eagle_config", None)
    (folder / "config.json").write_text(json.dumps({**cfg, **spelling}))
    assert load_checkpoint(folder).config.norm_before_fc is read


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_norm_before_fc_disagreeing_with_its_tensor_is_refused(tmp_path, fmt):
    """vLLM drops `input_norm.*` with the flag off (llama_eagle3.py:464): the draft would be
    served without its norm, so a file whose flag and tensor disagree is refused, naming
    the field and the fix."""
    save_checkpoint(make_ckpt(norm_before_fc=True), tmp_path / "on", fmt, verifier="v")
    cfg = json.loads((tmp_path / "on/config.json").read_text())
    cfg.pop("eagle_config", None)
    (tmp_path / "on/config.json").write_text(json.dumps({**cfg, "norm_before_fc": False}))
    with pytest.raises(UserError, match=r"holds input_norm.weight but norm_before_fc is false.*"
                                        r"set norm_before_fc: true"):  # fmt: skip
        load_checkpoint(tmp_path / "on")
    save_checkpoint(make_ckpt(), tmp_path / "off", fmt, verifier="v")
    cfg = json.loads((tmp_path / "off/config.json").read_text())
    (tmp_path / "off/config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(UserError, match=r"norm_before_fc is true but the file has no "
                                        r"input_norm.weight.*set norm_before_fc: false"):  # fmt: skip
        load_checkpoint(tmp_path / "off")


def test_later_layers_are_named_as_each_engine_reads_them(tmp_path):
    """speculators (vLLM): `layers.{i}.*`, each later layer a plain Llama one with its
    `input_layernorm`; eagle: TensorRT-LLM's list `midlayer.{i}.*`, where a later layer's
    one norm before attention is `hidden_norm`."""
    from safetensors import safe_open

    ckpt = make_ckpt(aux_layer_ids=[1, 2, 3], num_hidden_layers=2)
    keys = {}
    for fmt in ("eagle", "speculators"):
        save_checkpoint(ckpt, tmp_path / fmt, fmt, verifier="v")
        with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
            keys[fmt] = {k for k in set(f.keys()) if "layer" in k}
    assert {
        "midlayer.0.hidden_norm.weight",
        "midlayer.0.input_layernorm.weight",
        "midlayer.1.hidden_norm.weight",
        "midlayer.1.self_attn.q_proj.weight",
    } <= keys["eagle"]
    assert "midlayer.1.input_layernorm.weight" not in keys["eagle"]
    assert {
        "layers.0.hidden_norm.weight",
        "layers.1.input_layernorm.weight",
        "layers.1.mlp.down_proj.weight",
    } <= keys["speculators"]
    assert "layers.1.hidden_norm.weight" not in keys["speculators"]
    assert len(keys["eagle"]) == len(keys["speculators"]) == 10 + 9
    layer = json.loads((tmp_path / "speculators/config.json").read_text())
    assert layer["transformer_layer_config"]["num_hidden_layers"] == 2
    assert json.loads((tmp_path / "eagle/config.json").read_text())["num_hidden_layers"] == 2
    with safe_open(str(tmp_path / "eagle" / "model.safetensors"), "pt") as f:
        q = f.get_tensor("midlayer.1.self_attn.q_proj.weight")
    assert q.shape[1] == ckpt.config.hidden_size  # a plain layer reads the hidden alone
    assert torch.equal(q, ckpt.tensors["layer1.self_attn.q_proj.weight"])


def test_speculators_without_norm_before_residual_follows_vllm(tmp_path, caplog):
    """vLLM reads `config_dict.get("norm_before_residual", True)`; the speculators package
    defaults to False. The reader follows vLLM and warns."""
    save_checkpoint(make_ckpt(norm_before_residual=False), tmp_path / "s", "speculators")
    cfg = json.loads((tmp_path / "s/config.json").read_text())
    del cfg["norm_before_residual"]
    (tmp_path / "s/config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(tmp_path / "s").config.norm_before_residual is True
    assert "norm_before_residual" in caplog.text


def test_identity_vocab_written_without_buffers_for_speculators(tmp_path):
    ckpt = make_ckpt(draft_vocab_size=256)
    save_checkpoint(ckpt, tmp_path / "s", "speculators")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s/model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "d2t" not in keys and "t2d" not in keys
    back = load_checkpoint(tmp_path / "s")
    assert back.vocab.is_identity and torch.equal(
        back.tensors["d2t"], torch.zeros(256, dtype=torch.long)
    )
    assert bool(back.tensors["t2d"].all())


def test_missing_t2d_is_rebuilt_and_zero_d2t_is_identity(tmp_path):
    tensors = eagle_release_tensors(torch.float16, False)
    t2d = tensors.pop("t2d")
    cfg = json.loads((safeailab_release(tmp_path / "a")).joinpath("config.json").read_text())
    save_raw(tmp_path / "b", cfg, tensors)
    assert torch.equal(load_checkpoint(tmp_path / "b").tensors["t2d"], t2d)
    # an old checkpoint with equal vocabularies and an all-zero d2t
    tensors = eagle_release_tensors(torch.float16, False)
    tensors["lm_head.weight"] = torch.zeros(256, 64, dtype=torch.float16)
    tensors["d2t"] = torch.zeros(256, dtype=torch.long)
    del tensors["t2d"]
    save_raw(tmp_path / "c", {**cfg, "draft_vocab_size": 256}, tensors)
    assert load_checkpoint(tmp_path / "c").vocab.is_identity


def test_sharded_safetensors_with_index(tmp_path):
    ckpt = make_ckpt()
    save_checkpoint(
        ckpt, tmp_path / "s", "speculators", max_shard_bytes=40_000, with_embeddings=True
    )
    index = json.loads((tmp_path / "s/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "s/model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert_same(ckpt, load_checkpoint(tmp_path / "s"))
    (tmp_path / "s" / shards[1]).unlink()
    with pytest.raises(UserError, match=rf"shard file\(s\) \['{shards[1]}'\]"):
        load_checkpoint(tmp_path / "s")


def test_load_draft_runs_the_checkpoint(tmp_path):
    ckpt = make_ckpt(aux_layer_ids=[1, 2, 3])
    save_checkpoint(ckpt, tmp_path / "s", "speculators", with_embeddings=True)
    draft = load_draft(tmp_path / "s")
    for k, v in draft.state_dict().items():
        assert torch.equal(v, ckpt.tensors[k]), k
    hidden = draft.fuse_aux(torch.randn(1, 3, 3 * 64))
    assert draft.head(hidden)[0].shape == (1, 3, 100)


def test_safeailab_release_reads_with_llama_defaults(tmp_path):
    ckpt = load_checkpoint(safeailab_release(tmp_path / "r"))
    c = ckpt.config
    assert ckpt.format == "eagle"
    assert (c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (
        16, 10000.0, None, 2048,
    )  # fmt: skip
    assert c.aux_layer_ids is None and c.num_aux_states == 3 and not c.norm_before_residual
    assert "embed_tokens.weight" not in ckpt.tensors
    assert ckpt.tensors["fc.weight"].dtype == torch.float16


def test_specforge_export_reads_aux_ids_as_layer_outputs(tmp_path):
    ckpt = load_checkpoint(specforge_export(tmp_path / "sf", num_target_layers=32))
    assert ckpt.config.aux_layer_ids == [2, 16, 29]  # SpecForge's [1, 15, 28] + 1
    assert ckpt.tensors["embed_tokens.weight"].dtype == torch.bfloat16


# ---- bad input: each names the file and the field, nothing is written ----


def test_truncated_safetensors(tmp_path):
    folder = specforge_export(tmp_path / "sf")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"model\.safetensors: unreadable.*truncated"):
        load_checkpoint(folder)


def test_missing_key_is_named(tmp_path):
    tensors = eagle_release_tensors(torch.float16, False)
    del tensors["midlayer.hidden_norm.weight"]
    folder = save_raw(tmp_path / "m", json.loads(_release_config(tmp_path)), tensors)
    with pytest.raises(UserError, match=r"missing tensor\(s\) \['midlayer.hidden_norm.weight'\]"):
        load_checkpoint(folder)


def test_wrong_shape_names_expected_and_found(tmp_path):
    tensors = eagle_release_tensors(torch.float16, False)
    tensors["midlayer.self_attn.k_proj.weight"] = torch.zeros(64, 128, dtype=torch.float16)
    folder = save_raw(tmp_path / "m", json.loads(_release_config(tmp_path)), tensors)
    with pytest.raises(
        UserError,
        match=r"'midlayer.self_attn.k_proj.weight' has shape \[64, 128\], expected \[32, 128\]",
    ):
        load_checkpoint(folder)


def _release_config(tmp_path: Path) -> str:
    return (safeailab_release(tmp_path / "ref") / "config.json").read_text()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t["d2t"].__setitem__(-1, 10_000), r"target ids i \+ d2t\[i\] lie in \[0, V\)"),
        (lambda t: t["d2t"].__setitem__(5, int(t["d2t"][4]) - 1), "d2t is non-decreasing"),
        (lambda t: t["t2d"].__setitem__(torch.nonzero(~t["t2d"])[0], True), r"t2d.sum\(\) == Vd"),
    ],
    ids=["d2t-out-of-range", "d2t-decreasing", "t2d-count"],
)
def test_bad_vocabulary(tmp_path, edit, message):
    tensors = eagle_release_tensors(torch.float16, False)
    edit(tensors)
    folder = save_raw(tmp_path / "m", json.loads(_release_config(tmp_path)), tensors)
    with pytest.raises(UserError, match=message):
        load_checkpoint(folder)
    del tensors["t2d"]  # SGLang/vLLM read d2t alone: it is checked alone too
    if "t2d" not in message:
        folder = save_raw(tmp_path / "n", json.loads(_release_config(tmp_path)), tensors)
        with pytest.raises(UserError, match=message):
            load_checkpoint(folder)


def test_unknown_format_says_what_it_found(tmp_path):
    save_raw(tmp_path / "x", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, {})
    with pytest.raises(
        UserError, match=r"unknown checkpoint format \(architectures=\['LlamaForCausalLM'\]"
    ):
        detect_format(tmp_path / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="unknown checkpoint format"):
        load_checkpoint(tmp_path / "empty")


def test_run_folder_points_at_its_checkpoints(tmp_path):
    save_checkpoint(make_ckpt(), tmp_path / "run/checkpoints/step-00000010", "training")
    with pytest.raises(UserError, match="step-00000010"):
        load_checkpoint(tmp_path / "run/checkpoints")


def test_pickle_needs_permission(tmp_path):
    folder = safeailab_release(tmp_path / "r", pickle=True)
    with pytest.raises(UserError, match=r"pytorch_model.bin: a pickle file.*--allow-pickle"):
        load_checkpoint(folder)
    ckpt = load_checkpoint(folder, allow_pickle=True)
    assert torch.equal(
        ckpt.tensors["fc.weight"], eagle_release_tensors(torch.float16, False)["fc.weight"]
    )


def test_pickle_with_objects_is_refused_even_when_allowed(tmp_path):
    folder = safeailab_release(tmp_path / "r", pickle=True)
    torch.save({"fc.weight": torch.zeros(1), "evil": Path("x")}, folder / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"weights_only=True"):
        load_checkpoint(folder, allow_pickle=True)


def test_unsupported_speculators_variants_are_refused(tmp_path):
    save_checkpoint(make_ckpt(norm_before_fc=True), tmp_path / "s", "speculators")
    cfg = json.loads((tmp_path / "s/config.json").read_text())
    # speculators refuses both norms together (Eagle3SpeculatorConfig._check_norm_flags)
    (tmp_path / "s/config.json").write_text(json.dumps({**cfg, "fc_norm": True}))
    with pytest.raises(UserError, match="'norm_before_fc' and 'fc_norm' are both true"):
        load_checkpoint(tmp_path / "s")


def test_save_refuses_to_overwrite_and_checks_first(tmp_path):
    ckpt = make_ckpt()
    save_checkpoint(ckpt, tmp_path / "o", "eagle")
    before = (tmp_path / "o/model.safetensors").read_bytes()
    with pytest.raises(UserError, match="already exists"):
        save_checkpoint(make_ckpt(seed=1), tmp_path / "o", "eagle")
    bad = dataclasses.replace(ckpt, tensors={**ckpt.tensors, "fc.weight": torch.zeros(3)})
    with pytest.raises(UserError, match="'fc.weight' has shape"):
        save_checkpoint(bad, tmp_path / "o", "eagle", overwrite=True)
    assert (tmp_path / "o/model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no temp folder left
    save_checkpoint(make_ckpt(seed=1), tmp_path / "o", "eagle", overwrite=True)
    assert (tmp_path / "o/model.safetensors").read_bytes() != before


def test_aux_count_without_ids(tmp_path):
    """Without ids engines assume 3 states; eagle can state another count, speculators not."""
    ckpt = make_ckpt(aux_layer_ids=None, num_aux_states=2)
    save_checkpoint(ckpt, tmp_path / "e", "eagle")
    assert read_json(tmp_path / "e/config.json")["num_aux_hidden_states"] == 2
    assert load_checkpoint(tmp_path / "e").config.num_aux_states == 2
    with pytest.raises(UserError, match="needs its aux layer ids in the speculators format"):
        save_checkpoint(ckpt, tmp_path / "s", "speculators")
    assert not (tmp_path / "s").exists()
    cfg = read_json(tmp_path / "e/config.json")
    del cfg["num_aux_hidden_states"]
    (tmp_path / "e/config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"'fc.weight' has shape \[64, 128\], expected \[64, 192\]"):
        load_checkpoint(tmp_path / "e")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_spec_format_key_map_is_a_bijection():
    keys = list(make_ckpt(qk_norm=True, num_hidden_layers=3).tensors)
    mapped = [spec_format.from_eagle_key(k) for k in keys]
    assert len(set(mapped)) == len(keys)
    assert [spec_format.to_eagle_key(k) for k in mapped] == keys


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_vocab_survives_every_round_trip(data):
    """Random valid selections: d2t/t2d come back identical through every format."""
    vocab_size = data.draw(st.integers(2, 300), label="V")
    selected = data.draw(
        st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=vocab_size, unique=True),
        label="selected",
    )
    vocab = DraftVocab.from_selected(selected, vocab_size)
    config = DraftConfig(
        hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
        head_dim=4, vocab_size=vocab_size, draft_vocab_size=len(selected), target_hidden_size=8,
    )  # fmt: skip
    tensors = {k: torch.randn(v.shape) for k, v in Eagle3Draft(config).state_dict().items()}
    tensors["d2t"], tensors["t2d"] = vocab.d2t, vocab.t2d
    ckpt = Checkpoint("memory", config, tensors, "memory")
    with tempfile.TemporaryDirectory() as tmp:
        for i, fmt in enumerate(["eagle", "speculators", "training", "eagle", "speculators"]):
            save_checkpoint(ckpt, Path(tmp) / str(i), fmt)
            ckpt = load_checkpoint(Path(tmp) / str(i))
            assert torch.equal(ckpt.tensors["d2t"], vocab.d2t), fmt
            assert torch.equal(ckpt.tensors["t2d"], vocab.t2d), fmt


def test_llama31_rope_written_in_both_spellings_and_read_from_either(tmp_path):
    """Both formats spell RoPE for transformers 4 (`rope_theta` + `rope_scaling`) and 5
    (`rope_parameters`), so a reader on either generation gets the same draft; a file
    with either spelling alone (the old `type` key too) reads as the same draft."""
    src = make_ckpt(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072,
                    aux_layer_ids=[1, 2, 3])  # fmt: skip
    save_checkpoint(src, tmp_path / "e", "eagle", with_embeddings=True)
    save_checkpoint(src, tmp_path / "s", "speculators", verifier="v", with_embeddings=True)
    eagle_file, spec_file = tmp_path / "e/config.json", tmp_path / "s/config.json"
    eagle_cfg, spec_cfg = json.loads(eagle_file.read_text()), json.loads(spec_file.read_text())
    layer = spec_cfg["transformer_layer_config"]
    for cfg in (eagle_cfg, layer):
        assert (cfg["rope_theta"], cfg["rope_scaling"]) == (500000.0, LLAMA3_ROPE)
        assert cfg["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 500000.0}
    old_style = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"} | {"type": "llama3"}
    del eagle_cfg["rope_theta"], eagle_cfg["rope_scaling"]
    del layer["rope_parameters"]
    layer["rope_scaling"] = old_style
    eagle_file.write_text(json.dumps(eagle_cfg))
    spec_file.write_text(json.dumps(spec_cfg))
    for folder in ("e", "s"):
        assert_same(src, load_checkpoint(tmp_path / folder))


def test_a_sliding_window_is_named_not_dropped_silently(tmp_path, caplog):
    """speculators 0.9.0 trains its drafts with a 2048-token window by default."""
    save_checkpoint(make_ckpt(), tmp_path / "s", "speculators")
    cfg = json.loads((tmp_path / "s/config.json").read_text())
    cfg["transformer_layer_config"].update(use_sliding_window=True, sliding_window=2048)
    (tmp_path / "s/config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING):
        load_checkpoint(tmp_path / "s")
    assert "s/config.json: transformer_layer_config: field 'sliding_window' is 2048" in caplog.text
    cfg["transformer_layer_config"]["use_sliding_window"] = False  # Qwen2's way of turning it off
    (tmp_path / "s/config.json").write_text(json.dumps(cfg))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_checkpoint(tmp_path / "s")
    assert "sliding_window" not in caplog.text
