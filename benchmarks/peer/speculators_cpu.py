"""speculators 0.9.0's own `speculators train`, run on a CPU (in .venv-speculators).

Called by benchmarks/peer/speculators_train.py; the rest of argv goes to
`speculators.train.cli.main`. Four device lines of its trainer assume an
accelerator, and torch's Muon assumes bf16 is fast; each is pointed at the CPU
here and nothing else is changed (the model, loss, optimizer's update rule,
schedule and data path are the package's):

- trainer.py:348 `self.model.to(self.local_rank)` with `local_rank = 0` means
  `cuda:0` ("RuntimeError: Cannot access accelerator device when none is
  available"); batches go `.to(self.local_rank)` too. `get_local_rank` returns
  the CPU device instead.
- `Trainer.__init__`: `device_type = acc.type if acc is not None else "cuda"`,
  so autocast would be asked for CUDA and disabled; it is "cpu", so each step
  autocasts to `--hidden-states-dtype` (bf16) on the CPU as on a GPU.
- trainer.py:80 `_StepTimer.mark` calls `torch.accelerator.synchronize()` on
  every logged step, which raises the same error; CPU work is synchronous, so
  it is a no-op here.
- `conditional_torch_compile` compiles the forward only under CUDA: left as is.
- torch's Muon (`torch/optim/_muon.py`, which `--optimizer muon` steps) runs its
  Newton-Schulz iterations in bf16 whatever the parameters' dtype. A CPU without
  bf16 dot products emulates those products: on a 2-core AVX2 EPYC they took 80% of
  a step (py-spy, 2026-12-04; 26 s a step of ~830 tokens). With
  `--hidden-states-dtype=float32` (what the caller passes where our trainer runs
  fp32) the same iteration, same coefficients, runs in fp32, as ours does there.

Two defaults cannot run on a CPU and are set by the caller: the flex attention
("NotImplementedError: FlexAttention does not support backward on CPU",
torch/nn/attention/flex_attention.py:2082) and the fused loss ("RuntimeError:
Fused losses require Triton; use --loss-implementation eager", losses/utils.py:120).

Before training, `token_freq.pt` is counted by the package's own
`save_token_frequency_distribution` over the training rows (their split rule:
the first `int(rows * train_data_ratio)`), so their trainer builds d2t/t2d.
With `--max-steps`, `--epochs` is set to the epochs those steps need (the loop
would otherwise run one more step per remaining epoch). Every run writes `peer_stats.json` beside its checkpoints: steps, tokens
trained (padding excluded), wall and CPU seconds of the training loop.

Two flags are ours, taken out before the rest reaches the package:
`--max-tokens=N` sets `--max-steps` to the packs N tokens fill (their sampler's
packs of the training split, on average), and `--snapshots=K` saves K checkpoints
through the package's own checkpointer, at steps S/K, 2S/K, ... S, into
`SAVE/snapshot-<step>/` (their numbered folders are overwritten each epoch),
each listed with its step and tokens in peer_stats.json.

    .venv-speculators/bin/python benchmarks/peer/speculators_cpu.py --data-path D ...
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def fp32_newton_schulz(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float):
    """torch's Muon orthogonalisation (a, b, c quintic on the wide orientation, the
    input scaled to spectral norm <= 1) computed in fp32 instead of bf16. It repeats
    eagletools' `train/muon.py` loop on purpose: this runs in .venv-speculators, which
    does not install eagletools, and it takes torch's coefficients as given."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def on_cpu(cfg: dict) -> None:
    """Point the trainer's device lines at the CPU (see the module docstring)."""
    from speculators.train import trainer
    from torch.optim import _muon

    if cfg["hidden_states_dtype"] == "float32":
        _muon._zeropower_via_newtonschulz = fp32_newton_schulz

    cpu = torch.device("cpu")
    trainer.get_local_rank = lambda: cpu
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda device=None: None


