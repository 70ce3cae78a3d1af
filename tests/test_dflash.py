"""DFlash, the third draft kind: its training block is what the decoder's one forward
computes, its speculative decoding equals plain decoding, its config is checked."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_draft_config, tiny_model
from test_decode_engine import V, tokenizer  # noqa: F401  (a fixture)

from eagletools.decode.engine import BaselineDecoder, SpeculativeDecoder
from eagletools.decode.model import Transformer
from eagletools.draft import DFlashDraft, DraftConfig, DraftKVCache
from eagletools.errors import UserError
from eagletools.kinds import KINDS, kind_of
from eagletools.train.block import BlockModel
from eagletools.train.ttt import teacher_targets


def tiny_dflash(seed: int = 0, **fields) -> DFlashDraft:
    torch.manual_seed(seed)
    fields = dict(kind="dflash", mask_token_id=7, block_size=5, qk_norm=True,
                  draft_vocab_size=256, num_hidden_layers=2) | fields  # fmt: skip
    draft = DFlashDraft(tiny_draft_config(**fields))
    with torch.no_grad():  # norms away from 1, so that a misplaced one shows
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 2.0)
    return draft


def block_logits(draft: DFlashDraft, ids, aux, anchor: int) -> torch.Tensor:
    """The decoder's block after position `anchor`: the context 0..anchor refreshed,
    then one forward over [token anchor+1, mask...] -> logits [block_size, Vd]."""
    c = draft.config
    n, s = anchor + 1, c.block_size
    cache = DraftKVCache.allocate(c, 1, n + s, torch.float32, "cpu")
    slots = torch.arange(n)
    draft.refresh(aux[:, :n], ids[:, 1 : n + 1], slots, cache, slots, None)
    slots = torch.arange(n, n + s)
    mask = torch.ones(s, n + s, dtype=torch.bool)
    block_ids = draft.block_ids(ids[0, n])[None]
    return draft.decode(None, block_ids, slots, cache, slots, mask)[0][0]


@pytest.mark.parametrize("layers", [1, 3])
def test_the_training_block_is_the_decoders_block(layers):
    """Training's block after position t and the decoder's refresh-then-block are one
    computation: same inputs, positions and attention (fp32, to 1e-5)."""
    draft = tiny_dflash(num_hidden_layers=layers).eval()
    c, t = draft.config, 16
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c.vocab_size, (1, t), generator=g)
    aux = torch.randn(1, t, c.num_aux_states * c.target_hidden_size, generator=g)
    with torch.no_grad():
        trained = draft.lm_head(BlockModel(draft, chunk=5).block_states(ids, aux, None))
    for anchor in (0, 6, t - 2):
        torch.testing.assert_close(block_logits(draft, ids, aux, anchor), trained[0, anchor],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_anchored_blocks_are_the_full_pass_at_those_anchors():
    """A training step's sampled anchors compute what every-position anchoring does there,
    and draw only positions whose first proposal is taught while there are enough."""
    draft = tiny_dflash().eval()
    c, t = draft.config, 24
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, c.vocab_size, (2, t), generator=g)
    aux = torch.randn(2, t, c.num_aux_states * c.target_hidden_size, generator=g)
    model = BlockModel(draft, chunk=6, anchor_share=0.25)
    loss_mask = torch.ones(2, t)
    loss_mask[1, :10] = 0
    anchors, scale = model.sample_anchors(loss_mask, None)
    assert anchors.shape == (2, 6) and (anchors[1] >= 8).all()  # t+2 taught from 10 on
    torch.testing.assert_close(scale, torch.tensor([22 / 6, 14 / 6]))
    with torch.no_grad():
        full = model.block_states(ids, aux, None)
        some = model.block_states(ids, aux, None, anchors)
    expected = full.gather(1, anchors[..., None, None].expand(-1, -1, *full.shape[2:]))
    torch.testing.assert_close(some, expected, atol=1e-5, rtol=1e-5)


def test_packed_rows_see_their_own_conversation_only():
    """A block in a row's second conversation computes as if that conversation were alone
    (positions restart, the first conversation's context unseen)."""
    draft = tiny_dflash().eval()
    c = draft.config
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, c.vocab_size, (1, 20), generator=g)
    aux = torch.randn(1, 20, c.num_aux_states * c.target_hidden_size, generator=g)
    documents = torch.tensor([[0] * 8 + [1] * 12])
    model = BlockModel(draft, chunk=7)
    with torch.no_grad():
        packed = model.block_states(ids, aux, documents)[0, 8:16]
        alone = model.block_states(ids[:, 8:], aux[:, 8:], None)[0, :8]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_the_objective_learns_and_reports_every_depth():
    draft = tiny_dflash(block_size=4)
    c, t = draft.config, 24
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, c.vocab_size, (2, t), generator=g)
    aux = torch.randn(2, t, c.num_aux_states * c.target_hidden_size, generator=g)
    probs, argmax = teacher_targets(torch.randn(2, t, c.target_hidden_size, generator=g),
                                    torch.randn(c.vocab_size, c.target_hidden_size), draft.d2t)  # fmt: skip
    model = BlockModel(draft)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 3e-3)
    losses = []
    for _ in range(30):
        loss, stats = model(ids, aux, torch.ones(2, t), probs, argmax)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert stats.count.shape == (2, 3)  # block 4: three depths
    _, longer = model(ids, aux, torch.ones(2, t), probs, argmax, steps=5)
    assert longer.count.shape == (2, 5) and longer.count[:, 3:].sum() == 0


