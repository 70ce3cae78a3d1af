"""benchmarks/engine_text.py: the draft replayed over a run's plain text guesses what the
decoder's own draft prefill guesses there, so a gap it shows between engines is the texts'."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from eagletools.decode.engine import SpeculativeDecoder
from eagletools.decode.model import Transformer
from eagletools.draft import Eagle3Draft

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "engine_text.py"


def load_script():
    spec = importlib.util.spec_from_file_location("engine_text_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@torch.inference_mode()
def _decoder_guess(spec: SpeculativeDecoder, seq: list[int]) -> int:
    """The decoder's draft guess after `seq`: its prefill's last row, as `generate` starts."""
    ids = torch.tensor(seq)
    spec.reset()
    spec.session.reserve(len(seq) + 8)
    spec._grow_cache()
    _, aux = spec.model(ids[None], torch.arange(len(seq)), 0, None, spec.session.aux_ids)
    logits, _ = spec._refresh(aux[0, :-1], ids[1:], 0)
    return int(spec.draft.to_target_ids(logits[-1].argmax()))


@pytest.mark.parametrize("prompt_len", [10, 60])  # rows within a masked prefill, and past it
def test_replay_guesses_as_the_decoder_does_and_counts_only_hits(prompt_len):
    script = load_script()
    seed = int(torch.randint(0, 10_000, ()))  # fresh inputs each run
    model = tiny_model("llama", seed=seed % 97, vocab_size=256).eval()
    n = model.config.num_hidden_layers
    torch.manual_seed(seed)
    draft = Eagle3Draft.from_target(model, aux_layer_ids=[1, n // 2, n - 1]).eval()
    runtime = Transformer.from_hf(model, torch.float32)
    spec = SpeculativeDecoder(runtime, draft, tokenizer=None, topk=1, depth=1, num_draft_tokens=2)
    prompt = torch.randint(0, 256, (prompt_len,)).tolist()
    reply = torch.randint(0, 256, (1,)).tolist()
    while len(reply) < 16:  # the text the draft would write: every next token its guess
        reply.append(_decoder_guess(spec, prompt + reply))
    assert script.step0_hits(runtime, spec.draft, prompt, reply) == (15, 15)
    changed = reply[:8] + [(reply[8] + 1) % 256] + reply[9:]
    hits, total = script.step0_hits(runtime, spec.draft, prompt, changed)
    assert total == 15 and hits < 15  # the changed token itself is a miss
