"""The offline hidden-state cache: exact contents, size, resume, rank sharding, refusal."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import random_dataset, tiny_config, tiny_target

from eagletools.data import hidden_states as hs
from eagletools.data.hidden_states import HiddenStateCache, write_hidden_states
from eagletools.errors import UserError
from eagletools.targets import capture_aux
from eagletools.train.inputs import offline_inputs
from eagletools.train.trainer import Trainer


def write(target, dataset, path, **kwargs):
    kwargs.setdefault("shard_size", 16)
    return write_hidden_states(target, dataset, path, data_key="k", max_length=64, **kwargs)


def test_cache_holds_the_targets_states(tmp_path):
    target, dataset = tiny_target(), random_dataset(n=40)
    write(target, dataset, tmp_path / "c", batch_tokens=50)
    cache = HiddenStateCache.open(tmp_path / "c")
    assert len(cache) == 40 and len(cache.manifest["shards"]) == 3
    for i in (0, 17, 39):
        ids = torch.tensor(dataset[i]["input_ids"])
        out = capture_aux(target.model, ids[None], layer_ids=cache.aux_layer_ids)
        batch = cache.batch([i])
        assert torch.equal(batch.input_ids[0], ids)
        assert batch.loss_mask[0].tolist() == dataset[i]["loss_mask"]
        torch.testing.assert_close(batch.aux[0].float(), out.aux[0], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(batch.last_hidden[0].float(), out.last_hidden[0],
                                   atol=2e-2, rtol=1e-2)  # fmt: skip
        assert batch.aux.dtype == torch.bfloat16


def test_bytes_per_token_is_the_payload(tmp_path):
    target = tiny_target()
    write(target, random_dataset(n=40), tmp_path / "c", shard_size=64)
    cache = HiddenStateCache.open(tmp_path / "c")
    a, ht = len(cache.aux_layer_ids), target.info.hidden_size
    payload = (a + 1) * ht * 2 + 4 + 1  # bf16 states, int32 id, int8 mask
    assert payload <= cache.bytes_per_token() < payload * 1.02  # + offsets and one header


def test_interrupted_write_resumes_where_it_stopped(tmp_path, monkeypatch):
    target, dataset = tiny_target(), random_dataset(n=40)
    real, calls = hs.atomic_file, []

    def crash_on_third_shard(path):
        calls.append(path)
        if sum("shard-" in str(p) for p in calls) == 3:
            raise KeyboardInterrupt
        return real(path)

    monkeypatch.setattr(hs, "atomic_file", crash_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        write(target, dataset, tmp_path / "c")
    assert not json.loads((tmp_path / "c" / "manifest.json").read_text())["complete"]
    with pytest.raises(UserError, match="incomplete"):
        HiddenStateCache.open(tmp_path / "c")
    monkeypatch.setattr(hs, "atomic_file", real)
    done = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c" / "shards").iterdir()}
    assert sorted(done) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    write(target, dataset, tmp_path / "c")
    again = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c" / "shards").iterdir()}
    assert all(again[name] == mtime for name, mtime in done.items())  # not rewritten
    assert len(HiddenStateCache.open(tmp_path / "c")) == 40


def test_ranks_write_disjoint_shards(tmp_path):
    target, dataset = tiny_target(), random_dataset(n=40)
    write(target, dataset, tmp_path / "c", rank=1, world_size=2)
    names = sorted(p.name for p in (tmp_path / "c" / "shards").iterdir())
    assert names == ["shard-00001.safetensors"]  # rank 1 of 2: shards 1, 3, ...
    write(target, dataset, tmp_path / "c", rank=0, world_size=2)
    assert len(HiddenStateCache.open(tmp_path / "c")) == 40


def test_other_target_or_layers_refused(tmp_path):
    dataset = random_dataset(n=20)
    write(tiny_target(seed=0), dataset, tmp_path / "c")
    with pytest.raises(UserError, match="another target"):
        write(tiny_target(seed=1), dataset, tmp_path / "c")
    with pytest.raises(UserError, match="another aux layer ids"):
        write(tiny_target(seed=0), dataset, tmp_path / "c", layer_ids=[1, 2, 3])
    base = ["data.hidden_states=" + str(tmp_path / "c"), "data.eval_samples=4"]
    with pytest.raises(UserError, match="made for target 'tiny-llama'.*target.spec"):
        offline_inputs(tiny_config(*base, "target.spec=other"))
    with pytest.raises(UserError, match=r"holds aux layers \[2, 2, 1\]"):
        offline_inputs(tiny_config(*base, "target.spec=tiny-llama", "target.aux_layer_ids=[1,2,3]"))


def test_offline_teacher_head_is_in_the_teacher_dtype(tmp_path):
    """Online, fp32 training loads the target in fp32; offline the cache's head (bf16 here)
    is read in that dtype too: an AVX2 CPU runs the full-vocab argmax's bf16 product ~5x
    slower than fp32's (3.1 against 0.64 s for 1,024 tokens of SmolLM2)."""
    write(tiny_target(), random_dataset(n=20), tmp_path / "c")
    base = [
        "target.spec=tiny-llama",
        "target.dtype=bf16",
        "data.hidden_states=" + str(tmp_path / "c"),
    ]
    stored = HiddenStateCache.open(tmp_path / "c").target_skeleton().get_output_embeddings()
    assert stored.weight.dtype is torch.bfloat16
    for precision, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        config = tiny_config(*base, f"training.precision={precision}")
        assert offline_inputs(config).lm_head_weight.dtype is want


