"""`eagletools pipeline`: train, convert and evaluate on one recipe, resumably."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command
from eagletools.commands.train import add_recipe_argument


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "pipeline",
        "The whole job: vocabulary, training, conversion to both formats, evaluation, report",
        "eagletools pipeline recipes/smollm2-135m-cpu.yaml --output-dir runs/demo",
    )  # fmt: skip
    add_recipe_argument(p)
    p.add_argument("--output-dir", required=True, help="run folder; finished stages are skipped")
    p.set_defaults(func=_pipeline)


def _pipeline(args: argparse.Namespace) -> int:
    from eagletools.commands.train import split_recipe
    from eagletools.eval.report import pipeline_lines
    from eagletools.pipeline import run_pipeline
    from eagletools.train.recipe import load_config

    recipe, overrides = split_recipe(args.recipe_and_overrides)
    summary = run_pipeline(load_config(recipe, overrides), args.output_dir)
    print("\n".join(pipeline_lines(summary)))
    return 0
