"""The decoder on its Triton path: greedy speculative output equals the baseline.

On CUDA the decoder runs every kernel, inside CUDA graphs; here
`EAGLETOOLS_KERNELS=triton` forces the same path onto CPU tensors under
Triton's interpreter, and the graphed calls run eagerly on their static
buffers (the start read on the device, as replays read it). Triton reads
`TRITON_INTERPRET` at import, so the check runs in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from conftest import tiny_model
from eagletools import kernels
from eagletools.decode import BaselineDecoder, SpeculativeDecoder, Transformer
from eagletools.decode.graphs import StaticCall
from eagletools.draft import Eagle3Draft
from eagletools.kernels import attention, draft_topk, greedy_verify, kv_compact

calls = {}
for module, name in [(attention, "tree_attention_triton"), (draft_topk, "topk_d2t_triton"),
                     (greedy_verify, "verify_greedy_triton"), (kv_compact, "compact_kv_triton")]:
    def counted(*args, _f=getattr(module, name), _n=name, **kwargs):
        calls[_n] = calls.get(_n, 0) + 1
        return _f(*args, **kwargs)
    setattr(module, name, counted)

torch.manual_seed(0)
model = tiny_model("llama", seed=3, vocab_size=96)
runtime = Transformer.from_hf(model)
n = model.config.num_hidden_layers
draft = Eagle3Draft.from_target(model, aux_layer_ids=[n, n, n])
h = draft.config.hidden_size
with torch.no_grad():  # proposes the target's own last prediction: often accepted
    draft.fc.weight.zero_()
    draft.fc.weight[:, :h] = torch.eye(h)
    draft.midlayer.self_attn.o_proj.weight.zero_()
    draft.midlayer.mlp.down_proj.weight.zero_()
prompt = [5, 17, 33, 2, 9, 41, 7]
base = BaselineDecoder(runtime, None).generate(prompt, 24)
spec = SpeculativeDecoder(runtime, draft, None, topk=2, depth=3, num_draft_tokens=6)
for name in ("verify_forward", "refresh"):  # as CUDA graphs replay: the start on the device
    setattr(spec, name, StaticCall(getattr(spec, "_" + name), runtime.device, spec._caches, False))
out = spec.generate(prompt, 24)
assert out.tokens == base.tokens, (out.tokens, base.tokens)
assert sum(out.accepted) > 0, "no draft accepted: the check would not exercise compaction"
print(sorted(calls.items()))
"""


def test_speculative_equals_baseline_on_the_triton_path():
    tests = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1", EAGLETOOLS_KERNELS="triton")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tests)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kernel in ("tree_attention_triton", "topk_d2t_triton", "verify_greedy_triton",
                   "compact_kv_triton"):  # fmt: skip
        assert f"'{kernel}'" in proc.stdout, proc.stdout


def test_forcing_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    import pytest
    import torch

    from eagletools.kernels import use_triton

    monkeypatch.setenv("EAGLETOOLS_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))
    monkeypatch.setenv("EAGLETOOLS_KERNELS", "reference")
    assert not use_triton(torch.zeros(1))
