"""Targets: loading by every kind of spec, and aux hidden-state capture (docs/design.md 3.1)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from eagletools.errors import UserError
from eagletools.targets import (
    capture_aux,
    default_aux_layer_ids,
    load_target,
    load_tokenizer,
    resolve_aux_layer_ids,
    resolve_spec,
)


def hf_reference(model, ids, mask, layer_ids):
    out = model(ids, attention_mask=mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1), out.logits


def test_capture_aux_matches_output_hidden_states(family):
    model = tiny_model(family, num_hidden_layers=6)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    modules = [*model.model.layers, model.model.norm, model.model.embed_tokens]
    for layer_ids in (None, [0, 1, 6], [5, 2, 2]):
        hooks = [len(m._forward_hooks) for m in modules]
        got = capture_aux(model, ids, mask, layer_ids)
        assert [len(m._forward_hooks) for m in modules] == hooks  # removed again
        want_ids = layer_ids or [2, 3, 3]
        aux, logits = hf_reference(model, ids, mask, want_ids)
        assert got.aux.shape == (2, 11, 64 * 3)
        torch.testing.assert_close(got.aux, aux, rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(got.last_hidden), logits, rtol=0, atol=0)


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(32) == [2, 16, 29]
    with pytest.raises(UserError, match="at least 4"):
        default_aux_layer_ids(3)


def test_resolve_aux_layer_ids_keeps_a_choice_and_defaults_otherwise():
    assert resolve_aux_layer_ids((5, 1, 9), 30) == [5, 1, 9]  # the user's order kept
    assert resolve_aux_layer_ids(None, 30) == [2, 15, 27]
    assert resolve_aux_layer_ids([], 32) == [2, 16, 29]


def test_target_info_rope_fields():
    from conftest import tiny_config

    from eagletools.targets import TargetInfo

    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
    info = TargetInfo.from_config(tiny_config("llama", rope_parameters=llama3), "x")
    assert info.rope_theta == 5e5 and info.rope_scaling["rope_type"] == "llama3"
    assert "rope_theta" not in info.rope_scaling and info.rope_scaling["factor"] == 8.0
    info = TargetInfo.from_config(tiny_config("qwen2", rope_theta=1e6), "x")
    assert (info.rope_theta, info.rope_scaling, info.architecture) == (1e6, None, "qwen2")


def test_capture_aux_rejects_out_of_range_ids():
    model = tiny_model("llama")
    with pytest.raises(UserError, match=r"\[5\].*0\.\.4"):
        capture_aux(model, torch.zeros(1, 3, dtype=torch.long), layer_ids=[1, 5])


def test_load_target_from_local_folder(tmp_path, family):
    from test_data_chat import QWEN25, byte_bpe_tokenizer

    tok = byte_bpe_tokenizer(QWEN25)
    model = tiny_model(family, vocab_size=len(tok))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    target = load_target(str(tmp_path), dtype=torch.float32)
    info = target.info
    assert (info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == (
        family,
        4,
        64,
        len(tok),
    )
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (4, 2, 16)
    assert info.architecture == type(model).__name__ and info.has_chat_template
    assert info.rope_theta > 0 and info.max_position_embeddings == 512
    ids = torch.randint(0, len(tok), (1, 7))
    torch.testing.assert_close(target.model(ids).logits, model(ids).logits)
    assert target.tokenizer("hi")["input_ids"] == tok("hi")["input_ids"]
    bf16 = load_target(tmp_path)  # the default dtype
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


def test_hub_id_is_passed_to_transformers_and_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_spec("some-org/some-model") == ("some-org/some-model", {})
    with pytest.raises(UserError, match="could not load the tokenizer of target 'some-org/some"):
        load_tokenizer("some-org/some-model")


def test_bad_target_specs(tmp_path):
    with pytest.raises(UserError, match="not a built-in name; built-in targets: smollm2-135m"):
        load_target("smollm2")
    with pytest.raises(UserError, match="is a dataset, not a target"):
        load_target("sharegpt")
    with pytest.raises(UserError, match="missing.gguf: no such .gguf file"):
        load_target(tmp_path / "missing.gguf")
    with pytest.raises(UserError, match="no config.json"):
        load_target(tmp_path)


def write_gguf(path, arch: str):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_unsupported_architecture(tmp_path, capsys):
    from eagletools.cli import main

    path = tmp_path / "model.gguf"
    write_gguf(path, "mamba2")
    with pytest.raises(UserError, match="architecture mamba2 is not supported.*Llama/Qwen2"):
        load_target(path)
    out = tmp_path / "out"
    argv = ["vocab", "build", "--target", str(path), "--data", "sharegpt", "--size", "8"]
    assert main([*argv, "--output-dir", str(out)]) == 2
    assert "mamba2" in capsys.readouterr().err and not out.exists()


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m", dtype=torch.float32)


@pytest.mark.integration
@pytest.mark.slow  # loads the 135M GGUF in fp32 (~20-40 s)
def test_builtin_smollm2(smollm2):
    info = smollm2.info
    assert info.architecture == "LlamaForCausalLM" and info.model_type == "llama"
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (9, 3, 64)
    assert info.tie_word_embeddings and info.has_chat_template
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    got = capture_aux(smollm2.model, ids)
    aux, logits = hf_reference(smollm2.model, ids, None, [2, 15, 27])
    torch.testing.assert_close(got.aux, aux, rtol=0, atol=0)
    torch.testing.assert_close(smollm2.model.lm_head(got.last_hidden), logits)
    assert smollm2.tokenizer.decode(logits[0, -1].argmax()) == " Paris"


@pytest.mark.integration
@pytest.mark.slow  # dequantises the GGUF directly once more (~20-40 s)
def test_dequantised_cache_equals_direct_gguf_load(smollm2):
    import json

    from transformers import AutoModelForCausalLM

    from eagletools.assets import resolve
    from eagletools.targets.load import dequantised_folder

    folder = dequantised_folder("smollm2-135m")
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    gguf = resolve("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = smollm2.tokenizer("Speculative decoding is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(smollm2.model(ids).logits, direct(ids).logits, rtol=0, atol=0)
    assert smollm2.tokenizer.chat_template and smollm2.tokenizer.eos_token == "<|im_end|>"


def test_rope_of_reads_both_spellings():
    """transformers 5 objects, transformers 4 objects, and both config.json spellings."""
    from conftest import LLAMA31_ROPE, llama31_model, transformers4_spelling

    from eagletools.targets import TargetInfo, rope_of

    config = llama31_model().config
    old = transformers4_spelling(config)
    as_json = {"rope_scaling": dict(old.rope_scaling), "rope_theta": 500000.0}
    for spelled in (config, old, config.to_dict(), as_json, {"text_config": as_json}):
        assert rope_of(spelled) == (500000.0, LLAMA31_ROPE)
    info = TargetInfo.from_config(old, "x")
    assert (info.rope_theta, info.rope_scaling) == (500000.0, LLAMA31_ROPE)
    assert rope_of({}) == (10000.0, None)
    assert rope_of({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)


def test_anatomy_names_the_module_tree():
    from eagletools.targets import decoder_layers, embed_tokens, final_norm, lm_head

    model = tiny_model("qwen3")
    assert decoder_layers(model) is model.model.layers
    assert final_norm(model) is model.model.norm
    assert embed_tokens(model) is model.model.embed_tokens and lm_head(model) is model.lm_head
    with pytest.raises(TypeError, match="Linear"):
        decoder_layers(torch.nn.Linear(2, 2))
