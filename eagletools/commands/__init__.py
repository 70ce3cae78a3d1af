"""One module per top-level command; see eagletools.cli."""

import argparse


def add_command(
    subparsers: argparse._SubParsersAction, name: str, help: str, example: str
) -> argparse.ArgumentParser:
    """A subcommand parser whose --help ends with a runnable example."""
    return subparsers.add_parser(
        name,
        help=help,
        description=help,
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
