"""Shared fixtures: tiny random targets of each supported family.

Tiny configs keep unit tests in seconds on 2 cores; the real built-in target
is used only by tests marked `integration`.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


# the widths the tiny targets and tiny drafts share
TINY_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_config(family: str, **overrides):
    """A 4-layer random config of `family` with GQA and a 256-token vocab."""
    from transformers import AutoConfig

    common = dict(
        **TINY_SIZES,
        num_hidden_layers=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        common["head_dim"] = 16
    common.update(overrides)
    return AutoConfig.for_model(family, **common)


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    return model.eval()


@pytest.fixture(autouse=True)
def tune_cache(tmp_path, monkeypatch) -> Path:
    """Where a test's tree shape tunes are cached: never the user's eagletools cache."""
    path = tmp_path / "tuned_shapes.json"
    monkeypatch.setattr("eagletools.decode.tuning.cache_path", lambda: path)
    return path


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def smollm2_shaped(**overrides):
    """SmolLM2-135M's layer shapes (576 wide, 9 heads on 3 KV heads of 64, MLP 1536) in
    2 layers: at these widths oneDNN's one-row kernel rounds apart (`cpu_ops`)."""
    fields = dict(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        num_hidden_layers=2,
        intermediate_size=1536,
        max_position_embeddings=1024,
    )
    return tiny_model("llama", seed=0, **(fields | overrides))


def tiny_draft_config(**overrides):
    """A small draft config sized like the tiny targets (hidden 64, vocab 256)."""
    from eagletools.draft import DraftConfig

    fields = dict(**TINY_SIZES, head_dim=16, draft_vocab_size=100, target_hidden_size=64)
    fields.update(overrides)
    return DraftConfig(**fields)


# Llama-3.1's RoPE: what transformers 4 dropped when only `rope_parameters` was read
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama31_model(seed: int = 0, **overrides):
    """A tiny Llama with Llama-3.1's RoPE (theta 500k, llama3 scaling) and 131,072 positions."""
    rope = {**LLAMA31_ROPE, "rope_theta": 500000.0}
    return tiny_model(
        "llama", seed, rope_parameters=rope, max_position_embeddings=131072, **overrides
    )


def transformers4_spelling(config):
    """`config` as transformers 4 spells it: `rope_theta` beside a `rope_scaling`
    keyed by the old `type`, and no `rope_parameters`."""
    from types import SimpleNamespace

    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("rope_")}
    scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    scaling["type"] = scaling.pop("rope_type")
    theta = config.rope_parameters["rope_theta"]
    return SimpleNamespace(**fields, rope_theta=theta, rope_scaling=scaling)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A local HF folder: tiny random Llama + a byte tokenizer with a chat template."""
    from transformers import ByT5Tokenizer

    folder = tmp_path_factory.mktemp("tiny_target")
    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tiny_model("llama", seed=3, vocab_size=384).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _executable(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_engines(tmp_path, monkeypatch) -> Path:
    """An .engines folder as `make engine-*` lays it out, holding the fake servers."""
    root = tmp_path / "engines"
    fake = Path(__file__).parent / "engines" / "fake_engine.py"
    run_fake = f'#!/bin/sh\nexec "{sys.executable}" "{fake}" "$@"\n'
    _executable(root / "vllm/bin/python", run_fake)
    _executable(root / "llama.cpp/bin/llama-server", run_fake)
    converter = (
        "import sys\nout = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "open(out, 'wb').write(b'GGUF fake target')\n"
    )
    (root / "llama.cpp/src").mkdir(parents=True)
    (root / "llama.cpp/src/convert_hf_to_gguf.py").write_text(converter)
    monkeypatch.setenv("EAGLETOOLS_ENGINES", str(root))
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    for var in ("EAGLETOOLS_VLLM_PYTHON", "EAGLETOOLS_LLAMA_SERVER", "FAKE_ENGINE_MODE"):
        monkeypatch.delenv(var, raising=False)
    return root


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A local HF folder: tiny random Llama + a byte-level BPE tokenizer with Qwen2.5's template."""
    from test_data_chat import QWEN25, byte_bpe_tokenizer

    folder = tmp_path_factory.mktemp("target")
    tokenizer = byte_bpe_tokenizer(QWEN25)
    tiny_model("llama", seed=1, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
