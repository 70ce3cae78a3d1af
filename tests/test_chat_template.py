"""`--chat-template` on every command that renders a prompt: a template-less target can be
evaluated, sampled from and regenerated with, not only trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_model
from test_decode_engine import one_thread  # noqa: F401  (autouse: one CPU thread)

from eagletools.cli import main

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def bare_target(tmp_path_factory) -> Path:
    """A local HF folder: tiny random Llama + a byte tokenizer with no chat template."""
    from transformers import ByT5Tokenizer

    folder = tmp_path_factory.mktemp("bare_target")
    tiny_model("llama", seed=3, vocab_size=384).save_pretrained(folder)
    ByT5Tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def template(tmp_path) -> Path:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def test_eval_with_chat_template_on_a_template_less_target(bare_target, template, tmp_path, capsys):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["hello there", "and again"]}) + "\n")
    args = ["eval", "--target", str(bare_target), "--draft", "random:1", "--bench", str(bench)]
    args += ["--dtype", "fp32", "--max-new-tokens", "6", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path / "no")]) == 2
    assert "has no chat template; pass --chat-template FILE" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main([*args, "--chat-template", str(template), "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["prompts"] == 1 and results["per_prompt"][0]["turns"] == 2
    assert results["settings"]["chat_template"] == str(template)


def test_generate_with_chat_template(bare_target, template, capsys):
    args = ["generate", "--target", str(bare_target), "--dtype", "fp32", "--max-new-tokens", "4"]
    assert main([*args, "hello"]) == 2
    assert "pass --chat-template" in capsys.readouterr().err
    assert main([*args, "--chat-template", str(template), "hello"]) == 0
    assert "[plain] 4 tokens" in capsys.readouterr().err


def test_regenerate_with_chat_template(bare_target, template, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "old"}]}) + "\n")  # fmt: skip
    out = tmp_path / "out.jsonl"
    argv = ["data", "regenerate", "--data", str(data), "--target", str(bare_target)]
    argv += ["--output", str(out), "--max-new-tokens", "3"]
    assert main(argv) == 2
    assert "has no chat template; pass --chat-template" in capsys.readouterr().err
    assert main([*argv, "--chat-template", str(template)]) == 0
    messages = json.loads(out.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1][
        "content"
    ] != "old"
    server = ["data", "regenerate", "--data", str(data), "--server", "http://x", "--output", "o"]
    assert main([*server, "--chat-template", str(template)]) == 2
    assert "--chat-template is for a local --target" in capsys.readouterr().err
