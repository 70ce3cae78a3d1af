"""Time each tree-decoder Triton kernel against its PyTorch reference on a GPU.

For every kernel and a few realistic shapes (Llama-3-8B: 32 query heads, 8 KV
heads, head_dim 128; draft vocab 32k, target vocab 128k), prints the median
time of the Triton kernel and of the reference (`triton.testing.do_bench`,
both on the GPU), and the memory-bandwidth floor: the bytes the kernel must
move over this GPU's measured copy bandwidth.

    python benchmarks/kernel_bench.py            # the table (needs CUDA)
    python benchmarks/kernel_bench.py --check    # the kernel tests first (compiled on a
                                            # GPU, in the Triton interpreter on CPU)
    python benchmarks/kernel_bench.py --compile-only [--arch 90]
        # no GPU needed: compile every kernel for sm_<arch> at the table's shapes with
        # Triton's bundled ptxas; reports registers, spills and shared memory, and fails
        # past the arch's shared memory or on a 32-bit program-id x stride offset
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagletools.kernels import attention, draft_topk, greedy_verify, kv_compact, sampling_verify
from eagletools.kernels.attention import tree_attention_reference, tree_attention_triton
from eagletools.kernels.draft_topk import topk_d2t_reference, topk_d2t_triton
from eagletools.kernels.greedy_verify import verify_greedy_reference, verify_greedy_triton
from eagletools.kernels.kv_compact import compact_kv_reference, compact_kv_triton
from eagletools.kernels.sampling_verify import verify_sampling_reference, verify_sampling_triton

TESTS = Path(__file__).resolve().parent.parent / "tests"
HQ, HKV, HEAD_DIM = 32, 8, 128  # Llama-3-8B
DRAFT_VOCAB, TARGET_VOCAB = 32_000, 128_256


@dataclass
class Case:
    shape: str
    args: tuple
    bytes_moved: int  # what the kernel must read and write at the least


def random_tree(b: int, n: int, device) -> torch.Tensor:
    """`parents [B,N]`: each node hangs under a random earlier node."""
    parents = (torch.rand(b, n, device=device) * torch.arange(n, device=device)).long()
    parents[:, 0] = -1
    return parents


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for j in range(1, n):
        mask[j] |= mask[parents[j]]
    return mask


def attention_cases(device) -> list[Case]:
    cases = []
    for b, n, prefix in [(1, 16, 1), (1, 64, 1024), (1, 64, 8192), (1, 128, 8192), (8, 64, 2048)]:
        dt = torch.bfloat16
        q = torch.randn(b, HQ, n, HEAD_DIM, device=device, dtype=dt)
        k = torch.randn(b, HKV, prefix + n, HEAD_DIM, device=device, dtype=dt)
        v = torch.randn_like(k)
        mask = ancestor_mask(random_tree(1, n, device)[0])
        args = (q, k, v, prefix, mask, HEAD_DIM**-0.5)
        moved = 2 * q.nbytes + k.nbytes + v.nbytes + mask.nbytes
        shape = f"B={b} N={n} prefix={prefix} bf16"
        cases.append(Case(shape, args, moved))
    return cases


def greedy_cases(device) -> list[Case]:
    cases = []
    for b, n in [(1, 64), (64, 64)]:
        parents = random_tree(b, n, device)
        tokens = torch.randint(0, 4, (b, n), device=device)
        argmax = torch.randint(0, 4, (b, n), device=device)  # small vocab: long paths
        args = (tokens, parents, argmax)
        moved = 4 * tokens.nbytes + 2 * b * 8
        cases.append(Case(f"B={b} N={n}", args, moved))
    return cases


def topk_cases(device) -> list[Case]:
    cases = []
    selected = torch.randperm(TARGET_VOCAB, device=device)[:DRAFT_VOCAB].sort().values
    d2t = selected - torch.arange(DRAFT_VOCAB, device=device)
    for m in (1, 64):
        for k in (1, 8):
            logits = torch.randn(m, DRAFT_VOCAB, device=device, dtype=torch.bfloat16)
            args = (logits, d2t, k)
            moved = logits.nbytes + m * k * (8 + 8 + 4)
            cases.append(Case(f"M={m} Vd={DRAFT_VOCAB} k={k} bf16", args, moved))
    return cases


def compact_cases(device) -> list[Case]:
    cases = []
    prefix, tree, n = 2048, 64, 8
    for b in (1, 64):
        k = torch.randn(b, HKV, prefix + tree, HEAD_DIM, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        src = prefix + torch.rand(b, tree, device=device).argsort(1)[:, :n].sort(1).values
        args = (k, v, src, prefix)
        moved = 2 * 2 * b * HKV * n * HEAD_DIM * k.element_size() + src.nbytes
        cases.append(Case(f"B={b} n={n} of {tree} (one layer) bf16", args, moved))
    return cases


def sampling_cases(device) -> list[Case]:
    cases = []
    for b, n in [(1, 64), (16, 64)]:
        parents = random_tree(b, n, device)
        tokens = torch.randint(0, TARGET_VOCAB, (b, n), device=device)
        logits = torch.randn(b, n, TARGET_VOCAB, device=device)
        for j in range(n):  # drafted children carry real mass, so paths get long
            boost = torch.zeros(b, TARGET_VOCAB, device=device)
            logits[:, j] += boost.scatter_add_(1, tokens, (parents == j).float() * 14)
        probs = logits.softmax(-1)
        del logits
        uniforms = torch.rand(b, n + 1, device=device)
        args = (tokens, parents, probs, uniforms)
        accepted = verify_sampling_reference(*args)[1]
        # at least each visited node's row once
        moved = int((accepted + 1).sum()) * TARGET_VOCAB * probs.element_size()
        shape = f"B={b} N={n} V={TARGET_VOCAB} fp32, mean accepted {accepted.float().mean():.1f}"
        cases.append(Case(shape, args, moved))
    return cases


def median_us(fn: Callable, args: tuple) -> float:
    import triton.testing

    return triton.testing.do_bench(lambda: fn(*args), return_mode="median") * 1e3


def copy_bandwidth(device) -> float:
    """Bytes per second of a plain 1 GiB device-to-device copy."""
    import triton.testing

    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.nbytes / (ms * 1e-3)


KERNELS = {
    "tree_attention": (tree_attention_triton, tree_attention_reference, attention_cases),
    "verify_greedy": (verify_greedy_triton, verify_greedy_reference, greedy_cases),
    "topk_d2t": (topk_d2t_triton, topk_d2t_reference, topk_cases),
    "compact_kv": (compact_kv_triton, compact_kv_reference, compact_cases),
    "verify_sampling": (verify_sampling_triton, verify_sampling_reference, sampling_cases),
}


def meta_launches() -> list[tuple[str, object, Callable[[], object]]]:
    """`(name, module, launch)`: the table's shapes as meta tensors."""
    meta = dict(device="meta")
    bf16 = dict(device="meta", dtype=torch.bfloat16)
    launches = []
    for n, prefix, d, dt, splits in [
        (16, 1, 128, torch.bfloat16, 1),
        (128, 8192, 128, torch.bfloat16, 1),
        (64, 8192, 128, torch.bfloat16, 8),  # keys split, then merged
        (7, 13, 24, torch.float32, 1),
        (16, 100, 128, torch.float32, 1),  # fp32 at 8B head_dim: the largest tiles
        (64, 100, 64, torch.float16, 1),
    ]:
        q = torch.empty(1, HQ, n, d, device="meta", dtype=dt)
        kv = torch.empty(1, HKV, prefix + n, d, device="meta", dtype=dt)
        mask = torch.empty(n, n, device="meta", dtype=torch.bool)
        length = prefix if n != 128 else torch.tensor(prefix, **meta)
        launch = (q, kv, kv, length, mask, d**-0.5, None, splits)
        launches.append((f"tree_attention N={n} D={d} {dt} splits={splits}", attention,
                         lambda a=launch: tree_attention_triton(*a)))  # fmt: skip
    trees = torch.empty(64, 64, dtype=torch.long, **meta)
    launches.append(("verify_greedy N=64", greedy_verify,
                     lambda: verify_greedy_triton(trees, trees, trees)))  # fmt: skip
    for m, k in [(1, 1), (64, 8)]:
        logits = torch.empty(m, DRAFT_VOCAB, **bf16)
        d2t = torch.empty(DRAFT_VOCAB, dtype=torch.long, **meta)
        launches.append((f"topk_d2t M={m} k={k}", draft_topk,
                         lambda a=(logits, d2t, k): topk_d2t_triton(*a)))  # fmt: skip
    cache = torch.empty(64, HKV, 4096, HEAD_DIM, **bf16)
    src = torch.empty(64, 8, dtype=torch.long, **meta)
    launches.append(("compact_kv", kv_compact,
                     lambda: compact_kv_triton(cache, cache, src, 2048)))  # fmt: skip
    probs = torch.empty(16, 64, TARGET_VOCAB, **meta)
    uniforms = torch.empty(16, 65, **meta)
    launches.append(("verify_sampling N=64", sampling_verify,
                     lambda: verify_sampling_triton(trees[:16], trees[:16], probs, uniforms)))  # fmt: skip
    return launches


