"""Compile every kernel for real GPU archs on a machine without a GPU (docs/design.md 3.7).

Triton's driver is swapped for one that reports an arch as the current device;
each project wrapper (`*_triton`) then runs on `device="meta"` tensors and its
launches go through the kernel's own `run(..., warmup=True)`, so arguments are
bound and specialised as a real launch binds them (ints equal to 1 become
constants, multiples of 16 are marked aligned) and tiles are chosen for that
arch. ptxas from the `triton` wheel builds the cubin. Each build is checked
against the arch's limits: shared memory, grid, register spills, and 32-bit
program-id x stride offsets in the TTIR.

    python -m eagletools.kernels.aot --arch 80 90 120   # the matrix; exit 1 on a problem
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from eagletools.kernels import attention, draft_topk, greedy_verify, kv_compact, sampling_verify
from eagletools.kernels.cases import DRAFT_VOCAB, SHAPES, Shape
from eagletools.kernels.dispatch import interpreting

# dynamic shared memory a block may opt into, bytes (CUDA programming guide, per arch)
SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}
MAX_GRID = (2**31 - 1, 65_535, 65_535)
KERNEL_MODULES = (attention, draft_topk, greedy_verify, kv_compact, sampling_verify)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_FREE = "-"  # the verifications: int64 trees and fp32 probabilities whatever the model
TOPK = 4
CACHE_SLOTS = 65_536  # with every layer stacked, the offsets pass 2^31
SPLITS = 8


@dataclass(frozen=True)
class Build:
    """One compiled kernel variant and what it needs on the GPU."""

    label: str
    kernel: str
    arch: int
    dtype: str
    grid: tuple[int, ...] = ()
    shared: int = 0  # bytes of shared memory a block
    registers: int = 0  # a thread
    stack: int = 0  # bytes of local memory a thread: register spills (the kernels hold no arrays)
    narrow: tuple[str, ...] = ()  # TTIR values: 32-bit program-id x stride products
    error: str = ""  # the compiler's, when it failed (`kernel` is then the wrapper)

    def problems(self) -> list[str]:
        """What would fail or run slowly on the GPU; fp32, the exact slow path, may spill."""
        if self.error:
            return [f"does not compile: {self.error}"]
        found = []
        if self.shared > SHARED_MEMORY[self.arch]:
            found.append(f"shared memory {self.shared:,} B > {SHARED_MEMORY[self.arch]:,} B")
        if self.stack and self.dtype != "fp32":
            found.append(f"{self.stack} B of register spills")
        grid = self.grid + (1,) * (3 - len(self.grid))
        if any(g > limit for g, limit in zip(grid, MAX_GRID, strict=True)):
            found.append(f"grid {self.grid} past {MAX_GRID}")
        if self.narrow:
            found.append(f"32-bit program-id x stride offsets {', '.join(self.narrow)}")
        return found


class _ArchDriver:
    """Triton's active driver for a device that is an arch: compiles, never launches."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return self.target.arch  # Triton keeps its kernel cache per device: one per arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[None]:
    """Triton compiles for `sm_<arch>` inside; no GPU is touched."""
    from triton.runtime import driver

    previous = driver._active  # None without a GPU, where `driver.active` would raise
    driver.set_active(_ArchDriver(arch))
    try:
        yield
    finally:
        driver._active = previous


class _Warmup:
    """Stands in for a `lazy_jit` kernel: `kernel()[grid](...)` compiles it, records the build."""

    def __init__(self, jit, builds: list):
        self.jit, self.builds = jit, builds

    def __call__(self) -> _Warmup:
        return self

    def __getitem__(self, grid: tuple):
        def run(*args, **kwargs):
            self.builds.append((self.jit.run(*args, grid=grid, warmup=True, **kwargs), grid))

        return run


def compiled_launches(launch: Callable[[], object]) -> list[tuple[object, tuple]]:
    """`(compiled kernel, grid)` of each launch `launch` makes; call inside `compiling_for`."""
    builds: list = []
    saved = {}
    for module in KERNEL_MODULES:
        for attr in [a for a in vars(module) if a.startswith("_") and a.endswith("_jit")]:
            saved[module, attr] = jit = getattr(module, attr)
            setattr(module, attr, _Warmup(jit(), builds))
    try:
        launch()
    finally:
        for (module, attr), jit in saved.items():
            setattr(module, attr, jit)
    return builds


