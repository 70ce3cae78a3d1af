"""Bandwidth achieved: weight bytes per token, the cached read bandwidth, the report line."""

from __future__ import annotations

import json

import torch
from conftest import tiny_model

from eagletools.decode import Transformer
from eagletools.eval import bandwidth


def test_weight_bytes_count_every_weight_but_the_embedding_rows():
    runtime = Transformer.from_hf(tiny_model("llama", seed=0), torch.bfloat16)
    every = sum(p.numel() * 2 for p in runtime.parameters())
    assert bandwidth.weight_bytes(runtime) == every - runtime.tok_embeddings.weight.numel() * 2


def test_read_bandwidth_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(bandwidth, "_measure", lambda device: calls.append(device) or 5e10)
    assert bandwidth.read_bandwidth("cpu") == 5e10
    assert bandwidth.read_bandwidth("cpu") == 5e10 and len(calls) == 1
    assert list(json.loads((tmp_path / "read_bandwidth.json").read_text()).values()) == [5e10]


def test_achieved_is_weight_bytes_times_tokens_per_s(monkeypatch):
    monkeypatch.setattr(bandwidth, "read_bandwidth", lambda device: 1e10)
    runtime = Transformer.from_hf(tiny_model("llama", seed=0), torch.bfloat16)
    nbytes = bandwidth.weight_bytes(runtime)
    got = bandwidth.achieved(runtime, {"baseline": 100.0, "hf_generate": None}, "cpu")
    assert got["decoders"] == {
        "baseline": {"gb_per_s": 100 * nbytes / 1e9, "share": 100 * nbytes / 1e10}
    }
    assert bandwidth.achieved(None, {"baseline": 1.0}, "cpu") is None


def test_probe_measures_a_real_bandwidth():
    assert 1e8 < bandwidth._measure(torch.device("cpu"), rounds=2) < 1e13
