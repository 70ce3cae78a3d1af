"""The trainer on tiny random targets: resume, bad input, trackers, the final checkpoint."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from conftest import tiny_model

from eagletools.errors import UserError
from eagletools.targets import Target, TargetInfo
from eagletools.train import trainer as trainer_mod
from eagletools.train.checkpoint import checkpoint_dir
from eagletools.train.data import even_shards, plan_epoch, split_indices
from eagletools.train.inputs import online_inputs, regeneration_job
from eagletools.train.recipe import load_config
from eagletools.train.schedule import FINISH_SECONDS
from eagletools.train.trainer import Trainer, train
from eagletools.train.ttt import TTTModel


class Interrupted(Exception):
    pass


def interrupted_and_resumed(tmp_path, monkeypatch, config, after: int) -> dict[int, float]:
    """Losses by step of a run stopped (as Ctrl-C would) after step `after`, then resumed."""
    step = Trainer.train_step

    def interrupted(trainer):
        if trainer.state.step == after:
            raise Interrupted
        return step(trainer)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    with pytest.raises(Interrupted):
        run(tmp_path, config, "cut")
    monkeypatch.setattr(Trainer, "train_step", step)
    resumed, _ = run(tmp_path, config, "cut", resume=True)
    return {h["step"]: h["loss"] for h in resumed.history}


def tiny_target(family="llama", seed=0) -> Target:
    model = tiny_model(family, seed=seed)
    return Target(model, None, TargetInfo.from_config(model.config, f"tiny-{family}"))


def random_dataset(n=40, seed=0, masked=()):
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(n):
        length = int(torch.randint(8, 40, (1,), generator=g))
        rows["input_ids"].append(torch.randint(0, 256, (length,), generator=g).tolist())
        mask = [0] * (length // 3) + [1] * (length - length // 3)
        rows["loss_mask"].append([0] * length if i in masked else mask)
    return datasets.Dataset.from_dict(rows)


def tiny_config(*overrides):
    return load_config(
        None,
        [
            "training.precision=fp32",
            "training.batch_size=4",
            "training.max_steps=8",
            "training.lr=1e-3",
            "training.ttt_steps=3",
            "training.eval_ttt_steps=4",
            "training.save_every=3",
            "training.eval_every=4",
            "data.eval_samples=8",
            "vocab.draft_vocab_size=128",
            *overrides,
        ],
    )


def run(tmp_path, config, name="out", **kwargs):
    inputs = online_inputs(config, kwargs.pop("target", None) or tiny_target(),
                           kwargs.pop("dataset", None) or random_dataset())  # fmt: skip
    trainer = Trainer(config, tmp_path / name, inputs, **kwargs)
    return trainer, trainer.run()


def test_plan_is_deterministic_and_bucketed():
    lengths = [
        int(x) for x in torch.randint(1, 100, (50,), generator=torch.Generator().manual_seed(0))
    ]
    a = plan_epoch(lengths, 4, seed=1, epoch=0, bucket_size=3)
    assert a == plan_epoch(lengths, 4, seed=1, epoch=0, bucket_size=3)
    assert a != plan_epoch(lengths, 4, seed=1, epoch=1, bucket_size=3)
    assert all(len(b) == 4 for b in a) and len(a) == 12
    flat = [i for b in a for i in b]
    assert len(set(flat)) == len(flat)
    for b in a:  # a batch comes from one length-sorted bucket
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    train_idx, eval_idx = split_indices(50, 5, seed=0)
    assert len(eval_idx) == 5 and not set(train_idx) & set(eval_idx)
    with pytest.raises(UserError, match="eval_samples"):
        split_indices(5, 5, seed=0)


def test_train_writes_final_eagle_checkpoint_and_metrics(tmp_path):
    from eagletools.formats import detect_format, load_checkpoint

    trainer, result = run(tmp_path, tiny_config())
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 8 and len(metrics["acc"]) == 4  # the held-out unroll
    assert metrics["precision"] == "fp32"  # what training.precision resolved to
    assert 1.0 <= metrics["simulated_acceptance_length"] <= 5.0
    assert metrics["loss"] == pytest.approx(result["loss"])
    assert detect_format(out / "final") == "eagle"
    final = load_checkpoint(out / "final")
    assert torch.equal(final.tensors["d2t"], trainer.vocab.d2t)
    assert torch.equal(final.tensors["t2d"], trainer.vocab.t2d)
    assert final.config.draft_vocab_size == 128
    torch.testing.assert_close(final.tensors["fc.weight"].float(), trainer.draft.fc.weight)
    steps = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in steps] == ["step-00000006", "step-00000008"]  # keep_last 2
    assert detect_format(steps[-1]) == "training"  # formats reads our checkpoint's draft
    assert torch.equal(load_checkpoint(steps[-1]).tensors["d2t"], trainer.vocab.d2t)


def test_held_out_metrics_carry_the_exact_length_and_intervals(tmp_path):
    _, result = run(tmp_path, tiny_config("training.max_steps=2"))
    for name in ("simulated", "exact"):
        key = f"{name}_acceptance_length"
        assert result[f"{key}_lo"] <= result[key] <= result[f"{key}_hi"]
        assert result[f"{key}_lo"] < result[f"{key}_hi"]  # 8 conversations differ
    assert 1.0 <= result["exact_acceptance_length"] <= 5.0


def test_frozen_head_keeps_the_targets_rows_and_trains_the_norm(tmp_path):
    config = tiny_config("draft.freeze_head=true", "draft.init_head_from_target=false")
    trainer, _ = run(tmp_path, config)
    target_rows = trainer.inputs.lm_head_weight[trainer.vocab.selected]
    assert torch.equal(trainer.draft.lm_head.weight, target_rows)
    assert not trainer.draft.lm_head.weight.requires_grad
    assert not torch.equal(trainer.draft.norm.weight, torch.ones_like(trainer.draft.norm.weight))
    with pytest.raises(UserError, match="draft.freeze_head"):
        tiny_config("draft.freeze_head=true")  # with the target's norm as well


def test_muon_trains_and_resumes_on_the_same_trajectory(tmp_path, monkeypatch):
    config = tiny_config("training.optimizer=muon", "training.max_steps=4",
                         "training.save_every=2", "training.eval_every=0")  # fmt: skip
    full, _ = run(tmp_path, config, "full")
    saved = torch.load(tmp_path / "full/checkpoints/step-00000004/optimizer.pt")
    kinds = {"momentum_buffer" in v for v in saved["state"].values()}
    assert kinds == {True, False}  # Muon's matrices and AdamW's norms and head
    got = interrupted_and_resumed(tmp_path, monkeypatch, config, after=3)
    want = {h["step"]: h["loss"] for h in full.history}
    for n in (3, 4):
        assert abs(got[n] - want[n]) <= 1e-6, (n, got[n], want[n])


def test_vocab_by_the_targets_argmax_counts(tmp_path):
    """The counts are the target's argmax at each position before a reply token,
    computed here with the target's own logits."""
    target, data = tiny_target(), random_dataset()
    config = tiny_config("vocab.count=target_argmax", "vocab.count_samples=10",
                         "vocab.draft_vocab_size=16", "training.max_steps=1")  # fmt: skip
    trainer = Trainer(config, tmp_path / "out", online_inputs(config, target, data))
    counts = torch.zeros(256, dtype=torch.long)
    for i in trainer.train_idx[:10]:
        ids = torch.tensor(data[i]["input_ids"])
        mask = torch.tensor(data[i]["loss_mask"]).bool()
        with torch.no_grad():
            best = target.model(ids[None]).logits[0].argmax(-1)
        counts += torch.bincount(best[:-1][mask[1:]], minlength=256)
    top = torch.sort(-counts, stable=True).indices[:16].sort().values
    assert torch.equal(trainer.vocab.selected, top)
    assert trainer.vocab_report["count"] == "target_argmax"
    assert trainer.vocab_report["num_tokens"] == int(counts.sum())


