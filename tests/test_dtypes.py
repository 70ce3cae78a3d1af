"""One dtype parser: both spellings everywhere, and an error that lists the known ones."""

from __future__ import annotations

import pytest
import torch

from eagletools.dtypes import SPELLINGS, dtype_name, parse_dtype
from eagletools.errors import UserError


@pytest.mark.parametrize(
    "text, dtype",
    [
        ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
        ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
        ("fp32", torch.float32), ("float32", torch.float32), ("float", torch.float32),
        ("torch.bfloat16", torch.bfloat16), (torch.float16, torch.float16),
    ],
)  # fmt: skip
def test_parse_dtype_spellings(text, dtype):
    assert parse_dtype(text) is dtype


def test_unknown_dtype_names_where_and_lists_known():
    with pytest.raises(UserError) as err:
        dtype_name("bf17", "--dtype")
    message = str(err.value)
    assert message.startswith("--dtype: unknown dtype 'bf17'")
    assert all(spelling in message for spelling in SPELLINGS)


def test_recipe_dtype_fields_take_both_spellings():
    from eagletools.train.recipe import load_config

    # target.dtype=bf16 used to reach getattr(torch, "bf16") in the trainer: a traceback
    config = load_config(overrides=["target.dtype=bf16", "training.precision=bfloat16"])
    assert config.target.dtype == "bfloat16" and parse_dtype(config.target.dtype) is torch.bfloat16
    assert config.training.precision == "bf16"  # accelerate's spelling, for mixed_precision
    assert load_config(overrides=["training.precision=float32"]).training.precision == "fp32"


def test_recipe_unknown_dtype_names_file_and_field(tmp_path):
    from eagletools.train.recipe import load_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("target:\n  dtype: brainfloat\n")
    with pytest.raises(UserError, match=rf"{recipe}: target.dtype: unknown dtype 'brainfloat'; "
                       r"known: bf16, bfloat16"):  # fmt: skip
        load_config(recipe)
    with pytest.raises(UserError, match="training.precision must be auto, bf16 or fp32"):
        load_config(overrides=["training.precision=fp16"])


# every command with a dtype flag, with its required arguments
DTYPE_COMMANDS = [
    ["eval", "--output-dir", "out"],
    ["generate", "hello"],
    ["data", "hidden-states", "--target", "t", "--data", "d", "--output-dir", "out"],
    ["convert", "src", "out", "--to", "eagle"],
]


@pytest.mark.parametrize("argv", DTYPE_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_dtype_flags_take_both_spellings(argv, capsys):
    from eagletools.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([*argv, "--dtype", "bf16"]).dtype == "bfloat16"
    assert parser.parse_args([*argv, "--dtype", "float16"]).dtype == "float16"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*argv, "--dtype", "bf17"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --dtype: unknown dtype 'bf17'; known: bf16, bfloat16, fp16" in err


def test_training_precision_auto_is_the_devices_faster_matmul_dtype(tiny_target, monkeypatch):
    from eagletools.devices import fast_matmul_dtype
    from eagletools.train.inputs import load_teacher, training_dtype
    from eagletools.train.recipe import load_config

    cpu = torch.device("cpu")
    assert load_config().training.precision == "auto"
    assert training_dtype("auto", cpu) is fast_matmul_dtype(cpu)
    assert training_dtype("bf16", cpu) is torch.bfloat16
    assert training_dtype("fp32", cpu) is torch.float32

    # fp32 training runs the teacher in fp32 whatever target.dtype says; bf16 keeps target.dtype
    def teacher_dtype(precision: str) -> torch.dtype:
        config = load_config(overrides=[f"target.spec={tiny_target}", "target.dtype=bf16",
                                        f"training.precision={precision}"])  # fmt: skip
        return load_teacher(config).model.dtype

    assert teacher_dtype("fp32") is torch.float32 and teacher_dtype("bf16") is torch.bfloat16
    import eagletools.devices as devices

    monkeypatch.setattr(devices, "cpu_bf16_speedup", lambda: 0.6)  # bf16 GEMMs the slower
    for has_amx, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=has_amx: v)
        assert teacher_dtype("auto") is want
