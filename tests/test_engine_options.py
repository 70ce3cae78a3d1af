"""Which engine computes which draft (formats/engines.py): a draft using an option its engine
ignores is refused by convert --for, inspect --engine, eval --engine and a recipe's
draft.engines, naming the option and the recipe field; docs/formats.md prints the table."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_draft_config
from test_formats import make_ckpt

from eagletools.cli import main as cli
from eagletools.engines import ENGINE_NAMES
from eagletools.errors import UserError
from eagletools.formats import load_checkpoint, save_checkpoint
from eagletools.formats.engines import (
    OPTIONS,
    check_draft_on_disk,
    check_engine,
    markdown_table,
    unsupported,
)
from eagletools.formats.gguf import check_supported
from eagletools.targets import default_aux_layer_ids
from eagletools.train.recipe import load_config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "formats.md"


def test_sgljax_refuses_norm_before_residual_naming_the_recipe_field():
    config = tiny_draft_config(norm_before_residual=True)
    with pytest.raises(UserError, match=r"norm_before_residual \(recipe field draft\.norm"):
        check_engine(config, "sgl-jax", "draft")
    check_engine(config, "vllm", "draft")
    check_engine(tiny_draft_config(), "sgl-jax", "draft")


def test_eagle31_options_are_refused_where_they_are_ignored():
    config = tiny_draft_config(fc_norm=True, norm_output=True)
    names = {o.name for o in unsupported(config, "llama.cpp")}
    assert names == {"fc_norm", "norm_output"}
    assert unsupported(config, "vllm") == []


def test_norm_before_fc_is_refused_where_fc_runs_on_the_raw_states():
    """vLLM, llama.cpp and TensorRT-LLM build `input_norm`; SGLang, sgl-jax and the
    SafeAILab code run fc on the raw aux states (the table's evidence)."""
    config = tiny_draft_config(norm_before_fc=True)
    refused = {e for e in ENGINE_NAMES if unsupported(config, e)}
    assert refused == {"sglang", "sgl-jax", "eagle"}
    with pytest.raises(UserError, match=r"norm_before_fc \(recipe field draft\.norm_before_fc\)"):
        check_engine(config, "sglang", "draft")
    check_supported(config)  # convert --to gguf writes it (tests/test_gguf.py)
    with pytest.raises(UserError, match=r"draft\.engines.*draft\.norm_before_fc"):
        load_config(overrides=["draft.norm_before_fc=true", "draft.engines=[vllm, sgl-jax]"])
    load_config(overrides=["draft.norm_before_fc=true", "draft.engines=[vllm, llama.cpp]"])
    with pytest.raises(
        UserError, match=r"draft\.norm_before_fc cannot be true with draft\.fc_norm"
    ):
        load_config(overrides=["draft.norm_before_fc=true", "draft.fc_norm=true"])


def test_non_default_aux_ids_need_the_target_layer_count():
    config = tiny_draft_config(aux_layer_ids=[1, 2, 3])
    assert unsupported(config, "sgl-jax") == []  # no target: unknown, not refused
    assert [o.name for o in unsupported(config, "sgl-jax", 8)] == ["aux_layer_ids"]
    default = tiny_draft_config(aux_layer_ids=default_aux_layer_ids(8))
    assert unsupported(default, "sgl-jax", 8) == []
    assert unsupported(config, "vllm", 8) == []


def test_a_second_layer_is_refused_where_only_one_is_run(tmp_path):
    config = tiny_draft_config(num_hidden_layers=2)
    refused = {e for e in ENGINE_NAMES if unsupported(config, e)}
    assert refused == {"sglang", "sgl-jax", "llama.cpp", "eagle"}
    assert all(unsupported(tiny_draft_config(), e) == [] for e in ENGINE_NAMES)
    with pytest.raises(UserError, match=r"draft\.engines.*draft\.num_hidden_layers"):
        load_config(overrides=["draft.num_hidden_layers=2", "draft.engines=[vllm, sglang]"])
    load_config(overrides=["draft.num_hidden_layers=2", "draft.engines=[vllm]"])
    save_checkpoint(
        make_ckpt(aux_layer_ids=[1, 3, 5], num_hidden_layers=2), tmp_path / "d", "eagle"
    )
    with pytest.raises(UserError, match=r"num_hidden_layers 2 \(its eagle3 has blk.0 only\)"):
        check_supported(load_checkpoint(tmp_path / "d").config)  # what convert --to gguf runs


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(UserError, match="known: vllm, sglang, sgl-jax"):
        unsupported(tiny_draft_config(), "tgi")


def test_convert_for_refuses_before_writing(tmp_path, capsys):
    save_checkpoint(make_ckpt(norm_before_residual=True), tmp_path / "train", "training")
    out = tmp_path / "eagle"
    args = ["convert", str(tmp_path / "train"), str(out), "--to", "eagle"]
    assert cli([*args, "--for", "sgl-jax"]) != 0
    assert "draft.norm_before_residual" in capsys.readouterr().err
    assert not out.exists()
    assert cli([*args, "--for", "vllm"]) == 0 and out.is_dir()


def test_inspect_engine_fails_the_report(tmp_path, capsys):
    save_checkpoint(make_ckpt(fc_norm=True), tmp_path / "d", "eagle")
    assert cli(["inspect", str(tmp_path / "d"), "--engine", "sglang"]) == 1
    assert "ignores fc_norm (recipe field draft.fc_norm)" in capsys.readouterr().out
    assert cli(["inspect", str(tmp_path / "d"), "--engine", "vllm"]) == 0


def test_eval_engine_check_reads_the_draft_folder(tmp_path):
    save_checkpoint(make_ckpt(norm_output=True), tmp_path / "d", "speculators")
    with pytest.raises(UserError, match="draft.norm_output"):
        check_draft_on_disk(tmp_path / "d", "sgl-jax", None)
    check_draft_on_disk(tmp_path / "d", "vllm", None)
    check_draft_on_disk(tmp_path / "draft.gguf", "llama.cpp", None)  # refused at conversion


def test_recipe_draft_engines_refuse_before_training():
    with pytest.raises(UserError, match=r"draft\.engines.*draft\.norm_before_residual"):
        load_config(overrides=["draft.norm_before_residual=true", "draft.engines=[sgl-jax]"])
    with pytest.raises(UserError, match="unknown engine"):
        load_config(overrides=["draft.engines=[tgi]"])
    config = load_config(overrides=["draft.norm_before_residual=true", "draft.engines=[vllm]"])
    assert config.draft.engines == ["vllm"]


def test_every_cell_says_how_it_is_known_and_docs_print_the_table():
    for option in OPTIONS:
        assert set(option.cells) == set(ENGINE_NAMES), option.name
        for cell in option.cells.values():
            assert cell.evidence.startswith(("run: ", "read: ")), cell
    assert markdown_table() in DOCS.read_text()
