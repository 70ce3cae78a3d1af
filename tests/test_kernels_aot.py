"""Every kernel compiled for real GPUs without one (eagletools.kernels.aot), and the
checks each compiled kernel must pass (docs/design.md 3.7).

The compiles run in a child process with a fresh Triton cache, so every variant
really compiles, and without TRITON_INTERPRET, which Triton reads once, at import
(tests/test_kernels_triton.py sets it for this whole pytest process).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import eagletools.kernels
from eagletools.kernels.aot import MAX_GRID, SHARED_MEMORY, Build, narrow_offsets

ARCHS = (80, 90, 120)  # A100; H100/H200; RTX 50xx, with sm_86/89's 101,376 B


def compiling(args: list[str], cache) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)


def every_kernel() -> set[str]:
    """The `_*_kernel` functions of every module in eagletools/kernels/."""
    names = set()
    for info in pkgutil.iter_modules(eagletools.kernels.__path__):
        module = importlib.import_module(f"eagletools.kernels.{info.name}")
        names |= {n for n in vars(module) if n.startswith("_") and n.endswith("_kernel")}
    return names


@pytest.mark.slow
def test_every_kernel_compiles_within_each_archs_limits(tmp_path, capsys):
    """kernel x {sm_80, sm_90, sm_120} x {bf16, fp16, fp32} x {Llama-3.1-8B, Qwen3-8B,
    Llama-3.1-70B}, with the CUDA-graph and key-split variants: the compiler, not the
    interpreter, with Triton's own specialisation."""
    run = compiling(["-m", "eagletools.kernels.aot", "--arch", *map(str, ARCHS)], tmp_path)
    with capsys.disabled():  # the Triton version and the per-kernel table, in `make test`
        print("\n" + run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.startswith("triton "), run.stdout
    table = [line.split() for line in run.stdout.splitlines()]
    built = {(row[0], row[1]) for row in table if row and row[0].endswith("_kernel")}
    kernels = every_kernel()
    assert len(kernels) >= 6
    assert built == {(k, f"sm_{a}") for k in kernels for a in ARCHS}, run.stdout


OLD_TILES = """
from eagletools.kernels import aot, attention

# one tile for every arch and dtype, as before the per-arch choice (and fp32's before a2316ca)
attention._tiles = lambda arch, element_size, rows, d: (64, 64, 128, 8)
problems = {}
with aot.compiling_for(80):
    for dtype in ("fp32", "bf16"):
        launch = dict(aot.launches(aot.SHAPES[2], dtype))["tree_attention"]
        (kernel, grid), = aot.compiled_launches(launch)
        problems[dtype] = aot.check(kernel, grid, "old tiles", 80, dtype).problems()
# tl.arange(0, 96) does not compile: each launch is reported, the other kernels still build
attention._tiles = lambda arch, element_size, rows, d: (64, 64, 96, 8)
aot.SHAPES = aot.SHAPES[:1]
problems["broken"] = {b.label: b.problems() for b in aot.compile_unit(80, "bf16")}
print(json.dumps(problems))
"""


def test_oversized_tiles_fail_the_check(tmp_path):
    """Real compiles: 64 x 64 fp32 tiles overflow sm_80's shared memory, bf16 ones spill,
    and a tile Triton rejects is reported for each launch it breaks."""
    run = compiling(["-c", "import json\n" + textwrap.dedent(OLD_TILES)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    problems = json.loads(run.stdout.splitlines()[-1])
    assert [p.split(" B >")[0] for p in problems["fp32"]] == ["shared memory 180,736"]
    assert len(problems["bf16"]) == 1 and problems["bf16"][0].endswith("B of register spills")
    broken = {label: found for label, found in problems["broken"].items() if found}
    assert {label.split()[0] for label in broken} == {"tree_attention"}
    assert len(broken) == 4 and len(problems["broken"]) > 4, problems["broken"]
    assert all(found[0].startswith("does not compile: ") for found in broken.values())


def build(**changes) -> Build:
    fields = dict(
        label="tree_attention Llama-3.1-8B",
        kernel="_tree_attention_kernel",
        arch=80,
        dtype="bf16",
        grid=(2, 8, 1),
        shared=53_248,
        registers=176,
        stack=0,
        narrow=(),
    )
    return Build(**(fields | changes))


def test_a_build_within_the_limits_has_no_problem():
    assert build().problems() == []
    assert build(arch=120, shared=SHARED_MEMORY[120], grid=(MAX_GRID[0], 65_535)).problems() == []


@pytest.mark.parametrize(
    "changes,problem",
    [
        (dict(shared=180_736), "shared memory 180,736 B > 166,912 B"),  # fp32's old tiles
        (dict(arch=120, shared=131_072), "shared memory 131,072 B > 101,376 B"),
        (dict(stack=24), "24 B of register spills"),
        (dict(dtype="fp16", stack=8), "8 B of register spills"),
        (dict(dtype="-", stack=8), "8 B of register spills"),  # the verifications
        (dict(grid=(1, 65_536)), "grid (1, 65536) past"),
        (dict(grid=(2**31,)), "grid (2147483648,) past"),
        (dict(narrow=("%k_row",)), "32-bit program-id x stride offsets %k_row"),
    ],
)
def test_a_build_past_a_limit_names_it(changes, problem):
    problems = build(**changes).problems()
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_a_launch_that_does_not_compile_is_a_problem():
    failed = Build("tree_attention Qwen3-8B", "tree_attention", 80, "fp16", error="bad dot")
    assert failed.problems() == ["does not compile: bad dot"]


def test_fp32_may_spill():
    """fp32 is the slow, exact path: a few spilled registers cost less than smaller tiles."""
    assert build(dtype="fp32", stack=8).problems() == []


# TTIR of the old kv_compact kernel for sm_90 (before a2f76ea), trimmed: b * s_kb in i32
OLD_COMPACT_TTIR = """
  tt.func public @_compact_kv_kernel(%K: !tt.ptr<bf16> {tt.divisibility = 16 : i32}, %n: i32, %dst_start: i32, %s_kb: i32 {tt.divisibility = 16 : i32}, %s_kh: i32 {tt.divisibility = 16 : i32}, %s_ks: i32 {tt.divisibility = 16 : i32}) attributes {noinline = false} {
    %b = tt.get_program_id x : i32 loc(#loc43)
    %h = tt.get_program_id y : i32 loc(#loc44)
    %d = tt.make_range {end = 128 : i32, start = 0 : i32} : tensor<128xi32> loc(#loc45)
    %k_row = arith.muli %b, %s_kb : i32 loc(#loc46)
    %k_row_0 = tt.addptr %K, %k_row : !tt.ptr<bf16>, i32 loc(#loc47)
    %k_row_1 = arith.muli %h, %s_kh : i32 loc(#loc48)
    %k_row_2 = tt.addptr %k_row_0, %k_row_1 : !tt.ptr<bf16>, i32 loc(#loc47)
    %dst = arith.addi %dst_start, %n : i32 loc(#loc49)
    %off = arith.muli %dst, %s_ks : i32 loc(#loc50)
"""  # noqa: E501


def test_narrow_offsets_finds_the_old_compact_kv_products():
    """Breakage 1 of issue 41: `b * s_kb` wrapped past 2^31 with every layer stacked."""
    assert narrow_offsets(OLD_COMPACT_TTIR) == ["%k_row", "%k_row_1"]


def test_narrow_offsets_accepts_int64_program_ids_and_small_products():
    widened = OLD_COMPACT_TTIR.replace(
        "%k_row = arith.muli %b, %s_kb : i32",
        "%b64 = arith.extsi %b : i32 to i64 loc(#loc1)\n    %k_row = arith.muli %b64, %s_kb64 : i64",
    )
    # a slot index times a stride is no program id: it stays far below 2^31
    assert narrow_offsets(widened) == ["%k_row_1"]


def test_narrow_offsets_follows_values_derived_from_a_program_id():
    """`program_id(1) // H_KV`, then times a stride: the tree attention's old `b * s_kb`."""
    ttir = """
  tt.func public @_k(%K: !tt.ptr<bf16>, %s_kb: i32 {tt.divisibility = 16 : i32}, %H_KV: i32) {
    %0 = tt.get_program_id y : i32 loc(#loc1)
    %b = arith.divsi %0, %H_KV : i32 loc(#loc2)
    %k_base = arith.muli %b, %s_kb : i32 loc(#loc3)
"""
    assert narrow_offsets(ttir) == ["%k_base"]
