"""Recipes: YAML + dotted overrides, typed, unknown keys are errors; every shipped recipe loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagletools.commands.train import split_recipe
from eagletools.errors import UserError
from eagletools.train.recipe import (
    RETIRED,
    TrainConfig,
    dump_config,
    load_config,
    parse_overrides,
)

RECIPES = Path(__file__).parent.parent / "recipes"


def test_defaults_follow_the_design_notes():
    c = load_config()
    assert c.training.ttt_steps == 7 and c.training.ttt_decay == 0.8
    assert c.training.lr == 1e-4 and c.training.betas == [0.9, 0.95]
    assert c.training.grad_clip == 0.5 and c.training.precision == "auto"
    assert c.data.max_length == 2048


def test_yaml_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("training:\n  lr: 2e-4\n  batch_size: 3\ndata:\n  num_samples: 10\n")
    c = load_config(recipe, ["training.lr=5e-4", "target.aux_layer_ids=[1, 2, 3]"])
    assert c.training.lr == 5e-4  # YAML 1.1 would read 2e-4 as a string; both are floats here
    assert c.training.batch_size == 3 and c.data.num_samples == 10
    assert c.target.aux_layer_ids == [1, 2, 3]
    assert load_config(recipe).training.lr == 2e-4
    assert load_config(None, ["data.num_samples=null"]).data.num_samples is None
    assert load_config(None, ["training.num_epochs=2"]).training.num_epochs == 2.0


def test_round_trip_through_yaml(tmp_path):
    c = load_config(None, ["training.lr=3e-4", "vocab.draft_vocab_size=1000"])
    path = tmp_path / "dump.yaml"
    path.write_text(dump_config(c))
    assert load_config(path) == c


def test_unknown_key_names_the_key_and_the_file(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("training:\n  learning_rate: 1e-3\n")
    with pytest.raises(UserError, match=r"typo\.yaml: unknown key 'training\.learning_rate'"):
        load_config(recipe)
    with pytest.raises(UserError, match=r"command-line override: unknown key 'trainig'"):
        load_config(None, ["trainig.lr=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.lr=fast", "training.lr must be float"),
        ("training.batch_size=2.5", "training.batch_size must be int"),
        ("training.batch_size=true", "training.batch_size must be int"),
        ("training.betas=0.9", "training.betas must be a list"),
        ("training.precision=fp16", "training.precision must be auto, bf16 or fp32"),
        ("tracking.report_to=mlflow", "tracking.report_to must be one of none, wandb, tensorboard"),
        ("training.optimizer=sgd", "training.optimizer must be adamw or muon"),
        ("training.schedule=step", "training.schedule must be cosine or linear"),
        ("vocab.count=prompts", "vocab.count must be replies or target_argmax"),
        ("training.ttt_decay=0", r"training.ttt_decay must be in \(0, 1\]"),
        ("training=3", "training must be a mapping"),
        ("training.lr", "expected section.key=value"),
    ],
)
def test_bad_values_are_clear(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("lever", RETIRED)
def test_retired_levers_are_refused_by_name(tmp_path, lever):
    """A recipe still naming a lever measured as no help is told so, from a file or a
    command line, rather than training without it."""
    section, key = lever.split(".")
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"{section}:\n  {key}: 0\n")
    for args in ((recipe,), (None, [f"{lever}=0"])):
        with pytest.raises(UserError, match=rf"{lever} was retired: measured as no help"):
            load_config(*args)


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="cannot read recipe"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="must be a mapping of sections"):
        load_config(bad)


def test_parse_overrides_nests():
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}


def test_split_recipe_from_overrides():
    assert split_recipe(["r.yaml", "training.lr=1"]) == ("r.yaml", ["training.lr=1"])
    assert split_recipe(["training.lr=1"]) == (None, ["training.lr=1"])
    assert split_recipe([]) == (None, [])


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    if recipe.name.startswith("accelerate"):
        pytest.skip("an accelerate config, not a recipe")
    assert isinstance(load_config(recipe), TrainConfig)


def test_cli_prints_the_resolved_recipe_and_rejects_typos(capsys):
    from eagletools.cli import main

    recipe = str(RECIPES / "smollm2-135m-cpu.yaml")
    assert main(["train", recipe, "training.lr=1e-3", "--output-dir", "x", "--print-config"]) == 0
    assert "lr: 0.001" in capsys.readouterr().out
    assert main(["train", recipe, "training.lrr=1", "--output-dir", "x"]) == 2
    assert "unknown key 'training.lrr'" in capsys.readouterr().err
    # overrides after the options, as users type them
    argv = ["train", recipe, "--output-dir", "x", "training.lr=2e-3", "--print-config"]
    assert main([*argv, "training.ttt_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.002" in out and "ttt_steps: 3" in out
    assert main(["train", recipe, "--output-dir", "x", "training.lrr=1"]) == 2
    assert "unknown key 'training.lrr'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # anything else stray is still argparse's error
        main(["train", recipe, "--output-dir", "x", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_checkpoint_saved_before_a_lever_was_retired_still_resumes():
    """A saved recipe with the retired levers at the values that changed nothing, and
    without keys added since, reads as today's default; a lever that was in use is named."""
    from eagletools.train.recipe import RETIRED, TrainConfig, saved_config

    old = TrainConfig().to_dict()
    for dotted, inert in RETIRED.items():
        section, key = dotted.split(".")
        old[section][key] = inert
    del old["data"]["regenerate"]["top_p"]
    assert saved_config(old, "ckpt") == TrainConfig()
    old["training"]["teacher_topk"] = 8
    with pytest.raises(UserError, match="training.teacher_topk was retired"):
        saved_config(old, "ckpt")
