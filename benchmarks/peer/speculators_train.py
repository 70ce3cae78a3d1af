"""The peer: vLLM's trainer (`speculators` 0.9.0) on our recipe's data and clock.

One wall-clock budget (`--minutes`) covers what a `speculators train` user runs
after tokenising: the verifier's hidden states of every conversation (their
generator needs a vLLM server; here our target writes the same states in
their file layout: the aux layers, whose numbering is theirs, then the last
decoder layer's output before the final norm, which their loss normalises
itself), a 20-step calibration, then their trainer on the CPU for the time left
(benchmarks/peer/speculators_cpu.py). Its step count is set from the
calibration so that their linear schedule ends inside the budget; a run still
going at the deadline is interrupted (their handler saves a checkpoint).
After the budget, untimed: `eagletools convert` of the last checkpoint, our
trainer's held-out metrics on the same held-out conversations
(`Trainer.evaluate`), and `eagletools eval` on MT-bench as the recipe's
`eval` section sets it.

Data: the recipe's prepared conversations and split (`data.eval_samples`,
`training.seed`): training rows first, then the held-out ones, with
`--train-data-ratio` set so their validation split is exactly our held-out.
The draft vocabulary comes from their `token_freq.pt` over the training rows
(their selection rule, which is ours), of the recipe's size. Their defaults
hold except what this CPU forces (CPU_ARGS), their autocast dtype
(`--hidden-states-dtype`: the one the recipe's `training.precision` trains ours
in here, unless given after `--`) and `--no-norm-before-fc`:
their eagle3 default puts one RMSNorm over the concatenated aux states,
which eagletools does not read (formats/speculators.py refuses it).

    .venv/bin/python benchmarks/peer/speculators_train.py recipes/smollm2-135m-cpu.yaml \\
        --output-dir runs/peer/demo --minutes 20
    .venv/bin/python benchmarks/peer/speculators_train.py recipes/smollm2-135m-cpu.yaml \\
        --output-dir runs/peer/ours --score runs/demo/eagle

The long recipe's regenerated data, once `eagletools train` has written it
(both trainers then share its minutes; the peer captures its own states):

    .venv/bin/python benchmarks/peer/speculators_train.py recipes/smollm2-135m-cpu-long.yaml \\
        data.train=runs/long/regenerated.jsonl data.regenerate.enabled=false data.offline=false \\
        --output-dir runs/peer/long --minutes 46.8 -- --total-seq-len 1024 --lr 3e-3 --muon-lr 3e-3

`--score DRAFT` measures any draft the same way (held-out and MT-bench) and
trains nothing. `--reuse-data` keeps OUT/data from an earlier run and charges
its recorded capture time to the budget. Arguments after `--` go to `speculators train`
(e.g. `-- --total-seq-len 2048`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
SPEC_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
INNER = Path(__file__).with_name("speculators_cpu.py")
EAGLETOOLS = Path(sys.executable).with_name("eagletools")
# its first steps run slower: 3 steps timed 1.51 s a step against 0.87 after (long recipe),
# which left 40% of the budget unused; 20 spread the first ones' cost (not yet timed)
CALIBRATION_STEPS = 20
PER_SAMPLE = "per_sample.safetensors"  # held_out's per-conversation sums, beside metrics.json
# what this CPU forces on `speculators train` (the failures: speculators_cpu.py)
CPU_ARGS = [
    "--num-workers=0",  # default 12 spawned loader processes, on 2 cores
    "--loss-implementation=eager",  # the default fused loss is a Triton kernel
    "--draft-attn-impl=sdpa",  # flex attention has no backward on CPU
    "--no-norm-before-fc",  # a draft eagletools can convert (module docstring)
]


@torch.no_grad()
def their_states(model: torch.nn.Module, ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """[T, A+1, Ht] for one sample, as their hs_{row}.safetensors holds it: the aux
    states (HF numbering, theirs too), then the last decoder layer's output before the
    final norm (their loss applies the verifier's norm itself)."""
    from eagletools.targets import capture_aux
    from eagletools.targets.anatomy import final_norm

    last: list[torch.Tensor] = []
    hook = final_norm(model).register_forward_hook(lambda m, args, out: last.append(args[0]))
    try:
        aux = capture_aux(model, ids, layer_ids=layers).aux[0]
    finally:
        hook.remove()
    return torch.cat([aux, last[0][0]], dim=-1).unflatten(-1, (len(layers) + 1, -1))


def peer_dtype(config: Any) -> str:
    """Their autocast dtype: the one the recipe's `training.precision` trains ours in here.
    Their bf16 default would pit our fp32 against bf16 products at 0.013x fp32's speed
    on a CPU without bf16 dot products (a 2-core AVX2 EPYC)."""
    from eagletools.dtypes import dtype_name
    from eagletools.train.inputs import training_dtype

    return dtype_name(str(training_dtype(config.training.precision, torch.device("cpu"))))


def write_data(config: Any, out: Path, train_samples: int | None) -> dict[str, Any]:
    """Their data folder: a `datasets` table and hidden_states/hs_{row}.safetensors."""
    import datasets
    from safetensors.torch import save_file

    from eagletools.targets import default_aux_layer_ids
    from eagletools.train.data import split_indices, trainable
    from eagletools.train.inputs import load_teacher, online_inputs

    # our online teacher's dtype: bf16 forwards captured 195 conversations in 19 minutes
    # on a CPU without bf16 dot products (an AVX2 EPYC), where ours trains in fp32
    target = load_teacher(config)
    source = online_inputs(config, target=target).source
    train_idx, eval_idx = split_indices(len(source), config.data.eval_samples, config.training.seed)
    train_idx, eval_idx = trainable(source, train_idx)[0], trainable(source, eval_idx)[0]
    train_idx = train_idx[:train_samples] if train_samples else train_idx
    layers = config.target.aux_layer_ids or default_aux_layer_ids(target.info.num_layers)
    rows = train_idx + eval_idx
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    for row, i in enumerate(rows):
        ids = source.batch([i]).input_ids
        save_file(
            {"token_ids": ids[0], "hidden_states": their_states(target.model, ids, layers)},
            out / "hidden_states" / f"hs_{row}.safetensors",
        )
    columns = {
        "input_ids": [source.batch([i]).input_ids[0].tolist() for i in rows],
        "loss_mask": [source.loss_mask(i).tolist() for i in rows],
        "seq_len": [source.length(i) for i in rows],
    }
    table = datasets.Dataset.from_dict(columns)
    table.set_format(type="torch")
    table.save_to_disk(str(out))
    return {
        "train_rows": len(train_idx),
        "eval_rows": len(eval_idx),
        "train_tokens": sum(columns["seq_len"][: len(train_idx)]),
        "eval_tokens": sum(columns["seq_len"][len(train_idx) :]),
        "aux_layer_ids": layers,
    }


def run_trainer(args: list[str], log: Path, deadline: float | None = None) -> dict[str, Any]:
    """Their trainer in its venv; SIGINT at the deadline (it saves, then exits)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    late = False
    with log.open("w") as f:
        proc = subprocess.Popen([str(SPEC_PYTHON), str(INNER), *args], stdout=f, stderr=f, env=env)
        try:
            proc.wait(None if deadline is None else max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            late = True
            proc.send_signal(signal.SIGINT)
            proc.wait()
    if proc.returncode != 0:
        when = " (stopped at the deadline before its training loop)" if late else ""
        raise SystemExit(f"speculators train failed, exit {proc.returncode}{when}; see {log}")
    save = Path(args[args.index("--save-path") + 1])
    return json.loads((save / "peer_stats.json").read_text())


def calibration_view(data: Path, folder: Path) -> Path:
    """The same table (hidden states by --hidden-states-path), with its own token counts
    and d2t files: the calibration validates on one row, not the held-out set."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("data-00000-of-00001.arrow", "dataset_info.json", "state.json"):
        if not (folder / name).exists():
            (folder / name).symlink_to((data / name).resolve())
    return folder


def steps_for(budget_s: float, calib: dict[str, Any], overhead_s: float, info: dict) -> int:
    """Optimizer steps that fit: time left less setup and one pass over the held-out
    set (forward only, about a quarter of a step per step's tokens), at the
    calibrated seconds per step."""
    per_token = calib["seconds_per_step"] / max(1, calib["tokens"] / calib["steps"])
    left = budget_s - overhead_s - 0.25 * per_token * info["eval_tokens"]
    if left < calib["seconds_per_step"]:
        raise SystemExit(
            f"{budget_s / 60:.1f} minutes are left after the data and calibration, too few for "
            f"one step ({calib['seconds_per_step']:.0f} s) and validation: raise --minutes"
        )
    return math.floor(left / calib["seconds_per_step"])


def last_checkpoint(save: Path) -> Path:
    """`interrupted/` when the deadline stopped it, else the last epoch's folder."""
    if (save / "interrupted" / "config.json").is_file():
        return save / "interrupted"
    epochs = [p for p in save.iterdir() if p.name.isdigit() and (p / "config.json").is_file()]
    return max(epochs, key=lambda p: int(p.name))


def to_eagle(checkpoint: Path, dest: Path, target: Path) -> None:
    """`eagletools convert` of one of their checkpoints to the eagle format."""
    subprocess.run(
        [str(EAGLETOOLS), "convert", str(checkpoint), str(dest), "--to", "eagle",
         "--target", str(target), "--force"],
        check=True,
    )  # fmt: skip


def held_out(recipe: str, overrides: list[str], draft: Path, work: Path) -> dict[str, Any]:
    """Our trainer's held-out metrics (`Trainer.evaluate`) for a finished draft: a
    trainer built with the draft's architecture and vocabulary, the draft's weights
    loaded in its place."""
    from safetensors.torch import save_file

    from eagletools.formats import load_checkpoint
    from eagletools.train.held_out import held_out_metrics
    from eagletools.train.inputs import online_inputs
    from eagletools.train.recipe import load_config
    from eagletools.train.trainer import Trainer
    from eagletools.vocab import DraftVocab

    ckpt = load_checkpoint(draft)
    c = ckpt.config
    work.mkdir(parents=True, exist_ok=True)
    DraftVocab.from_d2t(ckpt.tensors["d2t"], c.vocab_size).save(work / "vocab.safetensors")
    shape = [
        f"vocab.path={work / 'vocab.safetensors'}",
        f"vocab.draft_vocab_size={c.draft_vocab_size}",
        f"draft.norm_before_residual={str(c.norm_before_residual).lower()}",
        f"draft.fc_norm={str(c.fc_norm).lower()}",
        f"draft.norm_output={str(c.norm_output).lower()}",
        f"draft.intermediate_size={c.intermediate_size}",
        f"draft.num_hidden_layers={c.num_hidden_layers}",
        f"target.aux_layer_ids={list(c.aux_layer_ids)}",
    ]
    config = load_config(recipe, overrides + shape)
    trainer = Trainer(config, work / "trainer", online_inputs(config))
    missing, unexpected = trainer.draft.load_state_dict(ckpt.tensors, strict=False)
    if set(missing) - {"embed_tokens.weight"} or unexpected:
        raise SystemExit(f"{draft}: tensors do not fit: missing {missing}, unexpected {unexpected}")
    per_sample = trainer.held_out_per_sample()
    save_file({f.name: getattr(per_sample, f.name).cpu().contiguous()
               for f in dataclasses.fields(per_sample)}, work / PER_SAMPLE)  # fmt: skip
    metrics = held_out_metrics(per_sample, config.training.ttt_decay)
    (work / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def load_per_sample(work: Path) -> Any:
    """`held_out`'s per-conversation stats (ttt.StepStats), for a paired comparison."""
    from safetensors.torch import load_file

    from eagletools.train.ttt import StepStats

    return StepStats(**load_file(work / PER_SAMPLE))


def mt_bench(config: Any, draft: Path, out: Path) -> dict[str, Any]:
    """`eagletools eval` on MT-bench with the recipe's eval settings (greedy)."""
    e = config.eval
    subprocess.run(
        [str(EAGLETOOLS), "eval", "--target", config.target.spec, "--draft", str(draft),
         "--bench", "mt-bench", "--num-prompts", str(e.num_prompts),
         "--max-new-tokens", str(e.max_new_tokens), "--topk", str(e.topk),
         "--depth", str(e.depth), "--num-draft-tokens", str(e.num_draft_tokens),
         "--no-progress", "--output-dir", str(out)],
        check=True,
    )  # fmt: skip
    return json.loads((out / "results.json").read_text())


def score(args: argparse.Namespace, config: Any, draft: Path) -> dict[str, Any]:
    metrics = held_out(args.recipe, args.overrides, draft, args.output_dir / "held-out")
    results = mt_bench(config, draft, args.output_dir / "mt-bench")
    summary = results.get("summary", results)
    return {"held_out": metrics, "mt_bench": summary}


def peer_data(
    config: Any, out: Path, train_samples: int | None, reuse: bool
) -> tuple[dict[str, Any], float]:
    """OUT/target (their verifier: an HF folder, before the clock) and OUT/data; returns
    the data record and when the clock started (an earlier capture's time still counts)."""
    from eagletools.dtypes import parse_dtype
    from eagletools.targets.load import export_target

    if not (out / "target" / "config.json").is_file():
        export_target(config.target.spec, out / "target", parse_dtype(config.target.dtype))
    record = out / "data" / "peer_data.json"
    start = time.perf_counter()
    if reuse and record.is_file():
        info = json.loads(record.read_text())
        return info, start - info["data_s"]
    info = write_data(config, out / "data", train_samples)
    info["data_s"] = time.perf_counter() - start
    record.write_text(json.dumps(info, indent=2))
    return info, start


def peer_args(config: Any, out: Path, extra: list[str]) -> list[str]:
    """`speculators train` arguments every run of ours shares: verifier, vocabulary size,
    logs, seed, what the CPU forces, their autocast dtype, then the caller's."""
    if not any(a.startswith("--hidden-states-dtype") for a in extra):
        extra = [*extra, f"--hidden-states-dtype={peer_dtype(config)}"]
    return [
        "--verifier-name-or-path", str(out / "target"),
        "--draft-vocab-size", str(config.vocab.draft_vocab_size),
        "--log-dir", str(out / "logs"),
        "--seed", str(config.training.seed),
        *CPU_ARGS, *extra,
    ]  # fmt: skip


def train(args: argparse.Namespace, config: Any, extra: list[str]) -> dict[str, Any]:
    out = args.output_dir
    info, start = peer_data(config, out, args.train_samples, args.reuse_data)
    target = out / "target"
    deadline = start + 60 * args.minutes
    print(f"data: {json.dumps(info)}", flush=True)
    rows = info["train_rows"] + info["eval_rows"]
    common = peer_args(config, out, extra)
    max_steps = args.max_steps
    if max_steps is None:
        begun = time.perf_counter()
        view = calibration_view(out / "data", out / "calibration" / "data")
        calib = run_trainer(
            [*common, "--data-path", str(view), "--save-path", str(out / "calibration" / "ckpt"),
             "--hidden-states-path", str(out / "data" / "hidden_states"),
             f"--train-data-ratio={(rows - 0.5) / rows}", f"--max-steps={CALIBRATION_STEPS}"],
            out / "calibration.log",
        )  # fmt: skip
        overhead = time.perf_counter() - begun - CALIBRATION_STEPS * calib["seconds_per_step"]
        max_steps = steps_for(deadline - time.perf_counter(), calib, overhead, info)
        info["calibration"] = {**calib, "overhead_s": overhead}
        print(f"calibration: {json.dumps(info['calibration'])}; {max_steps} steps", flush=True)
    save = out / "ckpt"
    stats = run_trainer(
        [*common, "--data-path", str(out / "data"), "--save-path", str(save),
         f"--train-data-ratio={(info['train_rows'] + 0.5) / rows}", f"--max-steps={max_steps}"],
        out / "train.log",
        deadline,
    )  # fmt: skip
    minutes = (time.perf_counter() - start) / 60
    checkpoint = last_checkpoint(save)
    to_eagle(checkpoint, out / "eagle", target)
    return {**info, "max_steps": max_steps, "train": stats, "minutes": minutes,
            "checkpoint": str(checkpoint)}  # fmt: skip


def peer_cli(doc: str) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """A harness's parser (recipe, overrides, --output-dir), our argv, and the
    arguments after `--`, which go to `speculators train`."""
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, as for eagletools train")
    p.add_argument("--output-dir", required=True, type=Path)
    return p, argv[:cut], argv[cut + 1 :]


def main() -> None:
    p, argv, extra = peer_cli(__doc__)
    p.add_argument("--minutes", type=float, default=20.0, help="wall clock: data + training")
    p.add_argument("--max-steps", type=int, help="their optimizer steps (default: calibrated)")
    p.add_argument("--train-samples", type=int, help="first N training conversations only")
    p.add_argument("--score", type=Path, help="only score this draft folder")
    p.add_argument("--reuse-data", action="store_true",
                   help="keep OUT/data from an earlier run; its capture minutes still count")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from eagletools.train.recipe import load_config

    config = load_config(args.recipe, args.overrides)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    draft = args.score
    if draft is None:
        result = train(args, config, extra)
        draft = args.output_dir / "eagle"
    result.update(score(args, config, draft))
    (args.output_dir / "summary.json").write_text(json.dumps(result, indent=2))
    h = result["held_out"]
    print(f"draft: {draft}")
    if "train" in result:
        t = result["train"]
        print(f"tokens trained: {t['tokens']} in {t['steps']} steps; "
              f"{result['minutes']:.1f} minutes data + training")  # fmt: skip
    print(f"held-out simulated acceptance length {h['simulated_acceptance_length']:.3f}")
    print(f"summary: {args.output_dir / 'summary.json'}")


if __name__ == "__main__":
    main()
