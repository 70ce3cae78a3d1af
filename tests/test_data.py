"""Conversation loading: formats, repairs, bad input, and the prepared-data cache."""

from __future__ import annotations

import gzip
import json

import pytest

from eagletools.cli import main
from eagletools.data import Message, load_conversations
from eagletools.errors import UserError

SHAREGPT = {
    "id": "a",
    "conversations": [
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Bye"},
        {"from": "chatgpt", "value": "Goodbye."},
    ],
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "4"},
    ]
}
ULTRACHAT = {"id": "u", "data": ["What is Rust?", "A language.", "Fast?", "Yes."]}
EXPECTED = [
    [Message("user", "Hi"), Message("assistant", "Hello!"),
     Message("user", "Bye"), Message("assistant", "Goodbye.")],
    [Message("system", "Be brief."), Message("user", "2+2?"), Message("assistant", "4")],
    [Message("user", "What is Rust?"), Message("assistant", "A language."),
     Message("user", "Fast?"), Message("assistant", "Yes.")],
]  # fmt: skip


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "kind", ["json", "jsonl", "jsonl.gz", "json-lines", "parquet", "saved", "folder"]
)
def test_formats_normalise_to_one_form(tmp_path, kind):
    import datasets

    records = [SHAREGPT, OPENAI, ULTRACHAT]
    if kind == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(records, indent=1))
    elif kind == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", records)
    elif kind == "jsonl.gz":
        path = tmp_path / "d.jsonl.gz"
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    elif kind == "json-lines":  # what `datasets.to_json` writes: JSON lines named .json
        path = write_jsonl(tmp_path / "d.json", records)
    else:  # one schema per file for Arrow/Parquet: OpenAI-style messages
        plain = {"messages": [{"role": m.role, "content": m.content} for m in EXPECTED[1]]}
        records = [plain, plain]
        ds = datasets.Dataset.from_list(records)
        if kind == "parquet":
            path = tmp_path / "d.parquet"
            ds.to_parquet(str(path))
        elif kind == "saved":
            path = tmp_path / "saved"
            ds.save_to_disk(str(path))
        else:  # a folder of data files, read by datasets.load_dataset
            path = tmp_path / "folder"
            path.mkdir()
            ds.to_parquet(str(path / "train-00000.parquet"))
    conversations, report = load_conversations(path)
    expected = EXPECTED if kind.startswith("json") else [EXPECTED[1]] * 2
    assert conversations == expected
    assert (report.read, report.kept, sum(report.dropped.values())) == (len(records),) * 2 + (0,)


