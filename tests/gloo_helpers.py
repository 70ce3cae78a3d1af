"""Helpers for the tests that launch two processes over gloo (and for their scripts)."""

from __future__ import annotations

import os
import time


def gloo_threads(grace_s: float = 5.0) -> list[str]:
    """This process's gloo threads (Linux) still there after up to `grace_s` seconds: none
    may outlive a freed process group, since one that lives into interpreter exit can abort
    it when it needs the GIL.

    The grace is for threads already joined: `pthread_join` returns once the kernel clears
    the exiting thread's id, before the kernel drops its /proc entry, and on a loaded
    machine that entry lingered past the join (1 fresh-clone CI run in many). A thread
    that outlives its group stays for the interpreter's life; this one goes in moments.
    """
    deadline = time.monotonic() + grace_s
    while (names := _gloo_thread_names()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return names


def _gloo_thread_names() -> list[str]:
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return [n for n in names if "gloo" in n]


def fsdp_on_cpu() -> None:
    """Let accelerate run an FSDP launch on CPU processes over gloo, as it would on GPUs.

    accelerate turns an FSDP launch without GPUs into DDP (it picks FSDP only for GPU-like
    devices), while FSDP2 itself shards over gloo. From here on, an `Accelerator` given an
    FSDP plugin (ACCELERATE_USE_FSDP, FSDP_VERSION) in a CPU process group runs FSDP: its
    own `prepare` calls `fully_shard` and remaps the optimizer, as on GPUs.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def with_fsdp(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = with_fsdp


def fsdp_launch_env(**fsdp_config: object) -> dict[str, str]:
    """The variables `accelerate launch --config_file recipes/accelerate-fsdp.yaml` exports
    (its fsdp_config keys as FSDP_* next to ACCELERATE_USE_FSDP), `fsdp_config` replacing
    keys of the file, e.g. a `fsdp_min_num_params` small enough to wrap a tiny draft's layers."""
    from pathlib import Path

    import yaml

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "accelerate-fsdp.yaml"
    config = yaml.safe_load(recipe.read_text())["fsdp_config"] | fsdp_config
    env = {k.upper(): str(v).lower() if isinstance(v, bool) else str(v) for k, v in config.items()}
    return {"ACCELERATE_USE_FSDP": "true", **env}


def leave_fsdp_group(group: bool = True) -> None:
    """End a two-process FSDP2 script once every check has passed.

    FSDP2's functional collectives keep the group referenced in torch 2.13, so its gloo
    threads outlive `destroy_process_group`; at interpreter exit a worker that needs the
    GIL aborts the process ("terminate called without an active exception", 1 run in
    many on a loaded machine). So leave without that exit."""
    import sys

    import torch.distributed as dist

    if group:
        dist.barrier()  # every rank is done with the group
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