def recorded_launches(module, launch: Callable[[], object]) -> list[tuple[str, tuple, dict]]:
    """`(jit attribute, args, kwargs)` of every kernel launch `launch` makes."""
    jits = {a: getattr(module, a) for a in dir(module) if a.endswith("_jit")}
    calls = []
    for attr in jits:
        setattr(module, attr, lambda attr=attr: _Recorder(attr, calls))
    try:
        launch()
    finally:
        for attr, jit in jits.items():
            setattr(module, attr, jit)
    return [(attr, args, kwargs, jits[attr]()) for attr, args, kwargs in calls]


# dynamic shared memory a block may opt into, bytes (CUDA programming guide, per arch)
SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}


def compile_only(arch: int) -> int:
    """Compile each kernel as its wrapper would launch it, for `sm_<arch>`, no GPU needed.

    Catches what the interpreter cannot (loop-carried types, unsupported ops,
    register spills). Arguments are specialised as Triton does at launch (ints
    equal to 1 become constants, pointers and multiples of 16 16-aligned).
    """
    import tempfile

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("--compile-only compiles for a GPU: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}  # fmt: skip
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    failed = 0
    for name, module, launch in meta_launches():
        for attr, args, kwargs, jit in recorded_launches(module, launch):
            label = f"{name} {attr.strip('_').removesuffix('_jit')}"
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            signature, constexprs, attrs = {}, dict(kwargs), {}
            params = [p for p in jit.arg_names if p not in kwargs]
            for param, value in zip(params, args, strict=True):
                if isinstance(value, torch.Tensor):
                    signature[param] = "*" + types[value.dtype]
                    attrs[(jit.arg_names.index(param),)] = [["tt.divisibility", 16]]
                elif isinstance(value, float):
                    signature[param] = "fp32"
                elif value == 1:
                    signature[param], constexprs[param] = "constexpr", 1
                else:
                    signature[param] = "i32" if abs(value) < 2**31 else "i64"
                    if value % 16 == 0:
                        attrs[(jit.arg_names.index(param),)] = [["tt.divisibility", 16]]
            signature.update({k: "constexpr" for k in kwargs})
            signature = {p: signature[p] for p in jit.arg_names}
            try:
                compiled = triton.compile(
                    ASTSource(jit, signature, constexprs=constexprs, attrs=attrs),
                    target=GPUTarget("cuda", arch, 32),
                    options=options,
                )
            except Exception as err:  # report every kernel, then fail
                print(f"{label:60} FAILED: {err}")
                failed += 1
                continue
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run(
                    [str(cuobjdump), "--dump-resource-usage", f.name],
                    capture_output=True,
                    text=True,
                ).stdout
            line = next((x.strip() for x in usage.splitlines() if "REG:" in x), "")
            spills = "  register spills" if "STACK:0 " not in line else ""
            narrow = narrow_offsets(compiled.asm["ttir"])
            shared = compiled.metadata.shared
            if narrow or shared > SHARED_MEMORY[arch]:
                why = f"32-bit program-id x stride offsets: {narrow}" if narrow else ""
                why += f" shared memory {shared} B > {SHARED_MEMORY[arch]}" if not narrow else ""
                print(f"{label:60} FAILED: {why}")
                failed += 1
                continue
            print(f"{label:60} sm_{arch} ok  {line.split(' SHARED')[0]} SHARED:{shared}{spills}")
    return int(failed > 0)


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


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, attr: str, calls: list):
        self.attr, self.calls = attr, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.attr, args, kwargs))


