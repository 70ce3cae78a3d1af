"""Regeneration: turn by turn, batched, resumable; a local OpenAI-compatible server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagletools.data.conversations import Message, load_conversations
from eagletools.data.regenerate import (
    Sampling,
    regenerate,
    regenerate_chunk,
    segments,
    server_generator,
)
from eagletools.errors import UserError


def conv(*turns):
    return [Message(role, text) for role, text in turns]


def chats(regenerated):
    return [r.chat for r in regenerated]


CONVERSATIONS = [
    conv(("system", "be brief"), ("user", "hi"), ("assistant", "old"), ("user", "more"),
         ("assistant", "old2")),
    conv(("user", "one"), ("assistant", "old")),
    conv(("user", "a"), ("assistant", "x"), ("user", "b"), ("assistant", "y"), ("user", "c"),
         ("assistant", "z")),
]  # fmt: skip


class FakeServer:
    """An OpenAI-compatible endpoint whose reply names the history it saw."""

    def __init__(self, fail_after=None):
        self.requests: list[dict] = []
        self.fail_after = fail_after
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "fake-target"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if outer.fail_after is not None and len(outer.requests) > outer.fail_after:
                    self._send(500, {"error": "overloaded"})
                    return
                history = "|".join(m["content"] for m in body["messages"])
                self._send(200, {"choices": [{"message": {"content": f" R({history}) "}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def test_segments_split_at_user_turns():
    assert segments(CONVERSATIONS[0]) == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "more"}],
    ]


def test_turn_by_turn_history_uses_regenerated_replies(server):
    out = chats(regenerate_chunk(CONVERSATIONS, server_generator(server.url, Sampling())))
    assert [m["content"] for m in out[2]] == [
        "a", "R(a)", "b", "R(a|R(a)|b)", "c", "R(a|R(a)|b|R(a|R(a)|b)|c)",
    ]  # fmt: skip
    assert out[0][0] == {"role": "system", "content": "be brief"}
    assert [m["role"] for m in out[0]] == ["system", "user", "assistant", "user", "assistant"]
    assert {r["model"] for r in server.requests} == {"fake-target"}  # from /v1/models
    assert server.requests[0]["temperature"] == 0.0


def test_output_loads_as_a_dataset_and_resumes(tmp_path):
    server = FakeServer(fail_after=3)  # chunk 0 (conversations 0-1) takes 3 requests
    try:
        generate = server_generator(server.url + "/v1", Sampling(max_new_tokens=7), model="m")
        out = tmp_path / "regen.jsonl"
        identity = {"data": "test", "server": server.url}
        with pytest.raises(UserError, match="HTTP 500.*overloaded"):
            regenerate(CONVERSATIONS, generate, out, identity=identity, chunk_size=2)
        assert not out.exists()
        assert [p.name for p in sorted((tmp_path / "regen.jsonl.parts").glob("part-*"))] == [
            "part-00000.jsonl"
        ]
        server.fail_after = None
        before = len(server.requests)
        regenerate(CONVERSATIONS, generate, out, identity=identity, chunk_size=2)
        assert len(server.requests) - before == 3  # only chunk 1 (3 turns) was asked again
        assert server.requests[-1]["max_tokens"] == 7
        loaded, report = load_conversations(str(out))
        assert len(loaded) == 3
        assert loaded[1][-1].content == "R(one)"
        with pytest.raises(UserError, match="other settings"):
            regenerate(CONVERSATIONS, generate, out, identity={"data": "other"}, chunk_size=2)
    finally:
        server.close()


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(UserError, match="could not reach the server"):
        server_generator("http://127.0.0.1:9", Sampling(), timeout=5)


@pytest.mark.integration
def test_local_target_replies_greedily(tmp_path, monkeypatch):
    """A tiny random Llama with the built-in target's tokenizer and chat template."""
    from conftest import tiny_model

    from eagletools.data.regenerate import local_generator
    from eagletools.targets import Target, TargetInfo, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    target = Target(model, tokenizer, TargetInfo.from_config(model.config, "tiny"))
    generate = local_generator(target, Sampling(max_new_tokens=4), batch_size=2)
    first = chats(regenerate_chunk(CONVERSATIONS, generate))
    assert first == chats(regenerate_chunk(CONVERSATIONS, generate))  # greedy: deterministic
    assert [sum(m["role"] == "assistant" for m in c) for c in first] == [2, 1, 3]
    assert all(m["content"] != "old" for c in first for m in c)
    # the runtime's left-padded batches reply as HF `generate` does one history at a time
    for chat in first:
        history = chat[: chat.index(next(m for m in chat if m["role"] == "assistant"))]
        text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        hf = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        assert hf == generate([history])[0].text
    # architectures the runtime lacks fall back to HF `generate`, batched and left-padded
    monkeypatch.setattr("eagletools.decode.model.SUPPORTED", ())
    fallback = local_generator(target, Sampling(max_new_tokens=4), batch_size=2)
    assert chats(regenerate_chunk(CONVERSATIONS, fallback)) == first
    declined = local_generator(target, Sampling(max_new_tokens=4), max_prompt_tokens=1)
    assert declined([[{"role": "user", "content": "hi"}]]) == [None]


