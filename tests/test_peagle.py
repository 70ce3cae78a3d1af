"""P-EAGLE, the second draft kind: its unroll is what the decoder's one-forward block
computes, its speculative decoding equals plain decoding, its config is checked."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_draft_config, tiny_model
from test_decode_engine import V, tokenizer  # noqa: F401  (a fixture)

from eagletools.decode.engine import BaselineDecoder, SpeculativeDecoder
from eagletools.decode.model import Transformer, extend_mask
from eagletools.draft import DraftConfig, DraftKVCache, PEagleDraft
from eagletools.errors import UserError
from eagletools.kinds import KINDS, kind_of
from eagletools.train.parallel import ParallelModel
from eagletools.train.ttt import teacher_targets


def tiny_peagle(seed: int = 0, **flags) -> PEagleDraft:
    torch.manual_seed(seed)
    config = tiny_draft_config(kind="peagle", mask_token_id=7, draft_vocab_size=256, **flags)
    draft = PEagleDraft(config)
    with torch.no_grad():  # norms away from 1, so that a misplaced one shows
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 2.0)
    return draft


@pytest.mark.parametrize("layers", [1, 2], ids=["1-layer", "2-layers"])
@pytest.mark.parametrize("fc_norm", [False, True], ids=["plain", "fc_norm"])
def test_unroll_step_j_is_the_decoders_block_slot_j(layers, fc_norm):
    """Training's step j at anchor t and decoding's slot j of the block after t are one
    computation: same inputs, positions and attention (fp32, to 1e-5)."""
    draft = tiny_peagle(num_hidden_layers=layers, fc_norm=fc_norm).eval()
    c, t, steps = draft.config, 14, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c.vocab_size, (1, t), generator=g)
    aux = torch.randn(1, t, c.num_aux_states * c.target_hidden_size, generator=g)
    probs, argmax = teacher_targets(torch.randn(1, t, c.target_hidden_size, generator=g),
                                    torch.randn(c.vocab_size, c.target_hidden_size), draft.d2t)  # fmt: skip
    seen = []
    head = draft.head
    draft.head = lambda out: (seen.append(head(out)[0]), head(out))[1]
    with torch.no_grad():
        ParallelModel(draft, steps)(ids, aux, torch.ones(1, t), probs, argmax)
    del draft.head
    for anchor in (0, 5, t - steps - 2):
        cache = DraftKVCache.allocate(c, 1, t + steps, torch.float32, "cpu")
        n = anchor + 1  # the context: entries 0..anchor (aux at p, token p+1)
        slots = torch.arange(n)
        logits, _ = draft.decode(draft.fuse_aux(aux[:, :n]), ids[:, 1 : n + 1], slots, cache,
                                 slots, extend_mask(0, n))  # fmt: skip
        block_ids, state = draft.mask_inputs(steps - 1, torch.float32)
        slots = torch.arange(n, n + steps - 1)
        block, _ = draft.decode(state[None], block_ids[None], slots, cache, slots,
                                extend_mask(n, steps - 1))  # fmt: skip
        decoded = torch.cat([logits[0, -1:], block[0]])
        trained = torch.stack([step[0, anchor] for step in seen])
        torch.testing.assert_close(decoded, trained, atol=1e-5, rtol=1e-5)


def repeat_peagle(model) -> PEagleDraft:
    """A P-EAGLE draft whose first proposal is the target's own last prediction (as
    test_decode_engine.repeat_draft): it is accepted whenever the target repeats."""
    n = model.config.num_hidden_layers
    draft = PEagleDraft.from_target(model, aux_layer_ids=[n, n, n])
    h = draft.config.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :h] = torch.eye(h)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
    return draft


@pytest.mark.parametrize("shape", [(1, 4, 5), (3, 4, 10), (2, 6, 13)])
def test_greedy_parallel_speculative_equals_baseline(family, shape, tokenizer):  # noqa: F811
    model = tiny_model(family, seed=3, vocab_size=V)
    runtime = Transformer.from_hf(model)
    baseline = BaselineDecoder(runtime, tokenizer)
    prompts = [list(range(10, 40)), [5, 9, 200, 17, 3, 250]]
    expected = [baseline.generate(p, 48).tokens for p in prompts]
    torch.manual_seed(0)
    random = PEagleDraft.from_target(model)
    for draft, accepts in ((repeat_peagle(model), True), (random, False)):
        spec = SpeculativeDecoder(runtime, draft, tokenizer, *shape)
        results = [spec.generate(p, 48) for p in prompts]
        assert [r.tokens for r in results] == expected
        if accepts:
            assert max(r.tau for r in results) > 1.1  # the first proposal alone is accepted


def test_a_block_tree_hangs_each_depths_candidates_under_the_best_before():
    """topk 2, depth 3: the root's two children, then two under the better of them,
    then two under the better of those."""
    draft = tiny_peagle()
    logits = torch.full((3, draft.config.draft_vocab_size), -30.0)
    for depth, (best, second) in enumerate([(11, 12), (21, 22), (31, 32)]):
        logits[depth, best], logits[depth, second] = 0.0, -1.0
    from eagletools.kinds.base import Drafter

    drafter = Drafter(draft, None, lambda ids, hidden: (logits[1:], hidden), None, 2, 3, 7)
    hidden = torch.zeros(draft.config.hidden_size)
    tree = KINDS["peagle"].propose(drafter, 5, logits[0], hidden)
    assert tree.tokens.tolist() == [5, 11, 12, 21, 22, 31, 32]  # in the order drafted
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3, 3]


def test_each_kind_refuses_the_other_kinds_fields():
    sizes = tiny_draft_config().to_dict() | {"mask_token_id": 7}
    with pytest.raises(UserError, match="'mask_token_id' is set.*'peagle'"):
        kind_of(DraftConfig(**sizes), "x.json")
    for bad in (None, 256, -1):
        with pytest.raises(UserError, match=r"x.json: field 'mask_token_id' is"):
            kind_of(DraftConfig(**sizes | {"kind": "peagle", "mask_token_id": bad}), "x.json")
    with pytest.raises(UserError, match="field 'kind' is 'medusa'; known kinds: eagle3, peagle"):
        kind_of(DraftConfig(**sizes | {"kind": "medusa"}), "x.json")
    assert kind_of(DraftConfig(**sizes | {"kind": "peagle"})) is KINDS["peagle"]


def test_the_mask_state_is_kept_until_a_weight_changes():
    draft = tiny_peagle().eval()
    with torch.no_grad():
        first = draft.mask_state(torch.float32)
        assert draft.mask_state(torch.float32) is first
        draft.mask_hidden.add_(1.0)
        second = draft.mask_state(torch.float32)
    assert second is not first and not torch.equal(first, second)
    expected = draft.fuse_aux(draft.mask_hidden.view(-1))
    torch.testing.assert_close(second, expected)


def peagle_checkpoint(**flags):
    from eagletools.formats import Checkpoint

    draft = tiny_peagle(**flags)
    tensors = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    return Checkpoint("training", draft.config, tensors, "memory")


def test_the_speculators_layout_carries_a_peagle_draft_as_vllm_reads_it(tmp_path):
    import json

    from eagletools.formats import load_checkpoint, save_checkpoint

    ckpt = peagle_checkpoint(norm_before_residual=True)
    save_checkpoint(ckpt, tmp_path / "spec", "speculators")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == 7
    assert cfg["architectures"] == ["PEagleDraftModel"]  # what speculators 0.9.0 writes
    assert cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["norm_before_residual"] is True  # vLLM's peagle default is False: written
    back = load_checkpoint(tmp_path / "spec")
    assert (back.config.kind, back.config.mask_token_id) == ("peagle", 7)
    assert torch.equal(back.tensors["mask_hidden"], ckpt.tensors["mask_hidden"])
    assert back.tensors["mask_hidden"].shape == (1, 1, 3 * ckpt.config.target_hidden_size)
    del cfg["norm_before_residual"]  # absent: vLLM's peagle mapping reads false
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(tmp_path / "spec").config.norm_before_residual is False
    del cfg["mask_token_id"]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="config.json: field 'mask_token_id' is None"):
        load_checkpoint(tmp_path / "spec")


@pytest.mark.parametrize("fmt", ["eagle", "gguf"])
def test_layouts_no_engine_serves_p_eagle_from_are_refused(tmp_path, fmt):
    from eagletools.formats import save_checkpoint

    with pytest.raises(UserError, match=f"a P-EAGLE draft has no {fmt} form.*speculators"):
        save_checkpoint(peagle_checkpoint(), tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_the_option_table_serves_p_eagle_from_vllm_only_and_without_fc_norm():
    from eagletools.formats.engines import check_engine

    config = peagle_checkpoint().config
    check_engine(config, "vllm", "d")
    for engine in ("sglang", "sgl-jax", "llama.cpp", "tensorrt-llm", "eagle"):
        with pytest.raises(UserError, match=r"ignores peagle \(recipe field draft.kind\)"):
            check_engine(config, engine, "d")
    with pytest.raises(UserError, match=r"ignores peagle_fc_norm \(recipe field draft.fc_norm\)"):
        check_engine(peagle_checkpoint(fc_norm=True).config, "vllm", "d")
    with pytest.raises(UserError, match="'norm_output' is true, which no P-EAGLE step uses"):
        kind_of(tiny_draft_config(kind="peagle", mask_token_id=7, norm_output=True))


def test_a_peagle_recipe_trains_and_writes_a_speculators_draft(tmp_path):
    import json

    from test_train import run, tiny_config

    from eagletools.formats import detect_format, load_checkpoint

    trainer, result = run(tmp_path, tiny_config("draft.kind=peagle", "training.max_steps=4"))
    assert isinstance(trainer.draft, PEagleDraft)
    assert trainer.draft.mask_hidden.requires_grad
    final = tmp_path / "out" / "final"
    assert detect_format(final) == "speculators"
    ckpt = load_checkpoint(final)
    assert ckpt.config.kind == "peagle"
    assert ckpt.config.mask_token_id == ckpt.config.vocab_size - 1  # the default
    spec = json.loads((final / "config.json").read_text())["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3  # the trained block
    torch.testing.assert_close(ckpt.tensors["mask_hidden"].float(), trainer.draft.mask_hidden)
    assert 1.0 <= result["simulated_acceptance_length"] <= 5.0


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_vllm_drafts_a_peagle_block_in_one_forward(monkeypatch, kind):
    """Without `parallel_drafting` vLLM would draft the P-EAGLE weights a token per forward,
    with only a warning (spec: llm_base_proposer); DFlash is its own method."""
    import json
    from pathlib import Path

    from eagletools.engines import vllm
    from eagletools.engines.base import ServeRequest

    monkeypatch.setattr(vllm, "program", lambda: Path("/venv/bin/python"))
    request = ServeRequest("t", "d", 4, "bfloat16", 8000, 4096, "cpu", 2, draft_kind=kind)
    argv = vllm.launch(request).argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    expected = {"method": "eagle3", "model": "d", "num_speculative_tokens": 4}
    expected |= {"peagle": {"parallel_drafting": True}, "dflash": {"method": "dflash"}}.get(
        kind, {}
    )
    assert spec == expected


@torch.inference_mode()
def test_compiled_parallel_drafting_equals_compiled_plain_decoding_in_bf16():
    """The block's one forward inside the compiled step (`compile_frozen`), a tree of
    each depth's top 2: the same tokens as compiled plain decoding in bf16."""
    from conftest import smollm2_shaped

    from eagletools.decode.model import compiled

    model = smollm2_shaped()
    runtime = Transformer.from_hf(model, torch.bfloat16)
    runtime.set_exact(True)
    plain = BaselineDecoder(runtime, None, forward=compiled(runtime))
    spec = SpeculativeDecoder(runtime, repeat_peagle(model), None, 2, 4, 8, compile=True)
    taus = []
    for prompt in ([5, 9, 200, 17, 3, 250], list(range(10, 40))):
        expected = plain.generate(prompt, 40)
        got = spec.generate(prompt, 40)
        assert got.tokens == expected.tokens
        taus.append(got.tau)
    assert max(taus) > 1.1
