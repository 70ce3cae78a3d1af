"""Loss masks from real chat templates (ChatML, Llama-2/3, Qwen2.5, Qwen3, Mistral).

The tokenizers are small byte-level BPEs trained here, so the templates are
the real ones but nothing is downloaded. The check is independent of the
implementation: the masked tokens, decoded run by run, must be exactly each
reply followed by the template's end-of-turn token.
"""

from __future__ import annotations

import pytest

from eagletools.data import Message, tokenize_conversation
from eagletools.data.chat import TemplateMismatch, assistant_spans
from eagletools.errors import UserError

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Qwen3: the last reply after the last user turn gets an (empty) think block.
QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if loop.index0 > ns.last_query_index and loop.last %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Llama-2: a space before the end-of-sequence token, which is masked too
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)
TEMPLATES = {
    "llama2": (LLAMA2, " </s>"),
    "llama3": (LLAMA3, "<|eot_id|>"),
    "qwen2.5": (QWEN25, "<|im_end|>"),
    "qwen3": (QWEN3, "<|im_end|>"),
    "mistral": (MISTRAL, "</s>"),
}
SPECIALS = [
    "<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|im_start|>", "<|im_end|>",
]  # fmt: skip

CORPUS = [
    "Hello there! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog. def f(x): return x * 2",
    "You are a helpful assistant. Answer the question below in one line.",
    "system user assistant think [INST] [/INST] 0123456789 {}[]()<>",
]


def byte_bpe_tokenizer(chat_template: str | None = None, vocab_size: int = 400):
    """A small byte-level BPE with the special tokens of several families."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[2:],
        chat_template=chat_template,
    )


def conv(*turns: tuple[str, str]) -> list[Message]:
    return [Message(r, c) for r, c in turns]


CONVERSATIONS = [
    conv(("user", "Hello there!"), ("assistant", "I am fine, thank you.")),
    conv(
        ("system", "Answer in one line."),
        ("user", "Say: Hello there"),  # the reply is quoted in the question
        ("assistant", "Hello there"),
        ("user", "And the fox?"),
        ("assistant", "The quick brown fox jumps over the lazy dog."),
    ),
    conv(("user", "You"), ("assistant", "are")),  # both inside Qwen's default system prompt
    conv(("user", "code"), ("assistant", "def f(x):\n    return x * 2\n")),
    # replies that also occur in the template's own decoration of the turn
    conv(("user", "think"), ("assistant", "think"), ("user", "assistant"), ("assistant", "think")),
    conv(("user", "end"), ("assistant", "end"), ("user", "e"), ("assistant", "e")),
]


def runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    out, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_mask_is_exactly_replies_and_end_of_turn(name, index):
    template, eot = TEMPLATES[name]
    tok = byte_bpe_tokenizer(template)
    conversation = CONVERSATIONS[index]
    ids, mask = tokenize_conversation(tok, conversation, max_length=4096)
    full = tok(tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in conversation], tokenize=False
    ), add_special_tokens=False)["input_ids"]  # fmt: skip
    assert ids == full
    replies = [m.content for m in conversation if m.role == "assistant"]
    if name.startswith("llama"):  # these templates trim every message
        replies = [r.strip() for r in replies]
    got = [tok.decode(r) for r in runs(ids, mask)]
    # a first token may carry the space the template puts before the reply (" I")
    assert [g.lstrip(" ") for g in got] == [r + eot for r in replies]
    if name != "llama2":
        assert got == [r + eot for r in replies]


def test_mask_with_explicit_template_when_tokenizer_has_none():
    tok = byte_bpe_tokenizer(None)
    ids, mask = tokenize_conversation(tok, CONVERSATIONS[0], 4096, chat_template=QWEN25)
    assert [tok.decode(r) for r in runs(ids, mask)] == ["I am fine, thank you.<|im_end|>"]


def test_truncation_keeps_prefix():
    tok = byte_bpe_tokenizer(QWEN25)
    ids, mask = tokenize_conversation(tok, CONVERSATIONS[1], 4096)
    short_ids, short_mask = tokenize_conversation(tok, CONVERSATIONS[1], 40)
    assert len(short_ids) == len(short_mask) == 40
    assert (short_ids, short_mask) == (ids[:40], mask[:40])


def test_template_that_rewrites_text_is_reported():
    tok = byte_bpe_tokenizer("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(TemplateMismatch):
        assistant_spans(tok, CONVERSATIONS[0])


def test_missing_template_is_a_user_error(tmp_path):
    from eagletools.data.chat import check_tokenizer, read_chat_template

    with pytest.raises(UserError, match="--chat-template"):
        check_tokenizer(byte_bpe_tokenizer(None), None, "tiny")
    with pytest.raises(UserError, match="no such file"):
        read_chat_template(tmp_path / "missing.jinja")
    (tmp_path / "t.jinja").write_text(QWEN25)
    assert read_chat_template(tmp_path / "t.jinja") == QWEN25


@pytest.mark.integration
def test_smollm2_chatml_mask():
    from eagletools.targets import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    for conversation in CONVERSATIONS:
        ids, mask = tokenize_conversation(tok, conversation, 4096)
        replies = [m.content for m in conversation if m.role == "assistant"]
        assert [tok.decode(r) for r in runs(ids, mask)] == [r + "<|im_end|>" for r in replies]
        # the tokens before each reply are the ChatML assistant header, unmasked
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>system\n")
        assert text.count("<|im_start|>assistant\n") == len(replies)
