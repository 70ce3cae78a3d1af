"""`eagletools train`: train an EAGLE-3 draft from a YAML recipe plus dotted overrides."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command
from eagletools.train.recipe import TRACKERS, TrackingSection


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "train",
        "Train a draft (EAGLE-3, P-EAGLE or DFlash: draft.kind), online or from a hidden-state cache",
        "eagletools train recipes/smollm2-135m-cpu.yaml training.lr=2e-4 --output-dir runs/train",
    )  # fmt: skip
    add_recipe_argument(p)
    p.add_argument("--output-dir", required=True, help="run folder: checkpoints, final/, metrics")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument(
        "--report-to",
        choices=TRACKERS,
        default=None,
        help="tracker, as tracking.report_to=... (default: the recipe's, else "
        f"{TrackingSection.report_to})",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe, exit")
    p.set_defaults(func=_train)


def add_recipe_argument(p: argparse.ArgumentParser) -> None:
    """RECIPE [KEY=VALUE ...]: what every recipe-driven command takes (see split_recipe)."""
    p.add_argument(
        "recipe_and_overrides",
        nargs="*",
        metavar="RECIPE [KEY=VALUE ...]",
        help="a YAML recipe (recipes/*.yaml), then dotted overrides such as training.lr=2e-4",
    )


def split_recipe(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is the recipe unless it is already a KEY=VALUE override."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _train(args: argparse.Namespace) -> int:
    import json

    from eagletools.train.recipe import dump_config, load_config

    recipe, overrides = split_recipe(args.recipe_and_overrides)
    if args.report_to:
        overrides = [*overrides, f"tracking.report_to={args.report_to}"]
    config = load_config(recipe, overrides)
    if args.print_config:
        print(dump_config(config), end="")
        return 0
    from eagletools.train.trainer import train

    metrics = train(config, args.output_dir, resume=args.resume)
    keys = ["loss", "simulated_acceptance_length", "acc", "steps", "tokens_per_s"]
    print(json.dumps({k: metrics[k] for k in keys if k in metrics}))
    return 0
