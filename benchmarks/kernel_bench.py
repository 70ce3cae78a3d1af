"""Time each tree-decoder Triton kernel against its PyTorch reference on a GPU.

For every kernel and a few realistic shapes (Llama-3.1-8B: 32 query heads, 8 KV
heads, head_dim 128; draft vocab 32k, target vocab 128k; the cases of
`eagletools.kernels.cases.llama_8b_sweep`, which the kernel tests draw too), prints the median
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
from pathlib import Path

import torch

from eagletools.kernels import aot
from eagletools.kernels.cases import copy_bandwidth, llama_8b_sweep, triton_and_reference

TESTS = Path(__file__).resolve().parent.parent / "tests"


def median_us(fn: Callable, args: tuple) -> float:
    import triton.testing

    return triton.testing.do_bench(lambda: fn(*args), return_mode="median") * 1e3


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
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    header = f"{'kernel':16} {'shape':52} {'triton us':>10} {'ref us':>10} {'ref/triton':>10}"
    print(header + f" {'floor us':>9} {'floor/triton':>12}")
    for case in llama_8b_sweep(device, args.only):
        kernel, reference = triton_and_reference(case.kernel)
        t_triton, t_ref = median_us(kernel, case.args), median_us(reference, case.args)
        floor = case.bytes_moved / bandwidth * 1e6
        print(
            f"{case.kernel:16} {case.shape:52} {t_triton:>10.1f} {t_ref:>10.1f} "
            f"{t_ref / t_triton:>10.2f} {floor:>9.2f} {floor / t_triton:>12.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