def test_draft_mlp_width_is_a_recipe_field(tmp_path):
    from eagletools.formats import load_checkpoint

    trainer, _ = run(tmp_path, tiny_config("draft.intermediate_size=96", "training.max_steps=1"))
    assert trainer.draft.midlayer.mlp.up_proj.weight.shape == (96, 64)  # the target's is 128
    final = load_checkpoint(tmp_path / "out" / "final")
    assert final.config.intermediate_size == 96
    assert final.tensors["midlayer.mlp.down_proj.weight"].shape == (64, 96)
    with pytest.raises(UserError, match="draft.intermediate_size"):
        tiny_config("draft.intermediate_size=0")


def test_norm_before_fc_is_a_recipe_field(tmp_path):
    from eagletools.formats import load_checkpoint

    trainer, _ = run(tmp_path, tiny_config("draft.norm_before_fc=true", "training.max_steps=1"))
    assert not torch.equal(trainer.draft.input_norm.weight, torch.ones(3 * 64))  # trained
    final = load_checkpoint(tmp_path / "out" / "final")
    assert final.config.norm_before_fc and final.tensors["input_norm.weight"].shape == (3 * 64,)


def test_zero_regenerated_turns_is_refused():
    with pytest.raises(UserError, match="data.regenerate.max_turns"):
        tiny_config("data.regenerate.max_turns=0")


