"""Sequence packing (training.pack_tokens): each conversation of a packed row is trained,
and seen by the target, exactly as if it were alone; the plan, the recipe field, resume."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, tiny_model
from test_train import interrupted_and_resumed, random_dataset, run, tiny_config, tiny_target
from test_train_ttt import tiny_draft

from eagletools.data.batch import Sample, SampleSource
from eagletools.errors import UserError
from eagletools.train.data import ArgmaxMemo, TokenSamples
from eagletools.train.inputs import TrainInputs, features, load_teacher
from eagletools.train.packing import document_mask, document_positions, plan_packed_epoch
from eagletools.train.ttt import TTTModel, step_counts, teacher_targets

LENGTHS = (9, 14, 6)  # three conversations of different lengths


class Samples(SampleSource):
    """Samples held in memory, with states as the offline cache serves them."""

    def __init__(self, samples: list[Sample]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, index: int) -> int:
        return self.samples[index].input_ids.numel()

    def loss_mask(self, index: int) -> torch.Tensor:
        return self.samples[index].loss_mask

    def sample(self, index: int) -> Sample:
        return self.samples[index]


def conversations(draft, seed=0) -> Samples:
    g = torch.Generator().manual_seed(seed)
    c, out = draft.config, []
    for t in LENGTHS:
        ids = torch.randint(0, c.vocab_size, (t,), generator=g)
        mask = (torch.rand(t, generator=g) > 0.2).long()
        aux = torch.randn(t, 3 * c.target_hidden_size, generator=g)
        out.append(Sample(ids, mask, aux, torch.randn(t, c.target_hidden_size, generator=g)))
    return Samples(out)


def unroll(model, batch, lm_head, loss_mask=None):
    """(loss summed over positions, stats) of a batch; no normalisation."""
    probs, argmax = teacher_targets(batch.last_hidden, lm_head, model.draft.d2t)
    mask = batch.loss_mask if loss_mask is None else loss_mask
    return model(batch.input_ids, batch.aux, mask, probs, argmax,
                 norm=torch.ones(model.steps), documents=batch.documents)  # fmt: skip


def test_packed_row_trains_each_conversation_as_if_alone():
    draft = tiny_draft()
    source = conversations(draft)
    lm_head = torch.randn(draft.config.vocab_size, draft.config.target_hidden_size,
                          generator=torch.Generator().manual_seed(1))  # fmt: skip
    # chunk 4: query chunks start inside conversations and cross their boundaries
    model = TTTModel(draft, steps=4, decay=0.8, chunk=4)
    params = [p for p in draft.parameters() if p.requires_grad]

    alone = [unroll(model, source.batch([i]), lm_head) for i in range(len(LENGTHS))]
    want = torch.autograd.grad(sum(loss for loss, _ in alone), params)

    packed = source.pack([[0, 1, 2]])
    assert packed.input_ids.shape == (1, sum(LENGTHS))
    loss, stats = unroll(model, packed, lm_head)
    got = torch.autograd.grad(loss, params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name in ("loss_sum", "correct", "count", "chain"):
        total = sum(getattr(s, name) for _, s in alone)
        torch.testing.assert_close(getattr(stats, name), total, atol=1e-5, rtol=1e-5)
    assert step_counts(packed.loss_mask, 4, packed.documents).tolist() == stats.count[0].tolist()
    # each conversation's own loss, its tokens alone left in the packed row's mask
    with torch.no_grad():
        for doc, (want_loss, _) in enumerate(alone):
            only = packed.loss_mask * (packed.documents == doc)
            mine, _ = unroll(model, packed, lm_head, only)
            torch.testing.assert_close(mine, want_loss, atol=1e-5, rtol=1e-5)


def test_padded_packed_rows_match_too():
    """Two rows, the shorter padded: padding is seen by nothing but padding."""
    draft = tiny_draft(seed=2)
    source = conversations(draft, seed=3)
    lm_head = torch.randn(draft.config.vocab_size, draft.config.target_hidden_size)
    model = TTTModel(draft, steps=3, chunk=5)
    packed = source.pack([[0, 2], [1]])
    assert packed.documents[1].tolist() == [0] * 14 + [-1] * 1
    with torch.no_grad():
        loss, _ = unroll(model, packed, lm_head)
        alone = sum(unroll(model, source.batch([i]), lm_head)[0] for i in range(3))
    torch.testing.assert_close(loss, alone, atol=1e-5, rtol=1e-5)


SLIDING = {  # windows shorter than the conversations (8-39 tokens), so they bind
    "mistral": dict(sliding_window=5),
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=2),  # 2 full, 2 not
}


@pytest.mark.parametrize(
    "family, overrides",
    [(f, {}) for f in FAMILIES] + list(SLIDING.items()),
    ids=[*FAMILIES, *(f"{f}-sliding" for f in SLIDING)],
)
def test_target_sees_each_packed_conversation_alone(family, overrides):
    """Online: the target's aux and last hidden states of a packed row, fp32, equal
    those of each conversation run alone, a sliding window's layers included."""
    model = tiny_model(family, **overrides)
    source = TokenSamples(random_dataset(n=3, seed=4))
    inputs = TrainInputs(source, model, model.lm_head.weight, [1, 2, 4], model, {})
    packed = source.pack([[0, 1, 2]])
    aux, last = features(inputs, packed)
    for (row, start, end), i in zip(packed.spans(), packed.indices, strict=True):
        want_aux, want_last = features(inputs, source.batch([i]))
        torch.testing.assert_close(aux[row, start:end], want_aux[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last[row, start:end], want_last[0], atol=1e-5, rtol=1e-5)


def test_flex_attention_target_masks_packed_rows_with_a_block_mask(monkeypatch):
    """`target.attention: flex_attention` (the GPU choice at long packs): the packed row
    still equals each conversation alone, a sliding window included, and no dense
    [B,1,T,T] mask is built on the way."""
    import transformers.masking_utils as masking

    model = tiny_model("mistral", **SLIDING["mistral"])
    source = TokenSamples(random_dataset(n=3, seed=4))
    inputs = TrainInputs(source, model, model.lm_head.weight, [1, 2, 4], model, {})
    alone = [features(inputs, source.batch([i])) for i in range(3)]  # SDPA, padding masks
    model.set_attn_implementation("flex_attention")

    def dense(*args, **kwargs):
        raise AssertionError("a dense mask was built for flex attention")

    for name in ("sdpa", "eager"):
        monkeypatch.setitem(masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, dense)
    packed = source.pack([[0, 1, 2]])
    aux, last = features(inputs, packed)
    for (row, start, end), i in zip(packed.spans(), packed.indices, strict=True):
        want_aux, want_last = alone[i]
        torch.testing.assert_close(aux[row, start:end], want_aux[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last[row, start:end], want_last[0], atol=1e-5, rtol=1e-5)


def test_document_mask_and_positions():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = document_mask(docs)
    assert mask.shape == (1, 6, 6)
    assert mask[0, 3].tolist() == [False, False, True, True, False, False]
    assert mask[0, 5].tolist() == [False] * 5 + [True]  # padding sees itself
    assert torch.equal(document_mask(docs, start=2), mask[:, 2:])
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0]]


