"""`eagletools inspect`: the report, and every incompatibility with a target named with its fix."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from test_formats import (
    eagle_release_tensors,
    make_ckpt,
    safeailab_release,
    save_target_folder,
    specforge_export,
)

from eagletools.cli import main
from eagletools.formats import save_checkpoint


def inspect_json(capsys, *args) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["inspect", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """6 layers, RoPE theta 5e5 and 4096 positions: unlike the release's defaults."""
    model = tiny_model(
        "llama",
        num_hidden_layers=6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        max_position_embeddings=4096,
    )
    return save_target_folder(tmp_path_factory.mktemp("target"), model)


def test_release_report(tmp_path, capsys):
    src = safeailab_release(tmp_path / "r")
    rc, r = inspect_json(capsys, src)
    assert rc == 0 and r["ok"] and r["format"] == "eagle"
    tensors = eagle_release_tensors(torch.float16, False)
    assert r["parameters"] == sum(v.numel() for v in tensors.values() if v.is_floating_point())
    assert r["embedding_parameters"] == 0
    assert r["dtypes"] == {"float16": 13, "int64": 1, "bool": 1}
    assert r["vocab"]["draft_vocab_size"] == 100 and r["vocab"]["target_vocab_size"] == 256
    assert all(c["ok"] for c in r["vocab"]["checks"]) and len(r["vocab"]["checks"]) == 7
    assert r["aux_layer_ids"] is None
    assert r["config"]["max_position_embeddings"] == 2048
    main(["inspect", str(src)])
    text = capsys.readouterr().out
    assert f"{src}: eagle format" in text and "float16 x13" in text and "layers: 1," in text
    assert "[ok] t2d.sum() == Vd" in text and "aux layers: not recorded" in text


def test_a_two_layer_draft_reports_its_layers_and_weights(tmp_path, capsys):
    ckpt = make_ckpt(aux_layer_ids=[1, 2, 3], num_hidden_layers=2)
    save_checkpoint(ckpt, tmp_path / "d", "eagle")
    rc, r = inspect_json(capsys, tmp_path / "d")
    assert rc == 0 and r["config"]["num_hidden_layers"] == 2
    assert r["parameters"] == sum(
        v.numel() for k, v in ckpt.tensors.items() if v.is_floating_point() and "embed" not in k
    )
    main(["inspect", str(tmp_path / "d")])
    assert "layers: 2, hidden 64" in capsys.readouterr().out


def test_aux_layers_in_both_conventions(tmp_path, capsys):
    src = specforge_export(tmp_path / "sf", num_target_layers=32)
    rc, r = inspect_json(capsys, src)
    assert r["aux_layer_ids"] == {
        "hf_hidden_states": [2, 16, 29],
        "decoder_layer_outputs": [1, 15, 28],
    }
    assert r["embedding_parameters"] == 256 * 64 and r["dtypes"]["bfloat16"] == 14
    main(["inspect", str(src)])
    assert "[2, 16, 29] as HF hidden-state indices" in capsys.readouterr().out


def test_release_against_target_names_each_problem_and_fix(tmp_path, target_dir, capsys):
    src = safeailab_release(tmp_path / "r")
    rc, r = inspect_json(capsys, src, "--target", target_dir)
    assert rc == 1 and not r["ok"]
    problems = {p["field"]: p for p in r["problems"]}
    assert set(problems) == {"aux_layer_ids", "rope", "max_position_embeddings"}
    assert not problems["aux_layer_ids"]["error"]  # engines' default applies: a warning
    assert "[2, 3, 3]" in problems["aux_layer_ids"]["message"]
    assert "rope_theta=500000.0" in problems["rope"]["message"]
    assert "2048 < the target's 4096" in problems["max_position_embeddings"]["message"]
    assert "convert with --target" in problems["max_position_embeddings"]["fix"]
    main(["inspect", str(src), "--target", str(target_dir)])
    text = capsys.readouterr().out
    assert "error: max_position_embeddings: 2048 < the target's 4096" in text
    assert "fix: convert with --target" in text
    # the fix works: after converting with the target, inspect is clean
    fixed = tmp_path / "fixed"
    assert (
        main(["convert", str(src), str(fixed), "--to", "eagle", "--target", str(target_dir)]) == 0
    )
    rc, r = inspect_json(capsys, fixed, "--target", target_dir)
    assert rc == 0 and r["problems"] == []


def test_width_vocab_and_layers_mismatch(tmp_path, capsys):
    odd = tiny_model("llama", hidden_size=32, vocab_size=300, num_hidden_layers=2)
    target = save_target_folder(tmp_path / "odd", odd)
    save_checkpoint(make_ckpt(aux_layer_ids=[1, 2, 3]), tmp_path / "d", "speculators")
    rc, r = inspect_json(capsys, tmp_path / "d", "--target", target)
    problems = {p["field"]: p for p in r["problems"]}
    assert rc == 1
    assert "width 64" in problems["target_hidden_size"]["message"]
    assert "has hidden_size 32" in problems["target_hidden_size"]["message"]
    assert "256" in problems["vocab_size"]["message"] and "300" in problems["vocab_size"]["message"]
    assert "exceed the target's 2 layers" in problems["aux_layer_ids"]["message"]


def test_embeddings_unlike_the_targets_are_flagged(tmp_path, target_dir, capsys):
    save_checkpoint(
        make_ckpt(aux_layer_ids=[1, 2, 3]), tmp_path / "d", "eagle", with_embeddings=True
    )
    rc, r = inspect_json(capsys, tmp_path / "d", "--target", target_dir)
    embed = next(p for p in r["problems"] if p["field"] == "embed_tokens")
    assert not embed["error"] and "differ from" in embed["message"]


def test_invalid_checkpoint_is_an_error_not_a_report(tmp_path, capsys):
    tensors = eagle_release_tensors(torch.float16, False)
    tensors["d2t"][3] = -5
    cfg = json.loads((safeailab_release(tmp_path / "r") / "config.json").read_text())
    from test_formats import save_raw

    save_raw(tmp_path / "bad", cfg, tensors)
    assert main(["inspect", str(tmp_path / "bad")]) == 2
    assert "d2t is non-decreasing" in capsys.readouterr().err