@functools.cache
def resource_usage(cubin: bytes) -> tuple[int, int]:
    """`(registers, stack bytes)` a thread, from the cubin (cuobjdump from the triton wheel)."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{usage}")
    return int(found[1]), int(found[2])


_SSA = re.compile(r"%[\w.]+")


def narrow_offsets(ttir: str) -> list[str]:
    """The scalar i32 products of a program-id-derived value and a stride (`s_*` argument).

    Such a product is a base offset (`b * stride_b`): with every layer's cache
    stacked it passes 2^31 at 8B-70B sizes, so it must be computed in int64.
    Values are traced through the TTIR's SSA names; a `.to(tl.int64)` (extsi)
    ends the trace.
    """
    body = ttir.partition("tt.func public")[2]
    strides = set(re.findall(r"(%s_\w+): i32", body.split("\n", 1)[0]))  # s_* by convention
    from_pid: set[str] = set()
    from_stride = set(strides)
    narrow = []
    for line in body.splitlines():
        m = re.match(r"\s*(%[\w.]+) = (\S+) (.*?) : (\S+)", line)
        if not m:
            continue
        name, op, operands, result = m.groups()
        used = set(_SSA.findall(operands))
        if op == "tt.get_program_id":
            from_pid.add(name)
        elif op != "arith.extsi" and result == "i32":
            if used & from_pid:
                if op == "arith.muli" and used & from_stride:
                    narrow.append(name)
                from_pid.add(name)
            elif used & from_stride:
                from_stride.add(name)
    return narrow


def launches(shape: Shape, dtype: str) -> list[tuple[str, Callable[[], object]]]:
    """`(label, launch)`: each wrapper as the decoder calls it at `shape`'s widths.

    Tree attention four ways: a host or a device prefix length (CUDA graphs,
    `PREFIX_IN_MEMORY`), each whole or with the keys split over programs (then
    merged). Attention reads one layer's view of the stacked cache, compaction
    moves every layer at once. `DTYPE_FREE`: the verifications.
    """
    meta = dict(device="meta")
    n = shape.tree_nodes
    tree = torch.empty(1, n, dtype=torch.long, **meta)
    if dtype == DTYPE_FREE:
        probs = torch.empty(1, n, shape.vocab, **meta)
        uniforms = torch.empty(1, n + 1, **meta)
        return [
            ("verify_greedy", lambda: greedy_verify.verify_greedy_triton(tree, tree, tree)),
            ("verify_sampling", lambda: sampling_verify.verify_sampling_triton(
                tree, tree, probs, uniforms)),
        ]  # fmt: skip
    dt = DTYPES[dtype]
    slots = (shape.layers, 1, shape.kv_heads, CACHE_SLOTS, shape.head_dim)
    cache = torch.empty(slots, dtype=dt, **meta)
    q = torch.empty(1, shape.q_heads, n, shape.head_dim, dtype=dt, **meta)
    mask = torch.empty(n, n, dtype=torch.bool, **meta)
    prefix = 30_003  # a host length, not a multiple of 16 (as most are)
    on_device = torch.empty((), dtype=torch.long, **meta)
    draft_logits = torch.empty(TOPK, DRAFT_VOCAB, dtype=dt, **meta)
    target_logits = torch.empty(TOPK, shape.vocab, dtype=dt, **meta)  # a draft without d2t
    d2t = torch.empty(DRAFT_VOCAB, dtype=torch.long, **meta)
    src = torch.empty(1, n, dtype=torch.long, **meta)

    def attend(length, splits):
        return lambda: attention.tree_attention_triton(
            q, cache[0], cache[0], length, mask, shape.head_dim**-0.5, None, splits
        )

    return [
        ("tree_attention", attend(prefix, 1)),
        ("tree_attention graph", attend(on_device, 1)),
        ("tree_attention split", attend(prefix, SPLITS)),
        ("tree_attention graph split", attend(on_device, SPLITS)),
        ("compact_kv", lambda: kv_compact.compact_kv_triton(cache, cache, src, prefix)),
        ("topk_d2t root", lambda: draft_topk.topk_d2t_triton(draft_logits[:1], d2t, TOPK)),
        ("topk_d2t", lambda: draft_topk.topk_d2t_triton(draft_logits, d2t, TOPK)),
        ("topk_d2t no d2t", lambda: draft_topk.topk_d2t_triton(target_logits, None, TOPK)),
    ]


def check(kernel, grid: tuple, label: str, arch: int, dtype: str) -> Build:
    """What `kernel` (compiled for `sm_<arch>`, launched on `grid`) needs on the GPU."""
    registers, stack = resource_usage(kernel.asm["cubin"])
    return Build(
        label=label, kernel=kernel.name, arch=arch, dtype=dtype, grid=tuple(grid),
        shared=kernel.metadata.shared, registers=registers, stack=stack,
        narrow=tuple(narrow_offsets(kernel.asm["ttir"])),
    )  # fmt: skip


def compile_unit(arch: int, dtype: str) -> list[Build]:
    """Every launch at `dtype` for `sm_<arch>`, over `SHAPES`. A specialisation Triton has
    compiled before comes from its in-process cache and is checked once a grid."""
    builds, seen = [], set()
    with compiling_for(arch):
        for shape in SHAPES:
            for label, launch in launches(shape, dtype):
                label = f"{label} {shape.name}"
                try:
                    compiled = compiled_launches(launch)
                except Exception as err:  # report every launch that fails, then fail
                    error = str(err).strip().splitlines()[-1]
                    builds.append(Build(label, label.split()[0], arch, dtype, error=error))
                    continue
                for kernel, grid in compiled:
                    if (id(kernel), tuple(grid)) not in seen:
                        seen.add((id(kernel), tuple(grid)))
                        builds.append(check(kernel, grid, label, arch, dtype))
    return builds


def compile_matrix(archs: list[int], dtypes: list[str], workers: int = 2) -> list[Build]:
    """`compile_unit` for each arch x dtype (and the dtype-free kernels), over `workers`
    processes: ptxas and Triton's passes are single-threaded."""
    units = [(arch, dtype) for arch in archs for dtype in [*dtypes, DTYPE_FREE]]
    if workers == 1:
        return [build for unit in units for build in compile_unit(*unit)]
    context = multiprocessing.get_context("spawn")  # a fresh Triton, never the interpreter's
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        per_unit = pool.map(compile_unit, *zip(*units, strict=True))
        return [build for builds in per_unit for build in builds]


