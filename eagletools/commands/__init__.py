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


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """`--device`, the same on every command that runs a model (eagletools.devices)."""
    from eagletools.devices import DEVICE_HELP

    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def add_chat_template_argument(p: argparse.ArgumentParser) -> None:
    """`--chat-template`, the same on every command that renders a conversation."""
    p.add_argument(
        "--chat-template",
        default=None,
        help="Jinja file (or text) rendering conversations, for tokenizers without a template",
    )
