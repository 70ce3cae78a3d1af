"""`eagletools convert`: rewrite a draft checkpoint in another ecosystem's format."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command
from eagletools.dtypes import dtype_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    from eagletools.formats import FORMATS

    p = add_command(
        subparsers, "convert",
        "Convert an EAGLE-3 draft checkpoint between eagle (SGLang, SpecForge, TensorRT-LLM), "
        "speculators (vLLM) and eagletools training formats, or to gguf (llama.cpp; needs "
        "--target), checking it first",
        "eagletools convert runs/train/final runs/draft-vllm --to speculators "
        "--target smollm2-135m",
    )  # fmt: skip
    p.add_argument("src", help="checkpoint folder (format detected)")
    p.add_argument("out", help="output folder, or .gguf file for --to gguf (written atomically)")
    p.add_argument("--to", required=True, choices=sorted(FORMATS), help="output format")
    p.add_argument(
        "--dtype", type=dtype_arg, help="cast weights: bf16, fp16 or fp32 (default: keep)"
    )
    p.add_argument(
        "--target",
        help="target (built-in name, HF folder, .gguf, hub id): check against it and take "
        "RoPE, max_position_embeddings and default aux layers from it",
    )
    p.add_argument(
        "--with-embeddings",
        action="store_true",
        help="write embed_tokens (from the source, else from --target)",
    )
    p.add_argument(
        "--verifier",
        help="speculators: verifier name_or_path to record (default: --target, else the source's)",
    )
    add_engine_choice(p, "--for", "refuse a draft ENGINE would compute differently (an option "
                      "it ignores); checks non-default aux ids only with --target")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--repair", action="store_true", help="fix the faults doctor marks as "
                   "unambiguous (fields only) and say what changed, instead of refusing")  # fmt: skip
    add_allow_pickle(p)
    p.set_defaults(func=run)


def add_allow_pickle(p: argparse.ArgumentParser) -> None:
    """The opt-in every command reading checkpoints offers."""
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read pytorch_model.bin (a pickle: only from a source you trust)",
    )


def add_engine_choice(p: argparse.ArgumentParser, flag: str, why: str) -> None:
    """The serving-engine option of the commands that check a draft against one."""
    from eagletools.engines import ENGINE_NAMES

    p.add_argument(flag, dest="for_engine", metavar="ENGINE", choices=tuple(ENGINE_NAMES), help=why)


def run(args: argparse.Namespace) -> int:
    from eagletools.formats.convert import convert

    convert(
        args.src,
        args.out,
        args.to,
        target=args.target,
        dtype=args.dtype,
        with_embeddings=args.with_embeddings,
        verifier=args.verifier,
        force=args.force,
        allow_pickle=args.allow_pickle,
        engine=args.for_engine,
        repair=args.repair,
    )
    return 0
