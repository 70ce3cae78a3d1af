"""Hub datasets (`--data org/name`, `data.train=org/name`) with `datasets.load_dataset` mocked:
no hub is reachable here, so the tests check what reaches that boundary and what comes back."""

from __future__ import annotations

import json

import pytest
from test_data_chat import CORPUS

from eagletools.cli import main
from eagletools.data import HubOptions, Message, load_conversations
from eagletools.errors import UserError

REPO = "someorg/chats"


def ultrachat_row(i: int) -> dict:
    """HuggingFaceH4/ultrachat_200k's shape: messages plus the prompt columns."""
    user, reply = CORPUS[i % 4], CORPUS[(i + 1) % 4]
    return {
        "prompt": user,
        "prompt_id": f"p{i}",
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
    }


def sharegpt_row(i: int) -> dict:
    user, reply = CORPUS[i % 4], CORPUS[(i + 1) % 4]
    return {
        "id": str(i),
        "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}],
    }


def expected(i: int) -> list[Message]:
    return [Message("user", CORPUS[i % 4]), Message("assistant", CORPUS[(i + 1) % 4])]


class FakeHub:
    """Stands in for `datasets.load_dataset`: records each call, serves `rows` as the split
    named `split` (a Dataset, or an IterableDataset when streaming)."""

    def __init__(self, rows: list[dict], split: str = "train_sft"):
        self.rows, self.split, self.calls = rows, split, []

    def __call__(self, path, split=None, revision=None, streaming=False, **kwargs):
        import datasets

        self.calls.append({"path": path, "split": split, "revision": revision,
                           "streaming": streaming, **kwargs})  # fmt: skip
        if split != self.split:  # what datasets itself raises
            raise ValueError(f"Unknown split \"{split}\". Should be one of ['{self.split}'].")
        ds = datasets.Dataset.from_list(self.rows)
        return ds.to_iterable_dataset() if streaming else ds


@pytest.fixture
def hub(monkeypatch):
    def install(rows: list[dict], split: str = "train_sft") -> FakeHub:
        import datasets

        fake = FakeHub(rows, split)
        monkeypatch.setattr(datasets, "load_dataset", fake)
        return fake

    return install


@pytest.mark.parametrize("row,layout", [(ultrachat_row, "UltraChat"), (sharegpt_row, "ShareGPT")])
def test_hub_id_reaches_load_dataset_with_split_and_revision(hub, row, layout):
    fake = hub([row(i) for i in range(5)])
    conversations, report = load_conversations(REPO, hub=HubOptions("train_sft", "abc123"))
    assert fake.calls == [
        {"path": REPO, "split": "train_sft", "revision": "abc123", "streaming": False}
    ]
    assert conversations == [expected(i) for i in range(5)]
    assert any(n.startswith(f"layout: {layout}") for n in report.notes)

    # --num-samples streams and takes the first usable rows only
    conversations, report = load_conversations(REPO, 2, HubOptions("train_sft"))
    assert fake.calls[-1]["streaming"] is True
    assert conversations == [expected(0), expected(1)] and report.read == 2


@pytest.mark.parametrize("row,layout", [(ultrachat_row, "UltraChat"), (sharegpt_row, "ShareGPT")])
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_layouts_detected_on_files(tmp_path, kind, row, layout):
    import datasets

    rows = [row(i) for i in range(3)]
    path = tmp_path / f"d.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    conversations, report = load_conversations(path)
    assert conversations == [expected(i) for i in range(3)]
    if kind == "parquet":  # a columnar file names its layout once
        assert any(n.startswith(f"layout: {layout}") for n in report.notes)


def test_older_ultrachat_data_column(hub):
    hub([{"id": "0", "data": ["Hi", "Hello!", "Bye", "Goodbye."]}])
    conversations, report = load_conversations(REPO, hub=HubOptions("train_sft"))
    assert [m.role for m in conversations[0]] == ["user", "assistant"] * 2
    assert any("UltraChat (older)" in n for n in report.notes)


def test_unknown_split_names_the_id_the_split_and_the_splits(hub):
    hub([ultrachat_row(0)], split="train_sft")
    with pytest.raises(UserError) as err:
        load_conversations(REPO, hub=HubOptions("train"))
    message = str(err.value)
    assert REPO in message and "'train'" in message and "train_sft" in message
    assert "--data-split" in message


def test_no_known_columns_lists_the_columns_found(hub, tmp_path):
    hub([{"text": "hello", "label": 1}])
    with pytest.raises(UserError, match=r"found \['label', 'text'\].*Known layouts") as err:
        load_conversations(REPO, hub=HubOptions("train_sft"))
    assert "conversations = [{from, value}]" in str(err.value)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hello", "label": 1}) + "\n")
    with pytest.raises(UserError, match=r"found \['label', 'text'\]"):
        load_conversations(path)


def test_num_samples_beyond_the_data_is_reported(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(sharegpt_row(i)) + "\n" for i in range(3)))
    with caplog.at_level("WARNING"):
        conversations, report = load_conversations(path, num_samples=10)
    assert len(conversations) == 3
    shortfall = "--num-samples 10 asks for more than the data has: 3 usable conversations"
    assert shortfall in report.summary() and shortfall in caplog.text


def test_cli_prepare_flags_reach_the_loader_and_bad_split_writes_nothing(
    hub, target_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    fake = hub([ultrachat_row(i) for i in range(3)])
    argv = ["data", "prepare", "--target", str(target_dir), "--data", REPO]
    assert main([*argv, "--data-split", "test_sft"]) == 2
    err = capsys.readouterr().err
    assert f"hub dataset {REPO}: no split 'test_sft' (it has: train_sft)" in err
    assert not list((tmp_path / "cache" / "prepared").glob("[!.]*"))
    argv += ["--data-split", "train_sft", "--data-revision", "v1", "--data-streaming"]
    assert main([*argv, "--num-samples", "5"]) == 0
    assert fake.calls[-1] == {
        "path": REPO, "split": "train_sft", "revision": "v1", "streaming": True
    }  # fmt: skip
    out = capsys.readouterr().out
    assert "--num-samples 5 asks for more than the data has: 3" in out
    assert "prepared 3 samples" in out


def test_recipe_hub_id_trains_a_tiny_target(hub, target_dir, tmp_path, monkeypatch):
    """data.train=<hub id> in a recipe override: the loader gets data.split/data.revision
    and a tiny target trains on the rows it returns."""
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    fake = hub([ultrachat_row(i) for i in range(24)])
    out = tmp_path / "run"
    argv = [
        "train", f"target.spec={target_dir}", "target.dtype=float32", f"data.train={REPO}",
        "data.split=train_sft", "data.revision=refs/convert/parquet", "data.max_length=128",
        "data.eval_samples=4", "vocab.draft_vocab_size=64", "training.max_steps=2",
        "training.batch_size=4", "training.ttt_steps=2", "training.eval_ttt_steps=2",
        "training.precision=fp32", "training.eval_every=0", "training.save_every=0",
        "--output-dir", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert fake.calls == [{
        "path": REPO, "split": "train_sft", "revision": "refs/convert/parquet", "streaming": False
    }]  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2
    assert (out / "final" / "model.safetensors").is_file()


def test_recipe_hub_fields_are_typed():
    from eagletools.train.recipe import load_config

    config = load_config(None, ["data.split=test_sft", "data.streaming=true"])
    assert config.data.hub() == HubOptions("test_sft", None, True)
    with pytest.raises(UserError, match="data.streaming must be bool"):
        load_config(None, ["data.streaming=maybe"])
    with pytest.raises(UserError, match="data.split must name a split"):
        load_config(None, ["data.split=''"])
