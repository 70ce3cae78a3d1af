"""`eagletools vocab build|inspect`: the draft vocabulary (d2t / t2d)."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command
from eagletools.commands.data import add_prepare_args


def register(subparsers: argparse._SubParsersAction) -> None:
    build_example = (
        "eagletools vocab build --target smollm2-135m --data sharegpt --num-samples 2000 "
        "--size 16384 --output-dir runs/vocab"
    )
    parser = add_command(
        subparsers, "vocab", "Build or check a draft vocabulary (d2t/t2d)", build_example
    )
    sub = parser.add_subparsers(dest="vocab_command", metavar="ACTION", required=True)
    p = add_command(
        sub, "build", "Pick the draft vocabulary from reply-token counts; write d2t/t2d + report",
        build_example,
    )  # fmt: skip
    add_prepare_args(p)
    p.add_argument("--size", type=int, required=True, help="draft vocabulary size Vd")
    p.add_argument("--output-dir", required=True, help="writes vocab.safetensors, report.json")
    p.set_defaults(func=_build)
    p = add_command(
        sub, "inspect", "Check every d2t/t2d invariant of a vocabulary file and print them",
        "eagletools vocab inspect runs/vocab/vocab.safetensors",
    )  # fmt: skip
    p.add_argument("file", help="a .safetensors file with d2t and t2d")
    p.set_defaults(func=_inspect)


def _build(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eagletools.atomic import write_text
    from eagletools.commands.data import prepare_from_args
    from eagletools.data.conversations import data_source
    from eagletools.errors import UserError
    from eagletools.targets import load_config, load_tokenizer
    from eagletools.vocab import build_vocab_cached

    if args.size < 1:
        raise UserError(f"--size {args.size}: the draft vocabulary needs at least 1 token")
    data_source(args.data)  # fail on a missing file before loading anything
    vocab_size = load_config(args.target).get_text_config().vocab_size
    if args.size > vocab_size:
        raise UserError(
            f"--size {args.size} is larger than the vocabulary of target {args.target} "
            f"({vocab_size}); pick at most {vocab_size}"
        )
    prepared = prepare_from_args(args, load_tokenizer(args.target))
    print(prepared.summary())
    vocab, report = build_vocab_cached(prepared, vocab_size, args.size)
    report = {
        **report,
        "target": args.target,
        "data": args.data,
        "max_length": args.max_length,
        "prepared": str(prepared.path),
    }
    out = Path(args.output_dir)
    vocab.save(out / "vocab.safetensors")
    write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    print(
        f"draft vocab {report['draft_vocab_size']} of {vocab_size}: coverage "
        f"{report['coverage']:.4f} of {report['num_tokens']} reply tokens "
        f"({report['distinct_tokens']} distinct, {report['num_samples']} samples) -> {out}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from eagletools.vocab import DraftVocab

    vocab = DraftVocab.load(args.file, validate=False)
    print(f"{args.file}: Vd={vocab.draft_vocab_size} V={vocab.target_vocab_size}")
    checks = vocab.checks()
    for name, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f"  ({detail})" if detail else ""))
    return 0 if all(ok for _, ok, _ in checks) else 1
