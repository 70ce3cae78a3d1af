"""Target folders eagletools writes load in engines as a causal LM (docs/deploy.md).

vLLM resolves the model class from `architectures` and loads every parameter
of that class by its own name; a tied model saved by `save_pretrained` lacks
`model.embed_tokens.weight`, and a GGUF-read config lacks `architectures`.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open
from test_data_chat import byte_bpe_tokenizer

from eagletools.targets.folder import save_target_folder


def _engine_view(folder):
    """(architecture, {parameter name: shape}) as an engine reading the folder sees them."""
    config = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open is not iterable)
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        dtypes = {f.get_slice(k).get_dtype() for k in names}
    return config, shapes, dtypes


def _expected_parameters(config_dir):
    """Every parameter the HF class declares, built on the meta device from the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tied_target_folder_has_every_parameter_by_name(tmp_path, dtype):
    model = tiny_model("llama", tie_word_embeddings=True, vocab_size=400)
    model.config.architectures = None  # as transformers leaves a GGUF-read config
    tok = byte_bpe_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    save_target_folder(model, tok, tmp_path / "t", dtype)

    config, shapes, dtypes = _engine_view(tmp_path / "t")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert shapes == _expected_parameters(tmp_path / "t")
    assert "model.embed_tokens.weight" in shapes and "lm_head.weight" in shapes
    assert dtypes == {"BF16" if dtype == torch.bfloat16 else "F32"}
    files = {p.name for p in (tmp_path / "t").iterdir()}
    assert {"tokenizer.json", "generation_config.json"} <= files
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "t").chat_template
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32)
    x = torch.tensor([[1, 2, 3]])
    expected = model.to(dtype).float()(x).logits
    torch.testing.assert_close(loaded(x).logits, expected)


@pytest.mark.integration
def test_builtin_target_folder_loads_in_engines(tmp_path):
    """The dequantised built-in (the folder every engine is pointed at) is complete."""
    from eagletools.targets.load import dequantised_folder

    folder = dequantised_folder("smollm2-135m")
    config, shapes, _ = _engine_view(folder)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes == _expected_parameters(folder)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_theta=100000.0),  # SmolLM2's: transformers 4 assumed 10000 without it
        dict(rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ],
    ids=["plain", "llama3"],
)  # fmt: skip
def test_target_folder_spells_rope_for_both_transformers_generations(tmp_path, rope):
    """transformers 5 writes only `rope_parameters`; transformers 4 reads `rope_theta` and
    `rope_scaling` and, without them, runs another model (theta 10000) without an error."""
    model = tiny_model("llama", **copy.deepcopy(rope))  # transformers edits the dict
    tok = byte_bpe_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    save_target_folder(model, tok, tmp_path / "t", torch.float32)
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    scaling = rope.get("rope_scaling")
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    assert config["rope_scaling"] == scaling  # transformers 4: None is plain RoPE
    assert config["rope_parameters"] == {"rope_type": "default", **(scaling or {}),
                                         "rope_theta": rope["rope_theta"]}  # fmt: skip


def test_target_folder_tokenizer_class_exists_in_transformers_4(tmp_path):
    """transformers 5 writes `TokenizersBackend`, which transformers 4 refuses to load."""
    from transformers import AutoTokenizer

    tok = byte_bpe_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    save_target_folder(tiny_model("llama"), tok, tmp_path / "t", torch.float32)
    saved = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(tmp_path / "t")
    assert loaded("hello world").input_ids == tok("hello world").input_ids
    assert loaded.chat_template == tok.chat_template
