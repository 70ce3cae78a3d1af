"""One device policy: `--device auto` by default on every command that runs a model."""

from __future__ import annotations

import pytest
import torch

from eagletools.cli import build_parser, main
from eagletools.devices import fast_matmul_dtype, resolve_device
from eagletools.errors import UserError

# every command that runs a model, with its required arguments
MODEL_COMMANDS = [
    ["eval", "--output-dir", "out"],
    ["generate", "hello"],
    ["data", "hidden-states", "--target", "t", "--data", "d", "--output-dir", "out"],
    ["data", "regenerate", "--target", "t", "--data", "d", "--output", "o.jsonl"],
]


@pytest.fixture
def fresh_state():
    """accelerate's PartialState is a process-wide singleton: start and leave it unset."""
    from accelerate import PartialState

    PartialState._reset_state()
    yield
    PartialState._reset_state()


@pytest.fixture
def cuda(fresh_state, monkeypatch):
    """A machine where torch sees CUDA (only resolution is tested: nothing runs on it).

    accelerate 1.16 asks `torch.accelerator` which device there is, before 1.16
    `torch.cuda`: both answer CUDA here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))


@pytest.mark.parametrize("argv", MODEL_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_device_defaults_to_auto_everywhere(argv, cuda):
    args = build_parser().parse_args(argv)
    assert args.device == "auto"
    assert resolve_device(args.device) == torch.device("cuda")


def test_eval_settings_and_the_recipe_default_to_auto(cuda):
    from eagletools.commands.generate import settings_from_args
    from eagletools.eval.runner import Settings
    from eagletools.train.recipe import EvalSection

    assert Settings().device == "cuda"
    args = build_parser().parse_args(["eval", "--output-dir", "out"])
    assert settings_from_args(args).device == "cuda"
    assert EvalSection().device == "auto"  # the pipeline's eval


def test_auto_is_the_cpu_without_cuda(fresh_state, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_cuda_is_a_clear_error(fresh_state, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda: torch .* sees no CUDA device") as err:
        resolve_device("cuda")
    assert "use --device cpu" in str(err.value) and "make setup TORCH_SPEC=torch" in str(err.value)
    with pytest.raises(UserError, match="not a device; use auto"):
        resolve_device("gpu")
    assert main(["generate", "--device", "cuda", "hello"]) == 2
    assert "--device cuda: torch" in capsys.readouterr().err
    argv = ["data", "hidden-states", "--target", "t", "--data", "d", "--output-dir", "o"]
    assert main([*argv, "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_pipeline_eval_device_fails_before_training(fresh_state, monkeypatch, tmp_path):
    from eagletools.pipeline import stages
    from eagletools.train.recipe import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config(overrides=["eval.device=cuda", "eval.benchmarks=[mt-bench]"])
    with pytest.raises(UserError, match="eval.device cuda: torch"):
        stages(config, tmp_path)


@pytest.mark.parametrize(("device", "amx", "bf16_dot", "speedup", "want"), [
    ("cpu", False, False, 9.0, torch.float32),
    ("cpu", False, True, 0.6, torch.float32),  # a Xeon without AMX: bf16 GEMMs the slower
    ("cpu", False, True, 1.1, torch.float32),  # a close call keeps fp32
    ("cpu", False, True, 2.8, torch.bfloat16),  # an EPYC (Zen 4)
    ("cpu", True, True, 0.1, torch.bfloat16),
    ("cuda", False, False, 0.1, torch.bfloat16),
])  # fmt: skip
def test_fast_matmul_dtype_follows_the_hardware(monkeypatch, device, amx, bf16_dot, speedup, want):
    import eagletools.devices as devices

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_dot)
    monkeypatch.setattr(devices, "cpu_bf16_speedup", lambda: speedup)
    assert fast_matmul_dtype(torch.device(device)) == want


def test_the_bf16_speedup_is_measured_once():
    from eagletools.devices import cpu_bf16_speedup

    cpu_bf16_speedup.cache_clear()
    first = cpu_bf16_speedup()
    # a CPU without bf16 units measured 0.013 (2-core EPYC, 2026-12-04)
    assert 0 < first < 20 and cpu_bf16_speedup() == first


def test_cuda_n_is_made_the_current_device(cuda, monkeypatch):
    """Triton launches and CUDA-graph capture follow the current device, not the
    tensors': `--device cuda:1` must make device 1 current, or kernels launch on 0."""
    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert current == [torch.device("cuda:1")]
    resolve_device("cpu")
    assert current == [torch.device("cuda:1")]  # a CPU run leaves CUDA alone
