"""`eagletools generate`: speculative decoding of one prompt, streamed, with tau and tokens/s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from eagletools.commands import add_chat_template_argument, add_command, add_device_argument
from eagletools.dtypes import dtype_arg

if TYPE_CHECKING:
    from eagletools.decode.session import Settings


def draft_argument(value: str) -> str:
    """`--draft` as given, refused when empty: a run that silently fell back to plain
    decoding would report null acceptance and exit 0."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            "empty; give a draft folder (or .gguf file), random[:SEED], or omit --draft "
            "to run plain decoding only"
        )
    return value


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """Target, draft, dtype, sampling and tree-shape options shared with `eval`."""
    p.add_argument(
        "--target", default="smollm2-135m", help="built-in name, HF folder, hub id or .gguf"
    )
    p.add_argument(
        "--draft",
        type=draft_argument,
        help="draft checkpoint folder (any supported format), or random[:SEED] for an untrained "
        "head; without it only plain decoding runs",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (1 = off)")
    p.add_argument(
        "--topk",
        type=int,
        help="draft tree: children per expanded node. Give none of --topk, --depth, "
        "--num-draft-tokens and the shape is the one measured fastest on this machine for this "
        "draft (see --no-tune); give some and the others are 4, 5, 16",
    )
    p.add_argument("--depth", type=int, help="draft tree: draft steps")
    p.add_argument("--num-draft-tokens", type=int, help="draft tree: nodes verified, root included")
    p.add_argument(
        "--no-tune",
        dest="tune",
        action="store_false",
        help="given no tree shape, draft topk 4, depth 5, 16 nodes. Without it, the first run "
        "of a draft here times plain decoding and 4 chains and trees on 2 short prompts x 64 "
        "tokens (each warmed, then the median of 3 rounds), caches the fastest in the "
        "eagletools cache and drafts with it, or decodes plainly when no shape beat plain "
        "decoding by 3%%",
    )
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg, help="bf16, fp16 or fp32")
    add_device_argument(p)
    add_chat_template_argument(p)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fast-numerics",
        action="store_true",
        help="fp32 attention reductions: faster on CPU, but bf16 speculative output may then "
        "drift from plain decoding (default: batch-invariant, equal)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decoding steps with torch.compile (inductor, weights frozen; "
        "the speculative step whole): faster steps after a few minutes of compiling per shape",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow loading a pytorch_model.bin draft (weights_only unpickling)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    from eagletools.decode.session import Settings

    if args.max_new_tokens < 1:
        from eagletools.errors import UserError

        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    draft = args.draft
    if draft and draft != "random" and not draft.startswith("random:") and not Path(draft).exists():
        from eagletools.errors import UserError

        raise UserError(
            f"--draft {draft}: no such file or folder (omit --draft for plain decoding)"
        )
    return Settings.of(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "generate", "Generate text with tree speculative decoding (or plain decoding)",
        'eagletools generate --target smollm2-135m --draft runs/demo/eagle "Tell me about owls."',
    )  # fmt: skip
    p.add_argument("prompt", help="the user message (rendered with the chat template)")
    add_decoding_args(p)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from eagletools.data.chat import chat_ids
    from eagletools.decode.session import load_decoders
    from eagletools.errors import UserError

    if not args.prompt.strip():
        raise UserError("the prompt is empty: give the text to continue or answer")
    s = settings_from_args(args)
    decoders = load_decoders(s)
    tokenizer = decoders.target.tokenizer
    if args.raw:
        ids = tokenizer(args.prompt).input_ids
    else:
        ids = chat_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    decoder = decoders.speculative or decoders.baseline
    generator = torch.Generator(device=s.device).manual_seed(s.seed)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    r = decoder.generate(ids, s.max_new_tokens, s.sampling, args.stop, show, generator)
    mode = "speculative" if decoders.speculative else "plain"
    print(
        f"\n\n[{mode}] {len(r.tokens)} tokens in {r.seconds:.2f} s: {r.tokens_per_s:.1f} tokens/s, "
        f"tau {r.tau:.2f}, stop: {r.stop_reason}",
        file=sys.stderr,
    )
    return 0
