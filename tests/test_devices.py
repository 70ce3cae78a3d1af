"""One device policy: `--device auto` by default on every command that runs a model."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

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
    from eagletools.decode.session import Settings
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


class Guards:
    """`torch.cuda.device` on a machine without CUDA: records the devices made current."""

    def __init__(self):
        self.current: list[torch.device] = []  # the guards entered and not yet left
        self.entered: list[torch.device] = []

    def __call__(self, device):
        guards = self

        class Guard:
            def __enter__(self):
                guards.current.append(torch.device(device))
                guards.entered.append(torch.device(device))

            def __exit__(self, *exc):
                guards.current.pop()

        return Guard()


@pytest.fixture
def guards(monkeypatch):
    guards = Guards()
    monkeypatch.setattr(torch.cuda, "device", guards)
    return guards


@pytest.mark.parametrize("argv", MODEL_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_makes_cuda_n_current(argv, cuda, monkeypatch):
    """`--device cuda:1` on each command: device 1 is current before any model is loaded."""

    class Current(Exception):
        pass

    def set_device(device):
        raise Current(torch.device(device))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    # regenerate reads its conversations before the target: none here
    nothing = ([], SimpleNamespace(summary=lambda: "no conversations"))
    monkeypatch.setattr("eagletools.data.conversations.load_conversations", lambda *a: nothing)
    with pytest.raises(Current) as made:
        main([*argv, "--device", "cuda:1"])
    assert made.value.args == (torch.device("cuda:1"),)


def test_device_guard_makes_a_cuda_device_current(guards):
    from eagletools.devices import device_guard

    with device_guard(torch.device("cuda:1")):
        assert guards.current == [torch.device("cuda:1")]
    with device_guard(torch.device("cpu")):
        assert guards.current == []  # off CUDA, nothing to make current
    assert guards.entered == [torch.device("cuda:1")]


def test_graph_capture_and_replay_on_their_device(guards, monkeypatch):
    """A graph for `cuda:1` is captured (on a stream `torch.cuda.graph` makes on the current
    device) and replayed with device 1 current, whichever device was current before."""
    from eagletools.decode.graphs import StaticCall

    events = []

    class Fake:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def replay(self):
            events.append(("replay", list(guards.current)))

    @contextlib.contextmanager
    def capture(graph):
        events.append(("capture", list(guards.current)))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Fake)
    monkeypatch.setattr(torch.cuda, "current_stream", Fake)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Fake)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    call = StaticCall(lambda x: (x + 1,), torch.device("cuda:1"), tuple)
    call(torch.zeros(2))  # set up, captured and replayed once
    call(torch.ones(2))  # replayed
    on_1 = [torch.device("cuda:1")]
    assert events == [("capture", on_1), ("replay", on_1), ("replay", on_1)]


def test_the_decoder_launches_under_its_models_device(monkeypatch):
    """The decode runtime makes its model's device current around a generation, so its
    Triton kernels launch there even when no command resolved the device (Python API)."""
    from conftest import tiny_model

    from eagletools import kernels
    from eagletools.decode import engine
    from eagletools.decode.model import Transformer
    from eagletools.draft import Eagle3Draft

    guarded, launched = [], []

    @contextlib.contextmanager
    def guard(device):
        guarded.append(device)
        yield
        guarded.pop()

    verify = kernels.verify_greedy

    def recorded(*args):
        launched.append(list(guarded))
        return verify(*args)

    monkeypatch.setattr(engine, "device_guard", guard)
    monkeypatch.setattr(kernels, "verify_greedy", recorded)
    model = tiny_model("llama", vocab_size=300)
    n = model.config.num_hidden_layers
    draft = Eagle3Draft.from_target(model, aux_layer_ids=[1, n // 2, n - 1])
    runtime = Transformer.from_hf(model)
    engine.SpeculativeDecoder(runtime, draft, None, 2, 3, 6).generate(list(range(10, 30)), 8)
    assert launched and all(g == [runtime.device] for g in launched)
