"""`eagletools data ...`: conversation data steps. Each subcommand adds itself in `register`."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command


def add_prepare_args(p: argparse.ArgumentParser) -> None:
    """Options naming a prepared dataset; shared by every command that tokenises data."""
    p.add_argument("--target", required=True, help="built-in name, HF folder, hub id or .gguf")
    p.add_argument(
        "--data", required=True, help="built-in dataset, .json/.jsonl/.parquet file or folder"
    )
    p.add_argument("--num-samples", type=int, default=None, help="first N usable conversations")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per sample (truncated)")
    p.add_argument(
        "--chat-template", default=None, help="Jinja file, for tokenizers without a template"
    )
    p.add_argument("--num-proc", type=int, default=1, help="tokenising worker processes")


def prepare_from_args(args: argparse.Namespace, tokenizer=None):
    from eagletools.data.prepare import prepare

    return prepare(
        args.target,
        args.data,
        args.max_length,
        args.num_samples,
        chat_template=args.chat_template,
        num_proc=args.num_proc,
        tokenizer=tokenizer,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "data", "Conversation data: tokenise with the chat template, mask replies",
        "eagletools data prepare --target smollm2-135m --data sharegpt --num-samples 2000",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    _register_prepare(sub)


def _register_prepare(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "prepare", "Tokenise and mask a dataset once into the cache (vocab, train reuse it)",
        "eagletools data prepare --target smollm2-135m --data sharegpt --num-samples 2000",
    )  # fmt: skip
    add_prepare_args(p)
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    print(prepare_from_args(args).summary())
    return 0
