"""benchmarks/gpu_check.py on CPU: its arguments, and a tiny run of every section.

The script is made to be run once on a lent GPU, where a typo costs the whole
loan; here it runs with tiny shapes (Triton kernels in the interpreter), so
each section's code path has run before it gets there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_script(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """In a fresh process: Triton must be imported after TRITON_INTERPRET is set."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("EAGLETOOLS_KERNELS", "TRITON_INTERPRET")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # 1 thread: 2 shared cores
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sections", ["env,bogus", "", "kernels,,"])
def test_bad_section_is_a_usage_error(sections, capsys):
    script = load_script()
    if sections == "kernels,,":  # empty items are ignored, not errors
        assert script.parse_sections(sections) == ["kernels"]
        return
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--sections", sections, "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown section" in err and "env,kernels,decode,train,fsdp" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script().main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_spent_budget_skips_sections_and_still_writes(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # main sets it for CPU runs
    code = load_script().main(["--device", "cpu", "--budget", "-1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in data["sections"].values()] == ["skipped"] * 5
    assert "budget" in data["sections"]["env"]["reason"]


def test_quick_cpu_run_of_every_section(tmp_path):
    done = run_script("--device", "cpu", "--quick", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = data["sections"]
    assert {n: s["status"] for n, s in sections.items()} == dict.fromkeys(
        ("env", "kernels", "decode", "train", "fsdp"), "ok"
    ), {n: s["reason"] for n, s in sections.items()}
    kernels = {r["kernel"] for r in sections["kernels"]["rows"]}
    assert kernels == {"tree_attention", "verify_greedy", "topk_d2t", "compact_kv",
                       "verify_sampling"}  # fmt: skip
    assert all(r["ok"] for r in sections["kernels"]["rows"])
    decode = sections["decode"]["rows"]
    assert len(decode) == 6  # plain and speculative in bf16 and fp32, two forwards
    assert decode[0]["same as plain"] is None and decode[3]["same as plain"] is True  # fp32
    assert [r["batch"] for r in sections["train"]["rows"]] == [1, 2]
    assert all(r["tok/s"] > 0 for r in sections["train"]["rows"])
    assert all(r["ok"] for r in sections["fsdp"]["rows"])
    md = (tmp_path / "gpu_check.md").read_text()
    for name in sections:
        assert f"## {name} (ok" in md
    assert "| tree_attention |" in md
    # every row is printed as it finishes, so a cut-short run still shows its progress
    assert done.stdout.count("-- ") >= 5 and "verify_sampling" in done.stdout


def test_a_kernel_that_writes_nothing_fails_its_row(tmp_path, monkeypatch):
    """Outputs are poisoned before the check, so a kernel that leaves them unwritten fails
    (here every Triton kernel is replaced by one that does nothing: no Triton runs)."""
    import time

    from eagletools.kernels import attention, draft_topk, greedy_verify, kv_compact, sampling_verify

    def writes_nothing(*args, out=None, **kwargs):
        return out

    for module, name in [
        (attention, "tree_attention_triton"), (greedy_verify, "verify_greedy_triton"),
        (draft_topk, "topk_d2t_triton"), (kv_compact, "compact_kv_triton"),
        (sampling_verify, "verify_sampling_triton"),
    ]:  # fmt: skip
        monkeypatch.setattr(module, name, writes_nothing)
    script = load_script()
    cpu = torch.device("cpu")
    ctx = script.Context(cpu, script.make_plan(cpu, quick=True), time.perf_counter() + 300)
    report = script.Report(tmp_path, meta={})
    report.begin("kernels")
    with pytest.raises(RuntimeError, match="disagrees with its reference"):
        script.section_kernels(ctx, report)
    rows = report.current.rows
    assert len(rows) == 6 and not any(r["ok"] for r in rows), rows
