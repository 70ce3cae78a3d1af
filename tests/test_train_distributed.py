"""Two CPU processes (gloo) started by `accelerate launch` follow the one-process run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagletools.engines.server import free_port

SCRIPT = textwrap.dedent(
    """
    import faulthandler, sys
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with every thread's stack
    sys.path.insert(0, {tests!r})
    from gloo_helpers import gloo_threads
    from test_train import random_dataset, tiny_config, tiny_target
    from eagletools.train.trainer import train

    out, batch_size, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    config = tiny_config(f"training.batch_size={{batch_size}}", "training.max_steps=null", stop,
                         "training.grad_accum=2", "training.eval_every=5")
    train(config, out, target=tiny_target(), dataset=random_dataset())
    left = gloo_threads()
    assert not left, left  # train() joined its process group's threads
    """
)


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# a token budget is counted over all ranks, so both runs stop at the same step (~190
# tokens a global batch of 8 random samples: the budget ends the run at step 3-4)
@pytest.mark.slow
@pytest.mark.parametrize("stop", ["training.max_steps=5", "training.max_tokens=600"])
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, stop):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    one = subprocess.run([sys.executable, str(script), str(tmp_path / "one"), "4", stop],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "--num_cpu_threads_per_process", "1",
        str(script), str(tmp_path / "two"), "2", stop,
    ]  # fmt: skip
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = log(tmp_path / "one"), log(tmp_path / "two")
    assert len(a) == len(b) >= 2, (a, b)
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-4, (a, b)
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-9), (a, b)  # one schedule
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert abs(m1["loss"] - m2["loss"]) <= 1e-4
    for key in ("exact_acceptance_length", "exact_acceptance_length_lo"):  # per-sample rows
        assert abs(m1[key] - m2[key]) <= 1e-6, key
    assert m1["trained_tokens"] == m2["trained_tokens"]
    if "max_steps" in stop:
        assert len(a) == 5
    else:
        assert m1["trained_tokens"] >= 600
