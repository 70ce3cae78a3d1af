"""A draft sharded by FSDP2 on two CPU processes over gloo: checkpoints and clipping.

The checkpoint test drives `fully_shard` directly: the checkpoint functions the
trainer calls must write the unsharded tensors and bring a fresh sharded run back
onto the same step. The clipping test runs the Trainer through accelerate's own
FSDP2 `prepare`, which accelerate keeps for GPUs unless `fsdp_on_cpu` lets it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gloo_helpers import fsdp_launch_env

from eagletools.engines.server import free_port

SCRIPT = textwrap.dedent(
    """
    import faulthandler, os, sys
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with every thread's stack
    sys.path.insert(0, {tests!r})
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from test_train_ttt import batch, tiny_draft

    from eagletools.train import checkpoint as ckpt
    from eagletools.train.ttt import TTTModel

    dist.init_process_group("gloo")
    rank, root = dist.get_rank(), Path(sys.argv[1])
    mesh = init_device_mesh("cpu", (2,))

    def sharded(scramble=False):
        draft = tiny_draft()  # the embeddings stand for the target's: never saved, same here
        with torch.no_grad():
            for p in draft.parameters():
                if scramble and p.requires_grad:
                    p.normal_()  # all the trained weights must come from the checkpoint
        full = {{k: v.clone() for k, v in draft.state_dict().items()}}
        model = TTTModel(draft, steps=2, chunk=4)
        fully_shard(model, mesh=mesh)
        params = [p for p in draft.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(params, lr=1e-2), full

    def step(model, optimizer, seed):
        loss, _ = model(*batch(model.draft, seed=seed + rank))  # each rank its own data
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    model, optimizer, full = sharded()
    assert type(model.draft.fc.weight).__name__ == "DTensor"
    for s in range(2):
        step(model, optimizer, s)
    state = ckpt.full_state(model.draft, optimizer)
    if rank == 0:
        ckpt.save_checkpoint(root, 2, state, model.draft.config.to_dict(), {{"step": 2}}, 1)
    dist.barrier()
    saved = load_file(str(root / "step-00000002" / "model.safetensors"))
    for key, value in full.items():  # unsharded shapes, and training changed the weights
        if key != "embed_tokens.weight":
            assert saved[key].shape == value.shape, key
    assert not torch.equal(saved["fc.weight"], full["fc.weight"])
    expected = step(model, optimizer, 2)

    fresh, fresh_optimizer, _ = sharded(scramble=True)
    ckpt.load_checkpoint(root / "step-00000002", fresh.draft, fresh_optimizer)
    got = step(fresh, fresh_optimizer, 2)
    assert abs(float(got) - float(expected)) <= 1e-6, (float(got), float(expected))
    for a, b in zip(model.draft.parameters(), fresh.draft.parameters(), strict=True):
        assert torch.allclose(a.full_tensor(), b.full_tensor(), atol=1e-6)
    # one write per rank: the ranks share an unbuffered stdout, and print's pieces interleave
    sys.stdout.write(f"rank {{rank}} ok {{float(got)}}\\n")
    from gloo_helpers import leave_fsdp_group

    leave_fsdp_group()
    """
)


@pytest.mark.slow
def test_fsdp_checkpoint_is_unsharded_and_resumes(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), str(tmp_path / "checkpoints")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count(" ok ") == 2


STEP_SCRIPT = textwrap.dedent(
    """
    import faulthandler, json, os, sys
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails with every thread's stack
    sys.path.insert(0, {tests!r})
    from gloo_helpers import fsdp_on_cpu
    fsdp_on_cpu()
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from test_train import random_dataset, tiny_config, tiny_target

    from eagletools.train.inputs import online_inputs
    from eagletools.train.trainer import Trainer

    out, batch_size, clip = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    config = tiny_config(f"training.batch_size={{batch_size}}", "training.max_steps=1",
                         f"training.grad_clip={{clip}}", "draft.num_hidden_layers=2")
    trainer = Trainer(config, out, online_inputs(config, tiny_target(), random_dataset()))
    sharded = dist.is_initialized()
    if sharded:  # accelerate's prepare sharded the draft: FSDP2, not DDP
        assert trainer.accelerator.is_fsdp2, trainer.accelerator.distributed_type
        assert isinstance(trainer.draft.fc.weight, DTensor)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    stepped, step = [], trainer.optimizer.step

    def recorded(*args, **kwargs):  # the norm of the gradient the update is made of
        grads = [full(p.grad).flatten() for g in trainer.optimizer.param_groups
                 for p in g["params"] if p.grad is not None]
        stepped.append(float(torch.cat(grads).norm()))
        return step(*args, **kwargs)

    trainer.optimizer.step = recorded
    grad_norm = trainer.train_step()["grad_norm"]
    params = {{n: full(p.detach()).clone() for n, p in trainer.draft.named_parameters()}}
    if not sharded or dist.get_rank() == 0:
        out.mkdir(exist_ok=True)  # one step writes no checkpoint
        torch.save(params, out / "params.pt")
        (out / "step.json").write_text(json.dumps({{"grad_norm": grad_norm, "stepped": stepped}}))
    from gloo_helpers import leave_fsdp_group

    leave_fsdp_group(sharded)
    """
)


@pytest.mark.slow
def test_fsdp2_trainer_clips_the_sharded_gradients(tmp_path):
    """FSDP2 swaps every parameter inside accelerate's `prepare`: the trainer must clip the
    new ones, or clipping sees no gradient, logs a grad_norm of 0 and clips nothing. Under
    the recipe's auto-wrap policy, `register_fsdp_methods` lets the wrapped layers' methods
    gather their shards (without it: "mixed torch.Tensor and DTensor"), a second draft
    layer's too."""
    script, clip = tmp_path / "step.py", 1e-3
    script.write_text(STEP_SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the same global batch of 4: one process alone, then two FSDP2 ranks of 2
    one = subprocess.run([sys.executable, str(script), str(tmp_path / "one"), "4", str(clip)],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), str(tmp_path / "two"), "2", str(clip)]  # fmt: skip
    # the recipe's size-based wrapping, at a size that wraps the tiny draft's layers too: the
    # unroll calls their methods, which must gather the shards as `forward` does
    fsdp = {**env, **fsdp_launch_env(fsdp_min_num_params=1000)}
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=fsdp)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    a, b = (json.loads((tmp_path / run / "step.json").read_text()) for run in ("one", "two"))
    assert a["grad_norm"] > 100 * clip  # the step is clipped
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert a["stepped"] == b["stepped"] == pytest.approx([clip], rel=1e-3)
    alone, sharded = (
        torch.load(tmp_path / run / "params.pt", weights_only=True) for run in ("one", "two")
    )
    assert alone.keys() == sharded.keys()
    for name, p in alone.items():  # the same update: the clipped step, on every shard
        assert torch.allclose(sharded[name], p, atol=1e-6), name