def run_tests(device: str) -> int:
    env = dict(os.environ, EAGLETOOLS_KERNEL_TEST_DEVICE=device)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    files = [str(TESTS / "test_kernels.py"), str(TESTS / "test_kernels_triton.py")]
    print(f"kernel tests on {device}" + (" (Triton interpreter)" if device == "cpu" else ""))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *files], env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="run the kernel tests first")
    parser.add_argument(
        "--only", nargs="*", default=None, help="kernels to time (default: all five)"
    )
    parser.add_argument("--compile-only", action="store_true", help="compile for --arch, no GPU")
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args.arch)
    cuda = torch.cuda.is_available()
    if args.check:
        code = run_tests("cuda" if cuda else "cpu")
        if code or not cuda:
            return code
    if not cuda:
        print(
            "benchmarks/kernel_bench.py times Triton kernels on a CUDA GPU and none is available "
            "(torch.cuda.is_available() is False). On CPU, --check runs the kernel tests "
            "in the Triton interpreter.",
            file=sys.stderr,
        )
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    header = f"{'kernel':16} {'shape':52} {'triton us':>10} {'ref us':>10} {'ref/triton':>10}"
    print(header + f" {'floor us':>9} {'floor/triton':>12}")
    for name, (kernel, reference, make_cases) in KERNELS.items():
        if args.only and name not in args.only:
            continue
        for case in make_cases(device):
            t_triton, t_ref = median_us(kernel, case.args), median_us(reference, case.args)
            floor = case.bytes_moved / bandwidth * 1e6
            print(
                f"{name:16} {case.shape:52} {t_triton:>10.1f} {t_ref:>10.1f} "
                f"{t_ref / t_triton:>10.2f} {floor:>9.2f} {floor / t_triton:>12.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
