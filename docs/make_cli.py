"""Write docs/cli.md from the real argparse parser, so the reference cannot drift.

    .venv/bin/python docs/make_cli.py        # rewrite docs/cli.md
tests/test_docs.py fails when docs/cli.md differs from what this renders.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CLI_MD = Path(__file__).resolve().parent / "cli.md"
WIDTH = 100  # argparse wraps help text to $COLUMNS; fixed so the output is the same everywhere

HEADER = """\
# CLI reference

Generated from the parser by `docs/make_cli.py`; do not edit by hand
(`tests/test_docs.py` fails when this page is stale). Every command's `--help`
prints the same text.
"""


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser's subcommand parsers, in the order they were added."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [p for a in actions for p in dict.fromkeys(a.choices.values())]


def _sections(parser: argparse.ArgumentParser, depth: int = 2) -> list[str]:
    out = [f"{'#' * depth} `{parser.prog}`\n\n```text\n{parser.format_help().rstrip()}\n```\n"]
    for sub in _subcommands(parser):
        out += _sections(sub, depth + 1 if depth < 4 else depth)
    return out


def render() -> str:
    """The whole page, rendered at a fixed width."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        from eagletools.cli import build_parser

        return HEADER + "\n" + "\n".join(_sections(build_parser()))
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def main() -> int:
    from eagletools.atomic import write_text

    write_text(CLI_MD, render())
    print(f"wrote {CLI_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
