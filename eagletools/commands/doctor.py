"""`eagletools doctor`: every way an engine would serve a draft wrongly, before deploying it."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command
from eagletools.commands.convert import add_allow_pickle


def register(subparsers: argparse._SubParsersAction) -> None:
    from eagletools.engines import ENGINE_NAMES

    p = add_command(
        subparsers, "doctor",
        "Check a draft the way each engine reads it: finite weights, RoPE, architectures, tie "
        "and dtype fields, norm_before_residual, aux ids per engine; with --target, its fit "
        "and its measured acceptance against the one training recorded (exit 1 on any error)",
        "eagletools doctor runs/train/final --target smollm2-135m --engine all",
    )  # fmt: skip
    p.add_argument("ckpt", help="checkpoint folder (format detected)")
    p.add_argument("--target", help="check against this target and run the draft on it")
    p.add_argument("--engine", choices=[*ENGINE_NAMES, "all"],
                   help="also check how ENGINE reads the draft (all: every engine)")  # fmt: skip
    p.add_argument("--no-numeric", action="store_true",
                   help="with --target, skip running the draft (static checks only)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_allow_pickle(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from eagletools.doctor import doctor
    from eagletools.engines import ENGINE_NAMES
    from eagletools.formats.checks import render

    engines = list(ENGINE_NAMES) if args.engine == "all" else [args.engine] if args.engine else []
    report = doctor(args.ckpt, args.target, engines, not args.no_numeric, args.allow_pickle)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1
