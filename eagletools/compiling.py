"""torch.compile for decoding steps: the weights frozen, the inputs that vary from
step to step dynamic from the first call."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch


def compile_frozen(fn: Callable, dynamic_sources: str) -> Callable:
    """`fn` compiled by inductor with the weights it reads frozen (on CPU packed once for
    oneDNN) and `dynamic_sources` (its parameters, as `L['name']` or `L['name']:dim`,
    comma-separated) symbolic from the first call.

    Dynamic from the first call: a graph specialised to the first call's values
    would run that call with other kernels than the next ones. The settings are
    applied around each call, not in `torch.compile`'s `options`, whence freezing
    did not reach the CPU's weight packing (a slower step; docs/lab.md, Part 3).

    On CPU the graph's wrapper is C++ (`cpp_wrapper`), not Python: a SmolLM2
    decode step calls ~300 kernels, and Python's per-call cost is a measurable
    share of the step (docs/lab.md, Part 3; the same logits bit for bit). That
    wrapper is a Python extension, built only where
    Python's headers are installed (`python3-dev`); on CUDA the step is replayed
    from a CUDA graph anyway.

    The modules' own guards are dropped (`frozen_module_guards`): dynamo checked
    ~4,000 guards before each SmolLM2 step, 1.45 ms of a ~30 ms token (0.60 ms
    with what it keeps).

    Every rounding to a lower precision that `fn` writes happens in the graph too
    (`emulate_precision_casts`), wherever inductor fuses: otherwise a value kept in
    a register skips its bf16 rounding and one kept in a buffer does not, so a
    row's bits follow the fusion plan. Tree depths computed inside the whole
    speculative step fused RoPE's output into the score product in fp32 where
    plain decoding's graph stored it in bf16: 3 of 8 random prompts decoded
    apart from plain decoding (a 2-layer SmolLM2-shaped model, a 3-node chain),
    0 of 8 with the roundings kept.
    """
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    compiled = torch.compile(fn, options={"guard_filter_fn": frozen_module_guards})

    def call(*args):
        on_cpu = all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
        with (
            inductor_config.patch(
                freezing=True,
                emulate_precision_casts=True,
                cpp_wrapper=on_cpu and python_headers(),
                **(cpu_gemm_template() if on_cpu else {}),
            ),
            torch.compiler.config.patch(dynamic_sources=dynamic_sources),
            dynamo_config.patch(recompile_limit=64),  # a graph per shape and cache
        ):
            return compiled(*args)

    return call


# guards on a module's structure: its hooks, its attributes' absence, its inputs' aliasing
MODULE_GUARDS = {"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "DUPLICATE_INPUT"}


def frozen_module_guards(entries) -> list[bool]:
    """Which of dynamo's guards a frozen step keeps: not those on the modules it reads
    (their type, hooks and attributes), nor those on its parameters but their identity.

    Freezing made the weights constants of the graph, and decoding adds no hooks
    and swaps no module. A parameter replaced by another object (FSDP2 swaps its
    sharded and unsharded parameters; `load_state_dict(assign=True)`) fails its
    identity guard and compiles again with the new constants; one changed in place
    keeps the old constants, as freezing always did. Every guard on the step's
    inputs, on the caches it writes (tensors, reached through the model too), on
    flags (bools such as `Attention.exact`) and on the tensors' shapes stays; a
    module's ints (its head counts) are fixed at construction.
    """
    from torch import nn

    def module_part(entry) -> bool:
        if entry.guard_type in MODULE_GUARDS:
            return True
        value = entry.value if entry.has_value else None
        if isinstance(value, nn.Parameter):
            return entry.guard_type != "ID_MATCH"  # a parameter swapped in (FSDP2) recompiles
        if isinstance(value, nn.Module):
            return True
        if type(value) in (int, type(None)) and "._modules[" in entry.name:
            return True  # sizes fixed at construction (`n_heads`), absent biases; bools stay
        return isinstance(value, dict) and entry.name.endswith(("._modules", "._parameters"))

    return [not module_part(entry) for entry in entries]


def require_cpu_compiler(field: str) -> None:
    """Fail before training starts where inductor could not build its CPU kernels:
    otherwise the first step, minutes in, dies inside torch with a compiler trace."""
    from eagletools.errors import UserError

    # inductor's own choice (torch._inductor.config.cpp.cxx)
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(cxx) is None:
        raise UserError(
            f"{field}: true compiles the training step for the CPU, which needs the C++ "
            f"compiler {cxx!r} (inductor's; the CXX environment variable names another), "
            f"and it is not on PATH: install it (e.g. `apt install g++`) or set {field}=false"
        )


@functools.cache
def python_headers() -> bool:
    """Whether `Python.h` is installed, which inductor's C++ wrapper compiles against."""
    return (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()


def cpu_gemm_template() -> dict:
    """Inductor settings that build every CPU linear from inductor's C++ GEMM template
    instead of calling oneDNN.

    For one bf16 row the template's kernels are faster than oneDNN's packed ones,
    and 2 to 4 rows cost about the same as one, but from 5 rows the template's
    fp32 multiply-adds bound it and oneDNN is faster, which is why small trees win
    (docs/lab.md, Part 3).

    The template is the only backend, so nothing is timed between backends and
    every graph computes a row alike: each output is one fp32 multiply-add chain
    over K in order, whatever the row count and blocking, the row invariance
    exact decoding needs. It forms only products with a constant (frozen) weight:
    one of two activations (attention's) must go through `cpu_ops.batched_product`,
    or inductor stops with `NoValidChoicesError` (tests/test_compiling.py).
    """
    return {"max_autotune_gemm": True, "max_autotune_gemm_backends": "CPP"}