def test_offline_training_matches_online_closely(tmp_path):
    """Same data, same steps: the bf16 cache gives nearly the online loss."""
    target, dataset = tiny_target(), random_dataset(n=40)
    write(target, dataset, tmp_path / "c")
    config = tiny_config("training.max_steps=3", "target.spec=tiny-llama",
                         "data.hidden_states=" + str(tmp_path / "c"))  # fmt: skip
    offline = Trainer(config, tmp_path / "off", offline_inputs(config))
    offline.run()
    from test_train import run

    online, _ = run(tmp_path, tiny_config("training.max_steps=3"), "on", target=target,
                    dataset=dataset)  # fmt: skip
    assert offline.train_idx == online.train_idx
    for a, b in zip(offline.history, online.history, strict=True):
        assert abs(a["loss"] - b["loss"]) < 0.05 * abs(b["loss"])
    assert offline.inputs.target_model is None  # the target was never loaded


def test_offline_epochs_reuse_the_target_argmax_exactly(tmp_path, monkeypatch):
    """The memo skips the full-vocab product after epoch 1 and changes no loss."""
    from eagletools.train import trainer as trainer_mod

    write(tiny_target(), random_dataset(n=40), tmp_path / "c")
    config = tiny_config("training.num_epochs=3", "training.max_steps=null",
                         "target.spec=tiny-llama", "data.hidden_states=" + str(tmp_path / "c"))  # fmt: skip
    known = []
    real = trainer_mod.teacher_targets

    def spy(*args, known_argmax=None, **kwargs):
        probs, argmax = real(*args, **kwargs)  # always computed here, to compare
        if known_argmax is not None:
            assert torch.equal(known_argmax, argmax)
            known.append(argmax.shape)
        return probs, argmax

    monkeypatch.setattr(trainer_mod, "teacher_targets", spy)
    memo = Trainer(config, tmp_path / "memo", offline_inputs(config))
    memo.run()
    plain = Trainer(config, tmp_path / "plain", offline_inputs(config))
    plain.argmax_memo = None
    plain.run()
    assert len(memo.argmax_memo.rows) == len(memo.train_idx) + len(memo.eval_idx)
    assert len(known) >= 2 * len(memo.history) // 3  # epochs 2 and 3 (and later evals)
    assert [h["loss"] for h in memo.history] == [h["loss"] for h in plain.history]


def test_offline_in_one_command_builds_then_reuses_the_cache(tmp_path):
    from eagletools.train.trainer import train

    config = tiny_config("data.offline=true", "target.spec=tiny-llama", "training.max_steps=2")
    result = train(config, tmp_path / "o", target=tiny_target(), dataset=random_dataset(n=40))
    assert result["mode"] == "offline" and result["steps"] == 2
    assert HiddenStateCache.is_complete(tmp_path / "o" / "hidden-states")
    # a rerun with the same data reads the cache: it never loads the target ("tiny-llama" is
    # no loadable spec)
    resumed = tiny_config("data.offline=true", "target.spec=tiny-llama", "training.max_steps=3")
    with pytest.raises(UserError, match="another recipe"):
        train(resumed, tmp_path / "o", resume=True, dataset=random_dataset(n=40))
    # other settings are another cache: the stage runs again, and refuses to mix the two
    longer = tiny_config("data.offline=true", "target.spec=tiny-llama", "data.max_length=128")
    with pytest.raises(UserError, match="manifest.json: this cache was made with another max"):
        train(longer, tmp_path / "o", target=tiny_target(), dataset=random_dataset(n=40))


