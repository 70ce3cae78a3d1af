"""Time each tree-decoder Triton kernel against its PyTorch reference on a GPU.

For every kernel and a few realistic shapes (Llama-3-8B: 32 query heads, 8 KV
heads, head_dim 128; draft vocab 32k, target vocab 128k), prints the median
time of the Triton kernel and of the reference (`triton.testing.do_bench`,
both on the GPU), and the memory-bandwidth floor: the bytes the kernel must
move over this GPU's measured copy bandwidth.

    python benchmarks/kernel_bench.py            # the table (needs CUDA)
    python benchmarks/kernel_bench.py --check    # the kernel tests first (compiled on a
                                            # GPU, in the Triton interpreter on CPU)
    python benchmarks/kernel_bench.py --compile-only [--arch 80 90 120]
        # no GPU needed: every kernel compiled for each sm_<arch> at 8B-70B shapes
        # (eagletools.kernels.aot); reports shared memory, registers and spills, and
        # fails past the arch's limits or on a 32-bit program-id x stride offset
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagletools.kernels import aot
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
    parser.add_argument(
        "--compile-only", action="store_true", help="compile for --arch, no GPU (kernels.aot)"
    )
    parser.add_argument(
        "--arch", nargs="+", default=["80", "90", "120"], help="with --compile-only"
    )
    args = parser.parse_args()
    if args.compile_only:
        return aot.main(["--arch", *args.arch])
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
