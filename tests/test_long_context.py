"""Long prompts through the decode runtime: SDPA's fused kernels, never the math
kernel's full [heads, T, S] score matrix (docs/design.md, GPU scale)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from eagletools import attention
from eagletools.decode.model import Transformer


def test_long_prefill_and_a_long_turn_after_it_match_hf(family, monkeypatch):
    """A 200-token prefill (causal, no mask) and 120 more tokens after it (chunked
    masks: 3 chunks of 48) give Hugging Face's logits."""
    monkeypatch.setattr(attention, "CAUSAL_CHUNK", 48)
    model = tiny_model(family, seed=3, max_position_embeddings=512)
    runtime = Transformer.from_hf(model)
    runtime.setup_caches(1, 512)
    ids = torch.randint(0, 256, (1, 320), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits
    first = runtime(ids[:, :200], torch.arange(200), 0)[0]
    second = runtime(ids[:, 200:], torch.arange(200, 320), 200)[0]
    assert (torch.cat([first, second], dim=1) - ref).abs().max() <= 1e-4


PEAK = """
import re, sys
import torch
sys.path.insert(0, {tests!r})
from conftest import tiny_draft_config, tiny_model

def peak_kb():  # VmHWM: ru_maxrss would carry over the forking pytest's peak
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\\s+(\\d+)", status).group(1))

n, half = {n}, {n} // 2
ids = torch.randint(0, 256, (1, n))
sizes = dict(max_position_embeddings=n, num_attention_heads=8, num_key_value_heads=2)
torch.set_grad_enabled(False)
"""

# a prompt, then a long turn after it, through the target runtime
TARGET = """
from eagletools.decode.model import Transformer

runtime = Transformer.from_hf(tiny_model("llama", num_hidden_layers=2, **sizes))
runtime.setup_caches(1, n)
runtime(ids[:, :8], torch.arange(8), 0)  # allocator and kernels warm, tiny
before = peak_kb()
runtime(ids[:, :half], torch.arange(half), 0)
runtime(ids[:, half:], torch.arange(half, n), half)
print((peak_kb() - before) * 1024)
"""

# the draft's prompt pass after a prefix, as the decoder's refresh runs it (no mask)
DRAFT = """
from eagletools.draft import Eagle3Draft
from eagletools.draft.model import DraftKVCache

config = tiny_draft_config(**sizes)
draft = Eagle3Draft(config).eval()
cache = DraftKVCache.allocate(config, 1, n, torch.float32, "cpu")
draft.decode(torch.randn(1, 8, 64), ids[:, :8], torch.arange(8), cache, torch.arange(8), None)
before = peak_kb()
slots = torch.arange(half, n)
draft.decode(torch.randn(1, half, 64), ids[:, half:], slots, cache, slots, None)
print((peak_kb() - before) * 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("part", [TARGET, DRAFT], ids=["target", "draft"])
def test_16k_tokens_never_build_the_score_matrix(part):
    """A 16k-token prompt in two turns (the target runtime), or its second turn (the
    draft), grows the process far less than one layer's scores."""
    n = 16384
    script = PEAK.format(tests=str(Path(__file__).parent), n=n) + part
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    grew = int(run.stdout.strip().splitlines()[-1])
    scores = 8 * (n // 2) * n * 4  # one layer's fp32 [heads, T, S] for the second turn
    assert grew < scores / 8, (grew, scores)


def test_the_drafts_long_refresh_matches_its_masked_one():
    """The draft's prompt pass without a mask (over 64 tokens, after a prefix) gives what
    the masked pass gave."""
    from conftest import tiny_draft_config

    from eagletools.decode.model import extend_mask
    from eagletools.draft import Eagle3Draft
    from eagletools.draft.model import DraftKVCache

    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_draft_config()).eval()
    g = torch.Generator().manual_seed(1)
    start, n = 30, 100
    hidden = torch.randn(1, n, draft.config.hidden_size, generator=g)
    ids = torch.randint(0, 256, (1, n), generator=g)
    slots = start + torch.arange(n)
    outs = []
    for mask in (extend_mask(start, n), None):
        cache = DraftKVCache.allocate(draft.config, 1, 256, torch.float32, "cpu")
        cache.k.normal_(generator=torch.Generator().manual_seed(2))
        cache.v.normal_(generator=torch.Generator().manual_seed(3))
        outs.append(draft.decode(hidden, ids, slots, cache, slots, mask))
    for masked, fused in zip(*outs, strict=True):
        assert (masked - fused).abs().max() <= 1e-5


def test_long_attention_runs_on_cpus_flash_kernel(monkeypatch):
    """With only the flash kernel allowed, SDPA raises rather than fall back to the math
    kernel: both the maskless prompt and the chunked turn after a prefix run on it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(attention, "CAUSAL_CHUNK", 48)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 120, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 300, 16, generator=g)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        attention.causal_attention(q, k[:, :, :120], v[:, :, :120])
        attention.causal_attention(q, k, v)
