"""Equal tokens: speculators' trainer and ours on the same conversations, each for the
same number of trained tokens, held-out acceptance against tokens at `--points` points.

A GPU user pays per trained token, not per CPU minute, so this compares what each
trainer makes of a token budget, whatever either one's speed on this CPU. Both runs
end at `--tokens` (ours by `training.max_tokens`, the peer by the steps its packs
of the training split fill on average: speculators_cpu.py `--max-tokens`), each
with its learning-rate schedule sized to that end, and both keep checkpoints at
1/P, 2/P, ... of the way (ours every `training.save_every` steps, theirs by
`--snapshots`). Every checkpoint is scored the same way, untimed: our trainer's
held-out metrics (`Trainer.evaluate`: simulated acceptance length and the exact
chain, each with its 95% interval over the held-out conversations), the peer's
draft converted to the eagle format first. Tokens are all tokens of the rows a
trainer stepped on, prompts included, padding excluded, as each counts them.

    .venv/bin/python benchmarks/peer/equal_tokens.py recipes/smollm2-135m-cpu.yaml \\
        --tokens 600000 --output-dir runs/peer/equal-demo -- --total-seq-len 1024 \\
        --lr 3e-3 --muon-lr 3e-3

Arguments after `--` go to `speculators train`; `--ours KEY=VALUE` (repeatable)
overrides our recipe only (e.g. `--ours data.hidden_states=runs/long/hidden-states`);
positional overrides go to both. Every stage resumes: rerun the same command; with
`--label NAME` and other `--ours` settings it adds a run of ours beside the first,
with `--peer-label NAME` and other arguments after `--` one of the peer's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from speculators_train import (
    EAGLETOOLS,
    PER_SAMPLE,
    held_out,
    load_per_sample,
    peer_args,
    peer_cli,
    peer_data,
    run_trainer,
    to_eagle,
)


def peer_points(args: argparse.Namespace, config: Any, extra: list[str]) -> list[dict[str, Any]]:
    """The peer's run to `--tokens`, one entry (step, tokens, eagle folder) a snapshot."""
    out = args.output_dir / "peer"
    if args.peer_label:  # another run of the peer, on the first one's data and verifier
        variant = args.output_dir / f"peer-{args.peer_label}"
        variant.mkdir(exist_ok=True)
        for shared in ("data", "target"):
            if not (variant / shared).exists():
                (variant / shared).symlink_to(Path("..") / "peer" / shared)
        out = variant
    info, _ = peer_data(config, out, None, reuse=True)
    save = out / "ckpt"
    if not (save / "peer_stats.json").is_file():
        rows = info["train_rows"] + info["eval_rows"]
        run_trainer(
            [*peer_args(config, out, extra), "--data-path", str(out / "data"),
             "--save-path", str(save), f"--train-data-ratio={(info['train_rows'] + 0.5) / rows}",
             f"--max-tokens={args.tokens}", f"--snapshots={args.points}"],
            out / "train.log",
        )  # fmt: skip
    stats = json.loads((save / "peer_stats.json").read_text())
    points = []
    for snap in stats["snapshots"]:
        eagle = out / "eagle" / snap["folder"]
        if not (eagle / "config.json").is_file():
            to_eagle(save / snap["folder"], eagle, out / "target")
        points.append({"step": snap["step"], "tokens": snap["tokens"], "draft": eagle})
    return points


def our_points(args: argparse.Namespace, tokens_a_row: float) -> list[dict[str, Any]]:
    """Our run to `--tokens`, one entry (step, tokens, checkpoint) a kept checkpoint."""
    from eagletools.train.recipe import load_config

    out = args.output_dir / args.label
    overrides = [*args.overrides, *args.ours]
    t = load_config(args.recipe, overrides).training
    per_step = t.batch_size * t.grad_accum * (t.pack_tokens or tokens_a_row)
    every = max(1, round(args.tokens / per_step / args.points))
    if not (out / "metrics.json").is_file():
        subprocess.run(
            [str(EAGLETOOLS), "train", args.recipe, *overrides, f"training.max_tokens={args.tokens}",
             "training.max_steps=null", "training.max_minutes=null", "training.eval_every=0",
             f"training.save_every={every}", f"training.keep_last={args.points + 2}",
             "--output-dir", str(out), *(["--resume"] if (out / "checkpoints").is_dir() else [])],
            check=True,
        )  # fmt: skip
    points = []
    for folder in sorted((out / "checkpoints").glob("step-*")):
        position = json.loads((folder / "trainer_state.json").read_text())["position"]
        points.append({"step": position["step"], "tokens": position["tokens"], "draft": folder})
    # the last scheduled save can land a few steps before the end: the end stands for it
    near = len(points) > 1 and points[-1]["step"] - points[-2]["step"] < every / 4
    return points[:-2] + points[-1:] if near else points


