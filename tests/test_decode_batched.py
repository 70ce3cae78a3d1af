"""Batched generation (data regeneration) equals batch-1 decoding row by row."""

from __future__ import annotations

import torch
from conftest import tiny_model

from eagletools.decode.batched import generate_batch
from eagletools.decode.engine import BaselineDecoder
from eagletools.decode.model import Transformer
from eagletools.decode.sampling import Sampling


def test_left_padded_batch_equals_one_by_one(family):
    torch.manual_seed(0)
    model = tiny_model(family, seed=5, vocab_size=384)
    runtime = Transformer.from_hf(model)  # fp32: shifted RoPE positions change only rounding
    prompts = [list(range(10, 40)), [5, 9, 200, 17, 3, 250], [7], list(range(100, 190, 3))]
    eos = {int(BaselineDecoder(runtime, None).generate(prompts[1], 12).tokens[5])}
    baseline = BaselineDecoder(runtime, None)
    baseline.session.eos_ids = eos
    expected = [baseline.generate(p, 24).tokens for p in prompts]
    assert any(len(e) < 24 for e in expected) and any(len(e) == 24 for e in expected)
    got = generate_batch(runtime, prompts, 24, eos, pad_id=3).tokens
    assert got == expected
    # the batch-1 decoder takes the (resized) cache back, reusing nothing, and still agrees
    again = baseline.generate(prompts[0], 24)
    assert again.tokens == expected[0] and again.reused_tokens == 0


def test_prompts_read_in_chunks_give_the_same_tokens_and_states(monkeypatch):
    """A prompt wider than `prefill_chunk` is read a chunk a forward (the [B,T,S] mask
    bounded by the chunk), each chunk attending to the cache the earlier ones wrote."""
    model = tiny_model("qwen2", seed=8, vocab_size=384)
    runtime = Transformer.from_hf(model)
    prompts = [list(range(10, 47)), [5, 9, 200, 17, 3, 250], list(range(100, 190, 3))]
    layers = [1, 3, model.config.num_hidden_layers]
    whole = generate_batch(runtime, prompts, 10, set(), pad_id=3, state_layer_ids=layers)
    widths = []
    forward = Transformer.forward

    def spy(self, input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    chunked = generate_batch(runtime, prompts, 10, set(), pad_id=3, state_layer_ids=layers,
                             prefill_chunk=8)  # fmt: skip
    assert widths[:6] == [8, 8, 8, 8, 5, 1]  # 37 prompt columns, then a token a step
    assert chunked.tokens == whole.tokens
    for a, b in zip(chunked.states, whole.states, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_sampled_rows_are_seeded_and_stop_at_max_tokens():
    model = tiny_model("llama", seed=6, vocab_size=384)
    runtime = Transformer.from_hf(model)
    prompts = [[1, 2, 3], list(range(20, 45))]
    sampling = Sampling(temperature=0.8, top_p=0.9)
    runs = [
        generate_batch(
            runtime, prompts, 16, set(), sampling, generator=torch.Generator().manual_seed(s)
        ).tokens
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] != runs[2]
    assert all(len(row) == 16 for row in runs[0])


def test_states_kept_on_the_way_equal_a_forward_over_each_finished_row():
    """What regeneration keeps for the offline cache: the prompt's and the read-back
    tokens' states, as `capture_aux` computes them over the row alone (bf16 rounding)."""
    from eagletools.targets import capture_aux

    model = tiny_model("llama", seed=7, vocab_size=384)
    runtime = Transformer.from_hf(model)
    prompts = [list(range(10, 40)), [5, 9, 200, 17, 3, 250], [7]]
    first = generate_batch(runtime, prompts, 12, set()).tokens
    # an EOS that ends row 1 early and no other row: they run to the last step
    stop = next(j for j in range(2, 12)
                if first[1][j] not in first[1][:j] + first[0] + first[2])  # fmt: skip
    eos = {first[1][stop]}
    layers = [1, 2, model.config.num_hidden_layers]  # aux states, then the final norm's
    out = generate_batch(runtime, prompts, 12, eos, pad_id=3, state_layer_ids=layers)
    assert len(out.tokens[1]) == stop + 1 and len(out.tokens[0]) == 12
    for prompt, new, states in zip(prompts, out.tokens, out.states, strict=True):
        read = len(new) if len(new) < 12 else 11  # the last step's token is never read
        assert states.shape == (len(prompt) + read, 3 * model.config.hidden_size)
        assert states.dtype == torch.bfloat16
        ids = torch.tensor([prompt + new])[:, : states.shape[0]]
        ref = capture_aux(model, ids, layer_ids=layers[:2])
        expected = torch.cat([ref.aux, ref.last_hidden], dim=-1)[0]
        torch.testing.assert_close(states.float(), expected, atol=2e-2, rtol=2e-2)