def test_memo_keeps_each_packed_samples_argmax():
    draft = tiny_draft()
    source = conversations(draft)
    packed = source.pack([[2, 0], [1]])
    argmax = torch.arange(packed.input_ids.numel()).view(packed.input_ids.shape)
    memo = ArgmaxMemo()
    memo.store(packed, argmax)
    assert memo.rows[0].tolist() == list(range(6, 15))  # after sample 2's 6 tokens
    assert torch.equal(memo.lookup(source.pack([[1], [0, 2]]))[1, :15],
                       torch.cat([memo.rows[0], memo.rows[2]]).long())  # fmt: skip


def test_plan_packs_within_the_limit_once_each_and_deterministically():
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(1, 60, (200,), generator=g)] + [150]
    plan = plan_packed_epoch(lengths, 1, 100, seed=1, epoch=0, bucket_size=8)
    rows = [row for batch in plan for row in batch]
    assert all(sum(min(lengths[i], 100) for i in row) <= 100 for row in rows)
    flat = sorted(i for row in rows for i in row)
    assert flat == list(range(len(lengths)))  # every conversation once (nothing dropped)
    assert [200] in rows  # the one longer than a row fills one alone (cut when read)
    assert len(rows) < len(lengths) / 2  # packed: several conversations a row
    assert plan == plan_packed_epoch(lengths, 1, 100, seed=1, epoch=0, bucket_size=8)
    assert plan != plan_packed_epoch(lengths, 1, 100, seed=1, epoch=1, bucket_size=8)
    four = plan_packed_epoch(lengths, 4, 100, seed=1, epoch=0, bucket_size=8)
    assert all(len(b) == 4 for b in four)
    flat = [i for b in four for row in b for i in row]
    assert len(set(flat)) == len(flat)