def test_repairs_and_drops_are_counted(tmp_path):
    def sg(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    records = [
        sg(("gpt", "leftover"), ("human", "q"), ("gpt", "a")),  # leading reply removed
        sg(("human", "q1"), ("human", "q2"), ("gpt", ""), ("gpt", "a"), ("human", "tail")),
        sg(("human", "q"), ("system", "late"), ("bard", "a")),  # late system removed
        sg(("human", "only a question")),  # no assistant turn
        sg(("human", "q"), ("robot", "a")),  # unknown role
        sg(),  # empty
        {"text": "no turn list"},
        "not an object",
    ]
    conversations, report = load_conversations(write_jsonl(tmp_path / "d.jsonl", records))
    assert conversations == [
        [Message("user", "q"), Message("assistant", "a")],
        [Message("user", "q1\n\nq2"), Message("assistant", "a")],
        [Message("user", "q"), Message("assistant", "a")],
    ]
    assert report.read == 8 and report.kept == 3
    assert dict(report.dropped) == {
        "no_assistant_turn": 1, "unknown_role": 1, "empty": 1,
        "no_turn_list": 1, "not_an_object": 1,
    }  # fmt: skip
    assert dict(report.repaired) == {
        "leading_assistant_removed": 1, "consecutive_turns_merged": 1,
        "empty_message_removed": 1, "trailing_user_removed": 1, "late_system_removed": 1,
    }  # fmt: skip
    assert "kept 3" in report.summary() and "no_assistant_turn: 1" in report.summary()


def test_num_samples_takes_the_first_usable(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": []}, SHAREGPT, OPENAI, ULTRACHAT])
    conversations, report = load_conversations(path, num_samples=2)
    assert conversations == EXPECTED[:2] and report.read == 3
    with pytest.raises(UserError, match="at least 1"):
        load_conversations(path, num_samples=0)


def test_truncated_json_array_recovers_whole_records(tmp_path):
    text = json.dumps([SHAREGPT, OPENAI, ULTRACHAT])
    cut = text.index('"Fast?"')  # inside the third record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    conversations, report = load_conversations(path)
    assert conversations == EXPECTED[:2]
    assert report.dropped["truncated_tail"] == 1
    at = text.index(json.dumps(ULTRACHAT))
    assert f"at character {at} " in report.notes[0]
    assert f"({cut - at} characters lost" in report.notes[0]


def test_unclosed_json_array_loses_nothing(tmp_path):
    path = tmp_path / "open.json"
    path.write_text("  [" + json.dumps(SHAREGPT) + ",\n")
    conversations, report = load_conversations(path)
    assert conversations == EXPECTED[:1] and not report.dropped
    assert report.notes == ["the file ends without the closing ] of its array"]


def test_malformed_jsonl_line_names_its_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(SHAREGPT) + "\n\n" + '{"messages": [\n' + json.dumps(OPENAI) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl: line 3 is not valid JSON"):
        load_conversations(path)


def test_missing_and_unknown_sources(tmp_path):
    with pytest.raises(UserError, match="no such file.*known: sharegpt"):
        load_conversations(tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match="not a built-in dataset"):
        load_conversations("sharegtp")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unknown data format"):
        load_conversations(tmp_path / "d.csv")
    path = write_jsonl(tmp_path / "none.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(UserError, match="no usable conversation"):
        load_conversations(path)


def test_cli_prepare_bad_input_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json}\n")
    target = tmp_path / "target"
    _save_tiny_target(target)
    code = main(["data", "prepare", "--target", str(target), "--data", str(path)])
    assert code == 2
    assert "line 1 is not valid JSON" in capsys.readouterr().err
    assert not list((tmp_path / "cache" / "prepared").glob("[!.]*"))


def _save_tiny_target(folder, template: str | None = "qwen2.5"):
    from test_data_chat import TEMPLATES, byte_bpe_tokenizer

    byte_bpe_tokenizer(TEMPLATES[template][0] if template else None).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 400}))


def test_cli_prepare_chat_template_option(tmp_path, monkeypatch, capsys):
    from test_data_chat import LLAMA3

    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    _save_tiny_target(tmp_path / "target", template=None)
    data = write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, {"messages": []}])
    argv = ["data", "prepare", "--target", str(tmp_path / "target"), "--data", str(data)]
    assert main(argv) == 2
    assert "has no chat template; pass --chat-template FILE" in capsys.readouterr().err
    (tmp_path / "llama3.jinja").write_text(LLAMA3)
    assert main([*argv, "--chat-template", str(tmp_path / "llama3.jinja")]) == 0
    out = capsys.readouterr().out
    assert "read 2 records, kept 1" in out and "dropped 1 (empty: 1)" in out
    assert "prepared 1 samples" in out


def test_prepare_caches_and_is_independent_of_num_proc(tmp_path, monkeypatch):
    from eagletools.data import prepare

    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target"
    _save_tiny_target(target)
    records = [SHAREGPT, OPENAI, ULTRACHAT, {"messages": []}] * 5
    data = write_jsonl(tmp_path / "d.jsonl", records)
    one = prepare(target, data, max_length=256, num_samples=12)
    assert one.dataset.column_names == ["input_ids", "loss_mask"]
    assert len(one.dataset) == 12 and one.report["load"]["dropped"] == {"empty": 3}
    again = prepare(target, data, max_length=256, num_samples=12)
    assert again.path == one.path
    two = prepare(target, data, 256, 12, num_proc=2, cache_dir=tmp_path / "other")
    assert two.key == one.key and two.path != one.path
    assert two.dataset[:] == one.dataset[:]
    # each part of the key changes it
    assert prepare(target, data, 128, 12).key != one.key
    assert prepare(target, data, 256, 11).key != one.key
    write_jsonl(data, records[::-1])
    assert prepare(target, data, 256, 12).key != one.key


@pytest.mark.integration
def test_builtin_sharegpt_recovers_17671_conversations():
    conversations, report = load_conversations("sharegpt")
    assert report.dropped["truncated_tail"] == 1
    assert report.read == 17671  # whole records before the cut
    assert "characters lost" in report.notes[0]
    assert report.kept == len(conversations) and report.kept > 17000
    assert all(c[-1].role == "assistant" for c in conversations)
