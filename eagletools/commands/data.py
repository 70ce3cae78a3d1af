"""`eagletools data ...`: conversation data steps. Each subcommand adds itself in `register`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from eagletools.commands import (
    add_chat_template_argument,
    add_command,
    add_device_argument,
    add_settings_arguments,
    settings_from_args,
)
from eagletools.data.jobs import HiddenStatesJob, RegenerationSettings
from eagletools.dtypes import dtype_arg
from eagletools.train.recipe import DataSection, TargetSection

if TYPE_CHECKING:
    from eagletools.data.conversations import HubOptions
    from eagletools.data.jobs import DataSource


def add_data_args(p: argparse.ArgumentParser) -> None:
    """Options naming conversation data: a built-in, a local file or folder, or a hub id."""
    p.add_argument(
        "--data",
        required=True,
        help="built-in dataset, .json/.jsonl/.parquet file or folder, or hub dataset id org/name",
    )
    p.add_argument("--data-split", default=DataSection.split, help="hub dataset: the split to read")
    p.add_argument("--data-revision", default=None, help="hub dataset: branch, tag or commit")
    p.add_argument(
        "--data-streaming",
        action="store_true",
        help="hub dataset: stream rows instead of downloading it all (on with --num-samples)",
    )
    p.add_argument("--num-samples", type=int, default=None, help="first N usable conversations")


def hub_options(args: argparse.Namespace) -> HubOptions:
    """The `HubOptions` of `add_data_args`' flags."""
    from eagletools.data.conversations import HubOptions

    return HubOptions(args.data_split, args.data_revision, args.data_streaming)


def add_prepare_args(p: argparse.ArgumentParser) -> None:
    """Options naming a prepared dataset; shared by every command that tokenises data."""
    p.add_argument("--target", required=True, help="built-in name, HF folder, hub id or .gguf")
    add_data_args(p)
    p.add_argument(
        "--max-length",
        type=int,
        default=DataSection.max_length,
        help="tokens per sample (truncated)",
    )
    add_chat_template_argument(p)
    p.add_argument(
        "--num-proc", type=int, default=HiddenStatesJob.num_proc, help="tokenising worker processes"
    )


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
        hub=hub_options(args),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "data", "Conversation data: tokenise with the chat template, mask replies",
        "eagletools data prepare --target smollm2-135m --data sharegpt --num-samples 2000",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    _register_prepare(sub)
    _register_hidden_states(sub)
    _register_regenerate(sub)


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


def _register_hidden_states(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "hidden-states",
        "Run the target once and cache its aux + last hidden states for offline training",
        "eagletools data hidden-states --target smollm2-135m --data sharegpt --num-samples 2000 "
        "--max-length 512 --output-dir runs/hs",
    )  # fmt: skip
    add_prepare_args(p)
    p.add_argument("--output-dir", required=True, help="cache folder (rerun to resume)")
    p.add_argument("--aux-layer-ids", default=None, help="HF indices, e.g. 2,15,27")
    p.add_argument(
        "--shard-size", type=int, default=HiddenStatesJob.shard_size, help="samples per shard file"
    )
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=HiddenStatesJob.batch_tokens,
        help="tokens per target forward",
    )
    p.add_argument(
        "--captured",
        default=None,
        help="the OUTPUT.parts folder of `data regenerate --keep-states` on this data: "
        "its samples take the states kept there instead of a target pass",
    )
    p.add_argument(
        "--dtype",
        default=TargetSection.dtype,
        type=dtype_arg,
        help="target dtype (the cache is bf16)",
    )
    add_device_argument(p)
    p.set_defaults(func=_hidden_states)


def _layer_ids(value: str | None) -> list[int] | None:
    from eagletools.errors import UserError

    try:
        return [int(x) for x in value.split(",")] if value else None
    except ValueError:
        raise UserError(f"--aux-layer-ids {value!r}: give integers like 2,15,27") from None