def test_a_sample_longer_than_a_row_is_cut():
    draft = tiny_draft()
    batch = conversations(draft).pack([[1]], limit=10)
    assert batch.input_ids.shape == (1, 10) and batch.aux.shape[1] == 10


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("training.pack_tokens=-1", "training.pack_tokens must be >= 0"),
        ("training.pack_tokens=32", "training.pack_tokens=32 is shorter than data.max_length=64"),
        ("training.pack_tokens=many", "training.pack_tokens must be int"),
        ("training.pack_tokens=1.5", "training.pack_tokens must be int"),
        ("training.pack_token=128", "unknown key 'training.pack_token'"),
    ],
)
def test_recipe_refuses_bad_pack_tokens(override, match):
    with pytest.raises(UserError, match=match):
        tiny_config("data.max_length=64", override)
    assert tiny_config("data.max_length=64", "training.pack_tokens=64").training.pack_tokens == 64
    assert tiny_config().training.pack_tokens == 0  # off unless asked


def test_target_attention_reaches_the_teacher_or_names_the_fix(target_dir):
    with pytest.raises(UserError, match="target.attention must be one of sdpa, eager, flex"):
        tiny_config("target.attention=flash")
    spec = f"target.spec={target_dir}"
    teacher = load_teacher(tiny_config(spec, "target.attention=flex_attention"))
    assert teacher.model.config._attn_implementation == "flex_attention"
    assert load_teacher(tiny_config(spec)).model.config._attn_implementation == "sdpa"
    with pytest.raises(UserError, match="target.attention: flash_attention_2 cannot run here"):
        load_teacher(tiny_config(spec, "target.attention=flash_attention_2"))


def test_packed_training_runs_and_resumes_on_the_same_trajectory(tmp_path, monkeypatch):
    config = tiny_config("data.max_length=64", "training.pack_tokens=96", "training.batch_size=2",
                         "training.max_steps=5", "training.save_every=2")  # fmt: skip
    full, result = run(tmp_path, config, "full")
    assert full.state.tokens > 2 * 5 * 40  # rows hold more than one 8-40 token conversation
    got = interrupted_and_resumed(tmp_path, monkeypatch, config, after=3)
    for step, loss in ((h["step"], h["loss"]) for h in full.history):
        assert abs(got[step] - loss) <= 1e-6, (step, got[step], loss)
    assert result["steps"] == 5


def test_too_few_packed_rows_for_a_step(tmp_path):
    config = tiny_config("data.max_length=64", "training.pack_tokens=4096",
                         "training.batch_size=2", "training.grad_accum=2")  # fmt: skip
    with pytest.raises(UserError, match="fewer than one optimizer step.*training.pack_tokens"):
        run(tmp_path, config, target=tiny_target())


def test_offline_packed_training_matches_online_closely(tmp_path):
    """The cache's per-sample states packed into rows train as the target's packed forward
    does (the bf16 cache: closely), and the argmax memo fills per sample."""
    from eagletools.data.hidden_states import write_hidden_states
    from eagletools.train.inputs import offline_inputs
    from eagletools.train.trainer import Trainer

    target, dataset = tiny_target(), random_dataset(n=40)
    write_hidden_states(target, dataset, tmp_path / "c", data_key="k", max_length=64)
    packed = ["data.max_length=64", "training.pack_tokens=96", "training.batch_size=2",
              "training.max_steps=3", "training.eval_every=0"]  # fmt: skip
    config = tiny_config(*packed, "target.spec=tiny-llama", f"data.hidden_states={tmp_path / 'c'}")
    offline = Trainer(config, tmp_path / "off", offline_inputs(config))
    offline.run()
    online, _ = run(tmp_path, tiny_config(*packed), "on", target=target, dataset=dataset)
    assert offline.history and len(offline.history) == len(online.history)
    for a, b in zip(offline.history, online.history, strict=True):
        assert abs(a["loss"] - b["loss"]) < 0.05 * abs(b["loss"])
    rows = [row for batch in offline.batches.epoch(0)[:3] for row in batch]
    trained = {offline.train_idx[i] for row in rows for i in row}
    assert max(len(row) for row in rows) > 1
    assert set(offline.argmax_memo.rows) == trained | set(offline.eval_idx)