def test_states_kept_while_regenerating_serve_the_cache(tmp_path):
    """data.offline after data.regenerate: each sample takes the states the target computed
    while it wrote the reply, and the reply's tokens as it wrote them; they equal a fresh
    pass over those tokens."""
    from conftest import tiny_model

    from eagletools.data import prepare
    from eagletools.data.captures import Captures
    from eagletools.data.conversations import Message
    from eagletools.data.regenerate import Sampling, local_generator, parts_dir, regenerate
    from eagletools.targets import Target, TargetInfo, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    target = Target(model, tokenizer, TargetInfo.from_config(model.config, "tiny"))
    conversations = [[Message("user", f"question {i} " * (1 + i % 4)), Message("assistant", "x")]
                     for i in range(12)]  # fmt: skip
    layers = [1, 2, 3]
    generate = local_generator(target, Sampling(max_new_tokens=8), 5, capture_layer_ids=layers)
    out = regenerate(conversations, generate, tmp_path / "r.jsonl", identity={}, chunk_size=6)
    assert sorted(p.name for p in parts_dir(out).glob("*.safetensors")) == [
        "part-00000.safetensors", "part-00001.safetensors"]  # fmt: skip
    assert Captures.open(parts_dir(out), [1, 2, 4]) is None  # other layers: not used
    dataset = prepare("tiny", out, 64, tokenizer=tokenizer, cache_dir=tmp_path / "p").dataset
    write(target, dataset, tmp_path / "c", layer_ids=layers, captured=parts_dir(out))
    cache = HiddenStateCache.open(tmp_path / "c")
    replies = [json.loads(line)["messages"][1]["content"] for line in out.open()]
    assert len(cache) == len(dataset) == 12
    for i, sample in enumerate(dataset):
        batch = cache.batch([i])
        ids, mask = batch.input_ids[0].tolist(), batch.loss_mask[0].tolist()
        start = mask.index(1)  # the prompt: the sample's own tokens
        assert ids[:start] == sample["input_ids"][:start] and not any(mask[:start])
        assert all(mask[start:]) and len(ids) > start + 1
        assert tokenizer.decode(ids[start:], skip_special_tokens=True).strip() in replies[i]
        ref = capture_aux(model, batch.input_ids, layer_ids=layers)
        torch.testing.assert_close(batch.aux.float(), ref.aux, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(batch.last_hidden.float(), ref.last_hidden,
                                   atol=3e-2, rtol=2e-2)  # fmt: skip


def test_captures_are_found_by_prompt_and_never_by_a_digest_alone(tmp_path, monkeypatch):
    from eagletools.data import captures as cap

    rows = [cap.Captured([5, 6, 7, 8, 9], 2, torch.randn(4, 6), (1, 2)),
            cap.Captured([1, 2, 3, 4], 3, torch.randn(3, 6), (1, 2))]  # fmt: skip
    cap.write_captures(tmp_path / "part-00000.safetensors", rows)
    found = cap.Captures.open(tmp_path, [1, 2])
    ids, mask, states = found.lookup([1, 2, 3, 40, 41], [0, 0, 0, 1, 1], max_length=64)
    assert ids.tolist() == [1, 2, 3] and mask.tolist() == [0, 0, 0]  # 3 states: the 4th unread
    torch.testing.assert_close(states, rows[1].states.to(torch.bfloat16), rtol=0, atol=0)
    ids, mask, states = found.lookup([5, 6, 70, 80], [0, 0, 1, 1], max_length=3)
    assert ids.tolist() == [5, 6, 7] and mask.tolist() == [0, 0, 1] and len(states) == 3
    assert found.lookup([5, 7, 70], [0, 0, 1], max_length=64) is None  # another prompt
    monkeypatch.setattr(cap, "_digest", lambda tokens: b"same")  # every prompt collides
    colliding = cap.Captures.open(tmp_path, [1, 2])
    assert colliding.lookup([9, 9, 70], [0, 0, 1], max_length=64) is None
    assert colliding.lookup([5, 6, 70], [0, 0, 1], max_length=64)[0].tolist() == [5, 6, 7, 8]