@pytest.mark.slow
def test_training_lowers_the_held_out_loss(tmp_path):
    """With a peaked teacher (scaled lm_head) the draft has something to learn."""

    def sharp_target():
        target = tiny_target()
        with torch.no_grad():
            target.model.lm_head.weight.mul_(8)
        return target

    results = []
    for steps in (1, 40):
        config = tiny_config(f"training.max_steps={steps}", "training.eval_every=0",
                             "training.lr=3e-3", "training.warmup_ratio=0")  # fmt: skip
        _, r = run(tmp_path, config, f"s{steps}", target=sharp_target(), dataset=random_dataset(80))
        results.append(r)
    before, after = results
    assert after["loss"] < before["loss"] - 0.5
    assert after["acc_0"] > before["acc_0"] + 0.03


def test_loss_on_all_trains_on_prompts_and_evaluates_on_replies(tmp_path, monkeypatch):
    seen = []
    forward = TTTModel.forward

    def spy(self, input_ids, aux, loss_mask, *args, **kwargs):
        seen.append(loss_mask.bool().clone())
        return forward(self, input_ids, aux, loss_mask, *args, **kwargs)

    monkeypatch.setattr(TTTModel, "forward", spy)
    for loss_on in ("replies", "all"):
        config = tiny_config(f"training.loss_on={loss_on}", "training.max_steps=1")
        inputs = online_inputs(config, tiny_target(), random_dataset())
        trainer = Trainer(config, tmp_path / loss_on, inputs)
        seen.clear()
        trainer.train_step()
        trained = list(seen)
        seen.clear()
        trainer.evaluate()
        # random_dataset masks the first third of every sample out of the replies
        assert trained and all(m[:, 0].all() == (loss_on == "all") for m in trained)
        assert seen and not any(m[:, 0].any() for m in seen)  # held-out: replies only


def test_held_out_metrics_do_not_depend_on_the_eval_batch(tmp_path):
    """Conversations of different lengths share a padded batch; each is scored alone."""
    metrics = []
    for size in (1, 3, 8):
        config = tiny_config(f"training.eval_batch_size={size}", "training.max_steps=1")
        trainer = Trainer(
            config, tmp_path / str(size), online_inputs(config, tiny_target(), random_dataset())
        )
        metrics.append(trainer.evaluate())
    assert metrics[0]["loss"] > 0  # per-position losses: what a padding leak would move
    for key in ("loss", "simulated_acceptance_length", "exact_acceptance_length", "acc_0"):
        for other in metrics[1:]:
            assert other[key] == pytest.approx(metrics[0][key], rel=1e-5), key


def test_loss_on_is_checked():
    with pytest.raises(UserError, match="training.loss_on"):
        tiny_config("training.loss_on=prompts")


@pytest.mark.slow
def test_resume_follows_the_same_loss_trajectory(tmp_path, monkeypatch):
    config = tiny_config("training.max_steps=9", "training.save_every=3")
    full, _ = run(tmp_path, config, "full")
    # checkpoint at 3, stopped after 4
    got = interrupted_and_resumed(tmp_path, monkeypatch, config, after=4)
    want = {h["step"]: h["loss"] for h in full.history}
    assert sorted(got) == list(range(1, 10))
    for step in range(4, 10):
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