def watch(snapshot_steps: set[int]) -> dict[str, list]:
    """Clock and CPU time at each training forward and optimizer step, and a checkpoint
    after each of `snapshot_steps` (the training itself is read only)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train import trainer

    log: dict[str, list] = {"forward": [], "step": [], "snapshots": []}
    forward, step = Eagle3DraftModel.forward, trainer.Trainer._optimizers_step

    def counted(self, *args, **kwargs):
        if self.training:
            tokens = int((kwargs["document_ids"] != -1).sum())
            log["forward"].append((time.perf_counter(), time.process_time(), tokens))
        return forward(self, *args, **kwargs)

    def timed(self):
        step(self)
        log["step"].append((time.perf_counter(), time.process_time()))
        done = len(log["step"])
        if done in snapshot_steps:
            name = f"snapshot-{done}"
            self.checkpointer.save_checkpoint(self.model, self.optimizers, name)
            tokens = sum(t for _, _, t in log["forward"][:done])
            log["snapshots"].append({"step": done, "tokens": tokens, "folder": name})

    Eagle3DraftModel.forward = counted
    trainer.Trainer._optimizers_step = timed
    return log


def flat(argv: list[str]) -> dict:
    from speculators.train.config import TrainConfig

    return TrainConfig.resolve(argv).flatten()


def count_tokens(cfg: dict) -> None:
    """The package's token counts over its training rows, for d2t/t2d."""
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    path = Path(cfg["data_path"]) / "token_freq.pt"
    if not path.exists():
        data = load_from_disk(cfg["data_path"])
        rows = int(len(data) * cfg["train_data_ratio"])
        save_token_frequency_distribution(data.select(range(rows)), path)


def epoch_packs(cfg: dict) -> tuple[int, int]:
    """(packed batches, tokens) of an epoch, from the package's own sampler over the
    train split."""
    from speculators.train.data import ArrowDataset
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    data = ArrowDataset(
        max_len=cfg["total_seq_len"],
        datapath=cfg["data_path"],
        on_missing="raise",
        train_ratio=cfg["train_data_ratio"],
        split="train",
    )
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=cfg["total_seq_len"], lengths=data.approx_lengths,
        num_replicas=1, rank=0, seed=cfg["seed"],
    )  # fmt: skip
    return len(sampler), int(sum(data.approx_lengths))


def stats(log: dict[str, list]) -> dict:
    """Steps, tokens and the loop's clock/CPU seconds, from the first forward on."""
    if not log["step"]:
        return {"steps": 0, "tokens": 0}
    (wall0, cpu0, _), (wall1, cpu1) = log["forward"][0], log["step"][-1]
    tokens = sum(t for _, _, t in log["forward"][: len(log["step"])])
    walls = [w for w, _ in log["step"]]
    return {
        "steps": len(log["step"]),
        "tokens": tokens,
        "train_wall_s": wall1 - wall0,
        "train_cpu_s": cpu1 - cpu0,
        "tokens_per_s": tokens / max(wall1 - wall0, 1e-9),
        "tokens_per_cpu_s": tokens / max(cpu1 - cpu0, 1e-9),
        # steady state: the first step warms up allocators and kernels
        "seconds_per_step": (walls[-1] - walls[0]) / max(1, len(walls) - 1),
    }


def ours(argv: list[str], flag: str) -> tuple[list[str], int | None]:
    """argv without `--flag=N`, and N (None when absent)."""
    given = [a for a in argv if a.startswith(f"{flag}=")]
    rest = [a for a in argv if not a.startswith(f"{flag}=")]
    return rest, int(given[-1].split("=", 1)[1]) if given else None


def main(argv: list[str]) -> None:
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    argv, max_tokens = ours(argv, "--max-tokens")
    argv, snapshots = ours(argv, "--snapshots")
    cfg = flat(argv)
    count_tokens(cfg)
    packs, tokens = epoch_packs(cfg)
    if max_tokens:
        cfg["max_steps"] = max(1, round(max_tokens * packs / tokens))
        argv += [f"--max-steps={cfg['max_steps']}"]
    if cfg["max_steps"] and not any(a.startswith("--epochs") for a in argv):
        argv += [f"--epochs={math.ceil(cfg['max_steps'] / packs)}"]
    steps = cfg["max_steps"] or 0
    on_cpu(cfg)
    log = watch(
        {round(k * steps / snapshots) for k in range(1, snapshots + 1)} if snapshots else set()
    )
    train(TrainConfig.resolve(argv))
    result = {**stats(log), "snapshots": log["snapshots"]}
    Path(cfg["save_path"], "peer_stats.json").write_text(json.dumps(result, indent=2))
    print(f"peer_stats {json.dumps(result)}")


if __name__ == "__main__":
    main(sys.argv[1:])
