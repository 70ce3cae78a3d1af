"""The compiled target forward (`decode.model.compiled`) and the compiled speculative
step (`SpeculativeDecoder(compile=True)`): what they compute, and that compiled
speculative decoding still equals compiled plain decoding in bf16.

Inductor compiles each graph once per process (tens of seconds here), so the
module shares one runtime per dtype.
"""

from __future__ import annotations

import pytest
import torch
from conftest import smollm2_shaped
from test_decode_engine import repeat_draft
from test_decode_exact import path_mismatches

from eagletools.decode import BaselineDecoder, Sampling, SpeculativeDecoder, Transformer
from eagletools.decode.model import compiled


@pytest.fixture(scope="module")
def bf16():
    model = smollm2_shaped()
    runtime = Transformer.from_hf(model, torch.bfloat16)
    runtime.set_exact(True)
    return model, runtime, compiled(runtime)


@torch.inference_mode()
def test_compiled_steps_follow_the_eager_ones_through_the_cache():
    """Several decode steps in fp32: the compiled forward writes and reads the KV
    cache (not frozen into the graph with the weights) as the eager one does, and
    follows the cache when it grows midway (a new tensor of another shape; dynamo
    recompiles for it whatever guards `compiling.frozen_module_guards` keeps)."""
    runtime = Transformer.from_hf(smollm2_shaped(), torch.float32)
    forward = compiled(runtime)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, 30), generator=g)
    steps = torch.randint(0, 256, (6,), generator=g)
    logits = {}
    for name, fn in (("eager", runtime), ("compiled", forward)):
        runtime.setup_caches(1, 64)
        runtime(prompt, torch.arange(30), 0)
        rows = []
        for i, t in enumerate(steps):
            if i == 3:
                runtime.reserve(300)  # a grown copy: another tensor, another shape
            rows.append(fn(t.view(1, 1), torch.tensor([30 + i]), 30 + i)[0][0, -1])
        logits[name] = torch.stack(rows)
    assert runtime.cache_len >= 300
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_compiled_tree_verify_equals_compiled_one_token_decoding_in_bf16(bf16):
    _, runtime, forward = bf16
    assert path_mismatches(runtime, seed=3, trials=8, forward=forward) == 0


@pytest.mark.parametrize("layers", [1, 2])
@torch.inference_mode()
def test_compiled_speculative_decoding_equals_compiled_plain_decoding_in_bf16(bf16, layers):
    model, runtime, forward = bf16
    draft = repeat_draft(model, layers)  # accepted where the target repeats itself
    prompts = [list(range(10, 40)), [5, 9, 200, 17, 3, 250]]
    plain = BaselineDecoder(runtime, None, forward=forward)
    spec = SpeculativeDecoder(runtime, draft, None, 2, 3, 6, compile=True)
    for prompt in prompts:
        expected = plain.generate(prompt, 48)
        got = spec.generate(prompt, 48)
        assert got.tokens == expected.tokens
    assert got.tau > 1.25  # the tree paths, compaction and refresh ran


@pytest.mark.parametrize("depth", [1, 2])
@torch.inference_mode()
def test_compiled_chain_equals_plain_and_compiles_once_per_cache(bf16, depth):
    """Chains (what autotuning picks on 2 CPU cores) equal compiled plain decoding, and
    later steps and prompts reuse the step's graph: its length and root token are
    dynamic, so nothing compiles again while the cache keeps its size. With the tree's
    depths computed inside the graph, a 3-node chain verified apart from plain decoding
    on 3 of 8 random prompts until graphs kept the program's bf16 roundings
    (`compile_frozen`)."""
    model, runtime, forward = bf16
    plain = BaselineDecoder(runtime, None, forward=forward)
    spec = SpeculativeDecoder(runtime, repeat_draft(model), None, 1, depth, depth + 1, compile=True)
    runtime.reserve(200)  # one allocation for every prompt below
    spec.generate([7, 8, 9], 4)  # compiles
    taus = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in ([5, 9, 200, 17, 3, 250], list(range(60, 100))):
            expected = plain.generate(prompt, 40)
            got = spec.generate(prompt, 40)
            assert got.tokens == expected.tokens
            taus.append(got.tau)
    assert max(taus) > 1.2  # drafts were accepted, the cache compacted


@torch.inference_mode()
def test_compiled_speculative_sampling_follows_the_eager_step():
    """Sampling through the compiled step (uniforms drawn outside the graph) takes the
    eager step's decisions in fp32, from the same generator seed."""
    model = smollm2_shaped()
    runtime = Transformer.from_hf(model, torch.float32)
    draft = repeat_draft(model)
    sampling = Sampling(temperature=1.0, top_p=0.9)
    runs = {}
    for compile in (False, True):
        spec = SpeculativeDecoder(runtime, draft, None, 2, 3, 6, compile=compile)
        gen = torch.Generator().manual_seed(5)
        runs[compile] = spec.generate(list(range(10, 40)), 32, sampling, generator=gen)
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].accepted == runs[False].accepted