@pytest.mark.slow
def test_compiled_unroll_follows_the_eager_losses(tmp_path, monkeypatch):
    """training.compile: one inductor graph over the batches' varying lengths (8 to 40
    tokens), the same fp32 losses as eager, and an eager held-out evaluation."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, eager_metrics = run(
        tmp_path, tiny_config("training.max_steps=5", "training.eval_every=0"), "e"
    )
    config = tiny_config("training.max_steps=5", "training.eval_every=0", "training.compile=true")
    # a second graph (a new length, or the 4-step no-grad evaluation) is an error
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    compiled, metrics = run(tmp_path, config, "c")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # it did compile
    assert len(compiled.history) == 5
    for a, b in zip(eager.history, compiled.history, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
    assert abs(metrics["loss"] - eager_metrics["loss"]) <= 1e-4 * eager_metrics["loss"]


def test_compile_without_a_cpu_compiler_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-cxx-eagletools")
    config = tiny_config("training.max_steps=2", "training.compile=true")
    with pytest.raises(UserError, match="training.compile.*no-such-cxx-eagletools.*apt install"):
        run(tmp_path, config)
    assert not (tmp_path / "out" / "final").exists()


def test_resume_refuses_another_recipe(tmp_path):
    run(tmp_path, tiny_config("training.max_steps=3"), "r")
    with pytest.raises(UserError, match="another recipe"):
        run(tmp_path, tiny_config("training.max_steps=3", "training.lr=5e-4"), "r", resume=True)
    with pytest.raises(UserError, match="no checkpoint"):
        run(tmp_path, tiny_config(), "empty", resume=True)


def test_all_masked_samples_are_skipped_and_counted(tmp_path):
    dataset = random_dataset(masked={1, 5, 7})
    _, result = run(tmp_path, tiny_config("training.max_steps=2"), dataset=dataset)
    assert result["skipped_masked_samples"] == 3
    assert result["train_samples"] + result["eval_samples"] == 37


def test_empty_dataset_after_filtering(tmp_path):
    dataset = random_dataset(n=12, masked=set(range(12)))
    with pytest.raises(UserError, match="no training sample is left after filtering"):
        run(tmp_path, tiny_config("data.eval_samples=2"), dataset=dataset)


def test_fewer_samples_than_one_step_takes(tmp_path):
    with pytest.raises(UserError, match="3 training samples are fewer than one optimizer step"):
        run(
            tmp_path,
            tiny_config("data.eval_samples=2", "training.batch_size=4"),
            dataset=random_dataset(n=5),
        )


def poison(monkeypatch, bad_calls):
    """NaN aux states in the listed calls of `features` (a corrupt batch)."""
    real, calls = trainer_mod.features, [0]

    def features(inputs, batch):
        aux, last = real(inputs, batch)
        calls[0] += 1
        if calls[0] in bad_calls:
            aux = aux.clone()
            aux[0, 0, 0] = float("nan")
        return aux, last

    monkeypatch.setattr(trainer_mod, "features", features)


def test_nan_step_is_skipped_and_counted(tmp_path, monkeypatch):
    poison(monkeypatch, bad_calls={2})
    trainer, result = run(tmp_path, tiny_config("training.max_steps=4", "training.eval_every=0"))
    assert result["skipped_nan_steps"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.draft.parameters())
    assert result["loss"] == result["loss"]  # the held-out loss is finite


def test_nan_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    poison(monkeypatch, bad_calls=set(range(3, 100)))
    with pytest.raises(UserError, match="not finite in 3 optimizer steps in a row"):
        run(tmp_path, tiny_config("training.max_bad_steps=3", "training.eval_every=0"))


def test_failed_checkpoint_write_keeps_the_previous(tmp_path, monkeypatch):
    from eagletools.train import checkpoint

    real_save, calls = torch.save, [0]

    def failing_save(obj, path, *args, **kwargs):
        calls[0] += 1
        if calls[0] > 2:  # the second checkpoint (two torch.save calls per checkpoint)
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    with pytest.raises(UserError, match="No space left.*step-00000003 is intact"):
        run(tmp_path, tiny_config())
    ckpts = checkpoint.list_checkpoints(tmp_path / "out" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-00000003"]
    assert not [p for p in (tmp_path / "out" / "checkpoints").iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    resumed, _ = run(tmp_path, tiny_config(), resume=True)
    assert resumed.state.step == 8


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = tiny_config("tracking.report_to=wandb", "training.max_steps=4", "training.log_every=1")
    run(tmp_path, config)
    import wandb

    wandb.teardown()  # stop wandb's writer service: every record is on disk after this
    (run_dir,) = (tmp_path / "out" / "wandb").glob("offline-run-*")
    logged = read_wandb_history(next(run_dir.glob("*.wandb")))
    steps = [r for r in logged if "train/acc_0" in r]
    assert len(steps) == 4
    assert {"train/ploss_0", "train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(steps[0])
    assert any("eval/simulated_acceptance_length" in r for r in logged)


def wandb_records(path):
    """Payloads of a .wandb file: a 7-byte header, then LevelDB-log records
    (crc 4, length 2, type 1: full/first/middle/last) in 32 KiB blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0 and length == 0:  # zero padding to the end of a block
            pos += left
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # full or last: a record is complete
            yield b"".join(parts)
            parts = []


