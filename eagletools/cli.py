"""The `eagletools` command: parse, then call one library function.

Each command lives in `eagletools/commands/<name>.py` with `register(subparsers)`
that adds its parser and sets `func`; heavy imports happen inside `func`, so
`eagletools --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from eagletools import __version__
from eagletools.errors import UserError

COMMAND_MODULES = (
    "assets",
    "data",
    "vocab",
    "train",
    "convert",
    "inspect",
    "doctor",
    "generate",
    "eval",
    "pipeline",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagletools",
        description="Train, convert and validate EAGLE-3 draft heads for speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"eagletools {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"eagletools.commands.{name}").register(subparsers)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parse_args`, but KEY=VALUE overrides may also follow the options
    (`train recipe.yaml --output-dir out training.lr=1e-3`): argparse ends a
    positional list at the first option, and its intermixed parsing does not
    take subcommands."""
    args, extra = parser.parse_known_args(argv)
    overrides = getattr(args, "recipe_and_overrides", None)
    if extra and overrides is not None and all("=" in e and not e.startswith("-") for e in extra):
        args.recipe_and_overrides = overrides + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