@pytest.mark.parametrize("shape", [(1, 4, 5), (3, 3, 8), (1, 2, 3)])
def test_greedy_dflash_speculative_equals_baseline(family, shape, tokenizer):  # noqa: F811
    model = tiny_model(family, seed=3, vocab_size=V)
    runtime = Transformer.from_hf(model)
    baseline = BaselineDecoder(runtime, tokenizer)
    prompts = [list(range(10, 40)), [5, 9, 200, 17, 3, 250]]
    expected = [baseline.generate(p, 40).tokens for p in prompts]
    torch.manual_seed(0)
    draft = DFlashDraft.from_target(model, block_size=5, num_hidden_layers=2)
    spec = SpeculativeDecoder(runtime, draft, tokenizer, *shape)
    assert [spec.generate(p, 40).tokens for p in prompts] == expected


def test_dflash_refuses_what_it_cannot_run():
    sizes = tiny_draft_config().to_dict() | {"kind": "dflash", "qk_norm": True}
    good = sizes | {"mask_token_id": 7, "block_size": 8}
    assert kind_of(DraftConfig(**good)) is KINDS["dflash"]
    cases = [({"block_size": 1}, "'block_size' is 1"), ({"mask_token_id": None}, "'mask_token_id'"),
             ({"qk_norm": False}, "'qk_norm'"), ({"norm_before_residual": True}, "'norm_before_residual'")]  # fmt: skip
    for change, message in cases:
        with pytest.raises(UserError, match=f"x.json: field {message}"):
            kind_of(DraftConfig(**good | change), "x.json")
    for other in ("eagle3", "peagle"):
        with pytest.raises(UserError, match="'block_size' is set.*only a DFlash"):
            kind_of(DraftConfig(**good | {"kind": other}), "x.json")


def test_engines_run_a_dflash_draft_at_its_trained_block(tmp_path, caplog):
    """vLLM runs K+1 query slots for whatever K it is told; a DFlash draft's slots see
    each other, so `eval --engine` asks for the trained block, not --depth."""
    from eagletools.decode.session import Settings
    from eagletools.engines import ENGINES
    from eagletools.eval.engine_runner import launch_args
    from eagletools.formats import Checkpoint, save_checkpoint

    draft = tiny_dflash(aux_layer_ids=[1, 2, 3], block_size=6)
    tensors = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    save_checkpoint(Checkpoint("memory", draft.config, tensors, "memory"), tmp_path / "d",
                    "speculators")  # fmt: skip
    from test_formats import save_target_folder

    save_target_folder(tmp_path / "t", tiny_model("llama", vocab_size=256))
    settings = Settings(target=str(tmp_path / "t"), draft=str(tmp_path / "d"), depth=3)
    args, _ = launch_args(settings, ENGINES["vllm"])
    assert args["draft_kind"] == "dflash" and args["num_speculative_tokens"] == 5
    assert "proposes its whole trained block: 5 tokens a step, not --depth 3" in caplog.text


def test_anchored_attention_scores_no_key_past_a_chunks_last_anchor(monkeypatch):
    """At 32k tokens a chunk's fp32 scores over every key would be 2 GiB (32 heads): the
    keys after its last (sorted) anchor, masked anyway, are not scored."""
    from eagletools.train import block

    seen = []
    real = block._anchored_chunk
    monkeypatch.setattr(block, "_anchored_chunk", lambda q, ck, *rest: (seen.append(ck.shape[2]), real(q, ck, *rest))[1])  # fmt: skip
    q, k = torch.randn(1, 4, 6 * 2, 8), torch.randn(1, 2, 6 * 2, 8)
    context = torch.randn(1, 2, 100, 8)
    anchors = torch.tensor([[3, 5, 9, 40, 41, 60]])
    with torch.no_grad():
        block.anchored_attention(q, k, k, context, context, anchors, 2, 4, None)
    assert seen == [6, 41, 61]  # chunks of 2 anchors (4 rows / 2 slots)


def test_anchored_attention_reads_the_device_once_per_call():
    """Each chunk's end comes from the anchors, which live on the device: read one by one,
    a 32k-token row's ~64 chunks would stall a GPU 64 times per layer and step."""
    from torch.overrides import TorchFunctionMode

    from eagletools.train import block

    class HostReads(TorchFunctionMode):
        reads = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__):
                HostReads.reads += 1
            return func(*args, **(kwargs or {}))

    q, k = torch.randn(1, 4, 6 * 2, 8), torch.randn(1, 2, 6 * 2, 8)
    context = torch.randn(1, 2, 100, 8)
    anchors = torch.tensor([[3, 5, 9, 40, 41, 60]])
    with torch.no_grad(), HostReads():
        block.anchored_attention(q, k, k, context, context, anchors, 2, 2, None)
    assert HostReads.reads == 1  # 6 chunks of one anchor