def read_wandb_history(path):
    """The history rows (metric dicts) of an offline wandb run file."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})  # fmt: skip
    return rows


def test_train_entry_point_with_given_target(tmp_path):
    result = train(
        tiny_config("training.max_steps=2"), tmp_path / "o",
        target=tiny_target("qwen3"), dataset=random_dataset(),
    )  # fmt: skip
    assert result["steps"] == 2 and result["mode"] == "online"


def test_tensorboard_tracker_writes_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny_config("tracking.report_to=tensorboard", "training.max_steps=2",
                         "training.log_every=1")  # fmt: skip
    run(tmp_path, config)
    run_dir = tmp_path / "out" / "eagletools"  # project_dir / tracking.project
    acc = EventAccumulator(str(run_dir))  # the run's events (hparams go to a subfolder)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/acc_0", "train/lr", "train/tokens_per_s", "eval/loss"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


@pytest.mark.parametrize("offline", [False, True])
def test_regenerate_section_trains_on_the_targets_own_replies(tmp_path, offline):
    """data.regenerate: OUT/regenerated.jsonl holds the target's replies; training uses it
    (online, or through the hidden-state cache built from it)."""
    from eagletools.data.regenerate import is_regenerated
    from eagletools.targets import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    target = Target(model, tokenizer, TargetInfo.from_config(model.config, "tiny"))
    data = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 3)},
                      {"role": "assistant", "content": "a human answer"},
                      {"role": "user", "content": "and a second turn"},
                      {"role": "assistant", "content": "dropped by max_turns"}]}
        for i in range(24)
    ] + [{"messages": [{"role": "user", "content": "long " * 400},
                       {"role": "assistant", "content": "prompt too long: dropped"}]}]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_config(
        f"data.train={data}", "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=6",
        "data.regenerate.batch_size=5", "data.regenerate.max_prompt_tokens=64",
        "training.max_steps=2", "data.eval_samples=4", f"data.offline={str(offline).lower()}",
        "target.spec=tiny",
    )  # fmt: skip
    result = train(config, tmp_path / "o", target=target)
    regenerated = [json.loads(x) for x in (tmp_path / "o" / "regenerated.jsonl").open()]
    assert len(regenerated) == 24  # the over-long prompt is gone
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in regenerated)
    assert not any(r["messages"][1]["content"] == "a human answer" for r in regenerated)
    assert result["steps"] == 2 and result["mode"] == ("offline" if offline else "online")
    # offline, the cache took the states regeneration kept, and their files are gone
    parts = tmp_path / "o" / "regenerated.jsonl.parts"
    assert not list(parts.glob("*.safetensors"))
    if offline:
        from eagletools.data.hidden_states import HiddenStateCache

        cache = HiddenStateCache.open(tmp_path / "o" / "hidden-states")
        first = cache.batch([0])
        reply = first.input_ids[0, first.loss_mask[0].bool()].tolist()
        text = tokenizer.decode(reply, skip_special_tokens=True).strip()
        assert text and any(r["messages"][1]["content"].startswith(text) for r in regenerated)
    identity = regeneration_job(config, tmp_path / "o" / "regenerated.jsonl").identity()
    # a rerun skips the stage, unless settings differ
    assert is_regenerated(tmp_path / "o" / "regenerated.jsonl", identity)
    assert not is_regenerated(tmp_path / "o" / "regenerated.jsonl", {**identity, "seed": 1})
    with pytest.raises(UserError, match="data.regenerate.max_new_tokens"):
        tiny_config("data.regenerate.max_new_tokens=0")


def test_regenerate_refuses_a_tokenised_dataset(tmp_path):
    config = tiny_config("data.regenerate.enabled=true")
    with pytest.raises(UserError, match="tokenised dataset was passed.*data.regenerate.enabled"):
        train(config, tmp_path / "o", target=tiny_target(), dataset=random_dataset())
    assert not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.parametrize("budget", [500, 2000])
def test_max_tokens_ends_the_run_and_its_schedule(tmp_path, monkeypatch, budget):
    """A token budget, within an epoch (~760 tokens) or over several, ends the run at the
    first step that reaches it, with the schedule done; the epochs follow the tokens."""
    seen, step = [], Trainer.train_step

    def counted(trainer):
        seen.append(trainer.state.tokens)
        return step(trainer)

    monkeypatch.setattr(Trainer, "train_step", counted)
    config = tiny_config("training.max_steps=null", f"training.max_tokens={budget}",
                         "training.eval_every=0", "training.schedule=linear")  # fmt: skip
    trainer, result = run(tmp_path, config)
    assert seen[-1] < budget <= result["trained_tokens"]
    s = trainer.state
    assert abs(trainer.schedule.total - result["steps"]) <= 1
    assert trainer.schedule.progress(s.step, s.tokens, s.seconds) >= 1.0
    assert trainer.state.epoch == (budget > 760) * (budget // 760)
    lrs = [h["lr"] for h in trainer.history]
    assert lrs[-1] < lrs[len(lrs) // 2] < max(lrs)


@pytest.mark.parametrize("n, world", [(33, 8), (32, 8), (3, 4), (5, 1), (0, 2)])
def test_even_shards_give_every_rank_as_many_forwards_and_count_each_item_once(n, world):
    shares = [even_shards(list(range(n)), rank, world) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1  # FSDP2: no rank waits alone
    counted = sorted(item for share in shares for item, keep in share if keep)
    assert counted == list(range(n))


def test_total_minutes_leaves_time_for_the_held_out_pass_and_survives_resume(tmp_path, monkeypatch):
    """The steps get the whole run's budget less what came before training and the
    estimated held-out pass, fixed at the first start: a resumed run keeps it."""
    config = tiny_config("training.max_steps=6", "training.save_every=2",
                         "training.total_minutes=10", "training.schedule=linear")  # fmt: skip
    inputs = online_inputs(config, tiny_target(), random_dataset())
    spent = 120.0
    trainer = Trainer(config, tmp_path / "a", inputs, started=time.perf_counter() - spent)
    budget = trainer.state.budget_s
    assert 600 - spent - FINISH_SECONDS - 30 < budget < 600 - spent - FINISH_SECONDS
    assert trainer.schedule.budget_s == budget
    trainer.state.seconds = budget / 2  # half the time gone: half the decay
    assert trainer.schedule.progress(0, 0, trainer.state.seconds) == pytest.approx(0.5)
    assert not trainer._finished()
    trainer.state.seconds = budget
    assert trainer._finished()

    step = Trainer.train_step

    def interrupted(t):
        if t.state.step == 3:
            raise Interrupted
        return step(t)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    with pytest.raises(Interrupted):
        Trainer(config, tmp_path / "b", inputs, started=time.perf_counter() - spent).run()
    monkeypatch.setattr(Trainer, "train_step", step)
    saved = checkpoint_dir(tmp_path / "b" / "checkpoints", 2) / "trainer_state.json"
    first = json.loads(saved.read_text())["position"]["budget_s"]
    resumed = Trainer(config, tmp_path / "b", inputs, resume=True)  # started now: more time
    assert resumed.state.budget_s == first


def test_total_minutes_refuses_a_run_with_no_time_left_to_train(tmp_path):
    config = tiny_config("training.total_minutes=1")
    inputs = online_inputs(config, tiny_target(), random_dataset())
    with pytest.raises(UserError, match="training.total_minutes=1.*no time to train"):
        Trainer(config, tmp_path / "o", inputs, started=time.perf_counter() - 45)
    with pytest.raises(UserError, match="training.total_minutes"):
        tiny_config("training.total_minutes=0")


def test_max_tokens_is_checked():
    with pytest.raises(UserError, match="training.max_tokens"):
        tiny_config("training.max_tokens=0")


def test_train_oov_skips_the_full_product_in_training_only(tmp_path, monkeypatch):
    """Training every position needs only the draft-vocab rows; the held-out
    metrics (every 4 of 8 steps) still take the target's full-vocab argmax."""
    from eagletools.train import ttt

    calls = {"train": 0, "eval": 0}
    full = ttt.target_argmax

    def counted(*args, **kwargs):
        calls["eval" if evaluating else "train"] += 1
        return full(*args, **kwargs)

    evaluating = False
    evaluate = Trainer.evaluate

    def marked(trainer):
        nonlocal evaluating
        evaluating = True
        try:
            return evaluate(trainer)
        finally:
            evaluating = False

    monkeypatch.setattr(ttt, "target_argmax", counted)
    monkeypatch.setattr(Trainer, "evaluate", marked)
    _, result = run(tmp_path, tiny_config("training.train_oov=true"))
    assert calls["train"] == 0 and calls["eval"] > 0
    assert result["steps"] == 8 and 1 <= result["simulated_acceptance_length"] <= 5