def _data_source(args: argparse.Namespace) -> DataSource:
    """The `DataSource` of `add_data_args`' flags."""
    from eagletools.data.jobs import DataSource

    return DataSource(args.data, args.num_samples, hub_options(args))


def _hidden_states(args: argparse.Namespace) -> int:
    from eagletools.data.jobs import HiddenStatesJob
    from eagletools.devices import resolve_device
    from eagletools.dtypes import parse_dtype
    from eagletools.targets import load_target

    job = HiddenStatesJob(
        args.target, _data_source(args), Path(args.output_dir), dtype=args.dtype,
        max_length=args.max_length, chat_template=args.chat_template,
        aux_layer_ids=_layer_ids(args.aux_layer_ids), shard_size=args.shard_size,
        batch_tokens=args.batch_tokens, captured=Path(args.captured) if args.captured else None,
        num_proc=args.num_proc,
    )  # fmt: skip
    # auto: under `accelerate launch`, each rank on its own GPU
    device = resolve_device(args.device)
    target = load_target(args.target, dtype=parse_dtype(args.dtype), device=device)
    job.run(target, echo=print)
    return 0


def _register_regenerate(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "regenerate",
        "Replace assistant replies with the target's own, turn by turn (local or --server)",
        "eagletools data regenerate --target smollm2-135m --data sharegpt --num-samples 100 "
        "--max-turns 1 --max-new-tokens 256 --output runs/regenerated.jsonl",
    )  # fmt: skip
    add_data_args(p)
    p.add_argument(
        "--output", required=True, help="JSONL file to write (resumes from OUTPUT.parts)"
    )
    p.add_argument("--target", help="local target: built-in name, HF folder, hub id or .gguf")
    p.add_argument("--server", help="OpenAI-compatible server URL (vLLM, SGLang) instead")
    p.add_argument("--model", help="model name on the server (default: its first listed)")
    p.add_argument("--seed", type=int, default=0, help="a batch samples with seed + its start")
    p.add_argument(
        "--dtype", default=TargetSection.dtype, type=dtype_arg, help="a local target's dtype"
    )
    add_settings_arguments(p, RegenerationSettings)
    p.add_argument(
        "--keep-states",
        action="store_true",
        help="local target: keep the hidden states the target computes, beside each part, "
        "for `data hidden-states --captured OUTPUT.parts` (as large as that cache)",
    )
    p.add_argument(
        "--aux-layer-ids", default=None, help="with --keep-states: HF indices (default 2,N/2,N-3)"
    )
    add_device_argument(p)
    add_chat_template_argument(p)
    p.set_defaults(func=_regenerate)


def regeneration_from_args(args: argparse.Namespace):
    """The regeneration job `data regenerate`'s flags describe, checked."""
    from eagletools.data.jobs import RegenerateJob
    from eagletools.errors import UserError

    if bool(args.target) == bool(args.server):
        raise UserError("give exactly one of --target (local) or --server URL")
    if args.server and args.keep_states:
        raise UserError("--keep-states needs a local --target: a server returns only text")
    if args.server and args.chat_template:
        raise UserError("--chat-template is for a local --target; a --server renders with its own")
    if args.max_turns is not None and args.max_turns < 1:
        raise UserError(f"--max-turns must be at least 1, got {args.max_turns}")
    return RegenerateJob(
        _data_source(args), Path(args.output), settings_from_args(args, RegenerationSettings),
        args.seed, target=args.target, dtype=args.dtype, chat_template=args.chat_template,
        server=args.server, model=args.model, keep_states=args.keep_states,
        aux_layer_ids=_layer_ids(args.aux_layer_ids),
    )  # fmt: skip


def _regenerate(args: argparse.Namespace) -> int:
    job = regeneration_from_args(args)
    target = None
    if args.target:
        from eagletools.devices import resolve_device
        from eagletools.dtypes import parse_dtype
        from eagletools.targets import load_target

        target = load_target(args.target, parse_dtype(job.dtype), resolve_device(args.device))
    job.run(target, echo=print)
    return 0
