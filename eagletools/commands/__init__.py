"""One module per top-level command; see eagletools.cli."""

import argparse
import dataclasses
import types
import typing
from typing import Any


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help names its default, read from the parser: the docs and `--help`
    show the one default the code uses, never a copy of it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default == argparse.SUPPRESS)
        shown = shown and not action.required
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def add_command(
    subparsers: argparse._SubParsersAction, name: str, help: str, example: str
) -> argparse.ArgumentParser:
    """A subcommand parser whose --help ends with a runnable example."""
    return subparsers.add_parser(
        name,
        help=help,
        description=help,
        epilog=f"example:\n  {example}",
        formatter_class=_HelpFormatter,
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


def _optional(parse: Any) -> Any:
    """`none` (or `null`) for a field that may be None, else the field's own parser."""

    def read(text: str) -> Any:
        return None if text.lower() in ("none", "null") else parse(text)

    read.__name__ = parse.__name__  # argparse names the type in its errors
    return read


def add_settings_arguments(p: argparse.ArgumentParser, settings: type) -> None:
    """One `--field-name` per field of a settings dataclass, with its type, default and
    `help` metadata: a recipe section and the command that does the same job share it."""
    hints = typing.get_type_hints(settings)
    for f in dataclasses.fields(settings):
        tp, args = hints[f.name], typing.get_args(hints[f.name])
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
        parse = next(a for a in args if a is not type(None)) if optional else tp
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=_optional(parse) if optional else parse,
            default=f.default,
            help=f.metadata.get("help"),
        )


def settings_from_args(args: argparse.Namespace, settings: type) -> Any:
    """The settings dataclass back from the flags `add_settings_arguments` added."""
    return settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(settings)})