def _swap_parameters_on_prepare(monkeypatch):
    """`prepare` as FSDP2 does it: every draft parameter becomes a new object, and the
    optimizer's groups are remapped to the new ones (what accelerate does itself)."""
    from accelerate import Accelerator

    prepare = Accelerator.prepare

    def swapping(self, model, optimizer):
        model, optimizer = prepare(self, model, optimizer)
        new = {}
        for module in model.draft.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                new[p] = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                setattr(module, name, new[p])
        for group in optimizer.param_groups:
            group["params"] = [new[p] for p in group["params"]]
        return model, optimizer

    monkeypatch.setattr(Accelerator, "prepare", swapping)


def test_clipping_sees_the_parameters_prepare_swapped_in(tmp_path, monkeypatch):
    """FSDP2 replaces the parameters inside `prepare`: the trainer must clip the new
    ones, or clipping sees no gradient, returns 0 and clips nothing."""
    clip = 1e-3

    def one_step(name):
        config = tiny_config("training.max_steps=1", f"training.grad_clip={clip}")
        trainer = Trainer(
            config, tmp_path / name, online_inputs(config, tiny_target(), random_dataset())
        )
        seen = []
        step = trainer.optimizer.step

        def norm_at_step(*args, **kwargs):
            grads = [p.grad for g in trainer.optimizer.param_groups for p in g["params"]]
            seen.append(float(torch.cat([g.flatten() for g in grads if g is not None]).norm()))
            return step(*args, **kwargs)

        trainer.optimizer.step = norm_at_step
        return trainer.train_step()["grad_norm"], seen[0]

    plain, plain_update = one_step("plain")
    _swap_parameters_on_prepare(monkeypatch)
    swapped, swapped_update = one_step("swapped")
    assert plain > clip and swapped == pytest.approx(plain, rel=1e-5)
    assert swapped_update == pytest.approx(clip, rel=1e-3)  # the update was clipped