def test_cli_regenerate_against_the_server(tmp_path, server, capsys):
    from eagletools.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "old"}]}) + "\n")  # fmt: skip
    out = tmp_path / "out.jsonl"
    argv = ["data", "regenerate", "--data", str(data), "--server", server.url, "--output", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["messages"][1] == {"role": "assistant", "content": "R(q)"}
    assert main(["data", "regenerate", "--data", str(data), "--output", str(out)]) == 2
    assert "exactly one of --target" in capsys.readouterr().err


def test_cli_keeps_states_for_the_cache(tmp_path, caplog):
    """`data regenerate --keep-states`, then `data hidden-states --captured`: the cache takes
    the kept states; a server cannot keep any."""
    import logging

    from conftest import tiny_model

    from eagletools.cli import main
    from eagletools.data.hidden_states import HiddenStateCache
    from eagletools.targets import load_tokenizer

    folder = tmp_path / "target"
    tokenizer = load_tokenizer("smollm2-135m")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                 {"role": "assistant", "content": "old"}]}) + "\n"
        for i in range(5)
    ))  # fmt: skip
    out = tmp_path / "r.jsonl"
    common = ["--target", str(folder), "--aux-layer-ids", "1,2,3"]
    assert main(["data", "regenerate", "--data", str(data), "--output", str(out),
                 "--max-new-tokens", "6", "--keep-states", *common]) == 0  # fmt: skip
    assert list((tmp_path / "r.jsonl.parts").glob("*.safetensors"))
    with caplog.at_level(logging.INFO, logger="eagletools.data.hidden_states"):
        assert main(["data", "hidden-states", "--data", str(out), "--max-length", "64",
                     "--captured", str(tmp_path / "r.jsonl.parts"), "--dtype", "float32",
                     "--output-dir", str(tmp_path / "hs"), *common]) == 0  # fmt: skip
    assert "5 samples from the regeneration's captured states" in caplog.text
    assert len(HiddenStateCache.open(tmp_path / "hs")) == 5
    server = ["data", "regenerate", "--data", str(data), "--server", "http://x", "--output", "o"]
    assert main([*server, "--keep-states"]) == 2


def test_job_identity_covers_what_shapes_the_replies(tmp_path):
    """Every setting that changes a local target's replies (or where a resume cuts the
    parts) changes the identity; the states kept on the way do not, and neither does
    the data file's name, only its content."""
    from dataclasses import replace

    from eagletools.data.jobs import DataSource, RegenerateJob

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    job = RegenerateJob(DataSource(str(data)), tmp_path / "out.jsonl", target="t")
    settings = [{"batch_size": 2}, {"max_turns": None}, {"max_prompt_tokens": 9},
                {"max_new_tokens": 9}, {"temperature": 0.5}, {"top_p": 0.5}]  # fmt: skip
    changes = [{"dtype": "float32"}, {"seed": 1}, {"target": "u"},
               {"chat_template": "{{ messages[0]['content'] }}"},
               {"data": DataSource(str(data), num_samples=1)},
               *({"settings": replace(job.settings, **c)} for c in settings)]  # fmt: skip
    identities = [job.identity()] + [replace(job, **change).identity() for change in changes]
    assert len({json.dumps(i, sort_keys=True) for i in identities}) == 1 + len(changes)
    assert replace(job, keep_states=True, aux_layer_ids=[1, 2]).identity() == job.identity()
    copy = tmp_path / "copy.jsonl"
    copy.write_text(data.read_text())
    assert replace(job, data=DataSource(str(copy))).identity() == job.identity()
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "edited"}]}) + "\n")
    assert job.identity() != identities[0]


def test_data_regenerate_and_train_share_defaults_and_identity(tmp_path):
    """A file `eagletools data regenerate` writes with its defaults is the one `train`
    reuses with a recipe's defaults: one settings type, one identity (at bf16 training
    precision, where the teacher runs in target.dtype; in fp32 it runs in fp32, and
    `--dtype float32` matches)."""
    import argparse

    from eagletools.commands import data as data_command
    from eagletools.data.jobs import RegenerationSettings
    from eagletools.train.inputs import regeneration_job
    from eagletools.train.recipe import load_config

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    parser = argparse.ArgumentParser()
    data_command.register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "data",
            "regenerate",
            "--target",
            "smollm2-135m",
            "--data",
            str(data),
            "--output",
            str(tmp_path / "r.jsonl"),
        ]
    )
    cli_job = data_command.regeneration_from_args(args)
    config = load_config(
        None, [f"data.train={data}", "data.regenerate.enabled=true", "training.precision=bf16"]
    )
    train_job = regeneration_job(config, tmp_path / "r.jsonl")
    assert cli_job.settings == RegenerationSettings()
    assert cli_job.identity() == train_job.identity()