def score(args: argparse.Namespace, trainer: str, point: dict[str, Any], last: bool) -> None:
    """Held-out metrics of one checkpoint, kept beside its step and tokens (a rerun, or a
    run of another `--label`, scores only what is new). The last point keeps its
    per-conversation sums too, for the paired differences (scored again if an older
    version of this script left none)."""
    work = args.output_dir / "scores" / f"{trainer}-{point['step']}"
    if not (work / "metrics.json").is_file() or (last and not (work / PER_SAMPLE).is_file()):
        held_out(args.recipe, args.overrides, point["draft"], work)
    row = {"trainer": trainer, "step": point["step"], "tokens": point["tokens"], "last": last}
    (work / "point.json").write_text(json.dumps(row))


def scores(folder: Path) -> list[dict[str, Any]]:
    """Every scored checkpoint under OUT/scores, by tokens."""
    rows = [
        {
            **json.loads((d / "point.json").read_text()),
            **json.loads((d / "metrics.json").read_text()),
        }
        for d in folder.iterdir()
        if (d / "point.json").is_file()
    ]
    return sorted(rows, key=lambda r: (r["tokens"], r["trainer"]))


def interval(m: dict[str, Any], name: str) -> str:
    lo, hi = m[f"{name}_lo"], m[f"{name}_hi"]
    return f"{m[name]:.3f} [{lo:.3f}, {hi:.3f}]"


def paired(folder: Path, rows: list[dict[str, Any]]) -> list[str]:
    """Each run of ours against each of the peer's at their last points, resampling the
    same held-out conversations for both (held_out.paired_difference): the interval of the
    difference itself, which the runs' own intervals overstate."""
    from eagletools.train.held_out import paired_difference

    last = {r["trainer"]: r for r in rows if r.get("last")}
    lines = ["| ours | peer | tokens (ours, peer) | simulated: ours - peer [95%] "
             "| exact chain: ours - peer [95%] |", "|---|---|---|---|---|"]  # fmt: skip
    for mine in (r for name, r in last.items() if name.startswith("eagletools")):
        for theirs in (r for name, r in last.items() if name.startswith("speculators")):
            d = paired_difference(*(load_per_sample(folder / f"{r['trainer']}-{r['step']}")
                                    for r in (mine, theirs)))  # fmt: skip
            cells = [
                interval(d, f"{n}_acceptance_length_difference") for n in ("simulated", "exact")
            ]
            lines.append(f"| {mine['trainer']} | {theirs['trainer']} | "
                         f"{mine['tokens']:,}, {theirs['tokens']:,} | {cells[0]} | {cells[1]} |")  # fmt: skip
    return lines


def main() -> None:
    p, argv, extra = peer_cli(__doc__)  # the overrides go to both trainers
    p.add_argument("--tokens", required=True, type=int, help="trained tokens of each run")
    p.add_argument("--points", type=int, default=4, help="checkpoints scored along each run")
    p.add_argument("--ours", action="append", default=[], help="KEY=VALUE for our run only")
    p.add_argument("--label", default="ours",
                   help="OUT/LABEL holds our run: another label with other --ours settings "
                        "reuses the peer's run and scores, and the table lists every run")  # fmt: skip
    p.add_argument("--peer-label", help="OUT/peer-LABEL holds another run of the peer (other "
                   "arguments after --) on OUT/peer's data; the table lists it beside")  # fmt: skip
    args = p.parse_args(argv)
    from eagletools.train.recipe import load_config

    config = load_config(args.recipe, args.overrides)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    peer = peer_points(args, config, extra)
    info = json.loads((args.output_dir / "peer" / "data" / "peer_data.json").read_text())
    ours = our_points(args, info["train_tokens"] / info["train_rows"])
    for i, point in enumerate(peer):
        name = f"speculators-{args.peer_label}" if args.peer_label else "speculators"
        score(args, name, point, last=i == len(peer) - 1)
    for i, point in enumerate(ours):
        name = "eagletools" if args.label == "ours" else f"eagletools-{args.label}"
        score(args, name, point, last=i == len(ours) - 1)
    rows = scores(args.output_dir / "scores")
    (args.output_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    print("| tokens | trainer | step | held-out simulated [95%] | exact chain [95%] |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['trainer']} | {r['step']} | "
              f"{interval(r, 'simulated_acceptance_length')} | {interval(r, 'exact_acceptance_length')} |")  # fmt: skip
    print("\nPaired, at the last points (the same held-out conversations resampled for both):")
    print("\n".join(paired(args.output_dir / "scores", rows)))


if __name__ == "__main__":
    main()