def summary(builds: list[Build]) -> list[str]:
    """A line a kernel and arch: its largest shared memory, registers and spills."""
    rows: dict[tuple[str, int], list[Build]] = {}
    for build in builds:
        rows.setdefault((build.kernel, build.arch), []).append(build)
    lines = [
        f"{'kernel':24} {'arch':>6} {'builds':>6} {'shared B':>9} {'regs':>5}"
        f" {'spill B':>8} {'spill B fp32':>12}"
    ]
    for (kernel, arch), group in sorted(rows.items()):
        half = max((b.stack for b in group if b.dtype != "fp32"), default=0)
        wide = max((b.stack for b in group if b.dtype == "fp32"), default=0)
        lines.append(
            f"{kernel:24} {'sm_' + str(arch):>6} {len(group):>6} "
            f"{max(b.shared for b in group):>9,} {max(b.registers for b in group):>5} "
            f"{half:>8} {wide:>12}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90, 120])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--workers", type=int, default=2, help="compiling processes")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line a build")
    args = parser.parse_args(argv)
    if interpreting():
        parser.error("it compiles for GPUs: unset TRITON_INTERPRET (Triton reads it at import)")
    unknown = sorted(set(args.arch) - set(SHARED_MEMORY))
    if unknown:
        parser.error(f"--arch {unknown}: known archs are {sorted(SHARED_MEMORY)}")
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    builds = compile_matrix(args.arch, args.dtype, args.workers)
    failed = 0
    for build in builds:
        problems = build.problems()
        failed += bool(problems)
        if problems or args.verbose:
            verdict = "FAILED: " + "; ".join(problems) if problems else "ok"
            print(
                f"sm_{build.arch} {build.dtype:4} {build.label:40} {build.kernel:24} "
                f"grid={build.grid} shared={build.shared} regs={build.registers} "
                f"stack={build.stack} {verdict}"
            )
    print("\n".join(summary(builds)))
    print(f"{len(builds)} builds, {failed} failed")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