def test_regeneration_identity_follows_the_chat_template(tmp_path):
    """Prompts are rendered with data.chat_template: replies made under another template,
    or an edited template file, are not reused."""
    template = tmp_path / "chat.jinja"
    identities = []
    for text in ("{{ messages[0]['content'] }}", "{{ messages[-1]['content'] }}"):
        template.write_text(text)
        config = tiny_config(f"data.chat_template={template}")
        identities.append(regeneration_job(config, tmp_path / "r.jsonl").identity())
    identities.append(regeneration_job(tiny_config(), tmp_path / "r.jsonl").identity())
    assert len({json.dumps(i, sort_keys=True) for i in identities}) == 3


def test_frozen_embedding_keeps_the_targets_dtype(tmp_path):
    """The draft's frozen embedding stays in a bf16 target's dtype: an fp32 copy holds the
    same values in twice the bytes (1 GB a process at 8B widths, benchmarks/scale_check.py)."""
    target = tiny_target()
    target.model.to(torch.bfloat16)
    config = tiny_config("training.precision=bf16", "training.max_steps=1")
    trainer = Trainer(config, tmp_path, online_inputs(config, target, random_dataset()))
    embed = trainer.draft.embed_tokens.weight
    assert embed.dtype == torch.bfloat16 and not embed.requires_grad
    assert torch.equal(embed, target.model.get_input_embeddings().weight)
    assert all(p.dtype == torch.float32 for p in trainer.draft.parameters() if p.requires_grad)
    assert math.isfinite(trainer.train_step()["loss"])
