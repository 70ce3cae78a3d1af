"""The training loop: one process on CPU, DDP/FSDP on GPUs, through accelerate.

The samples, aux states and teacher come from `train.inputs` (online or from a
hidden-state cache); either way the teacher is the target's `lm_head` over the
draft-vocab rows only, and the loss is the training-time-test unroll (`train.ttt`).
When the run ends and its learning rate are `train.schedule`'s; the held-out pass
is `train.held_out`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagletools.atomic import write_text
from eagletools.compiling import require_cpu_compiler
from eagletools.errors import UserError
from eagletools.kinds import KINDS
from eagletools.train import checkpoint as ckpt
from eagletools.train.data import (
    ArgmaxMemo,
    EpochBatches,
    split_indices,
    steps_per_epoch,
    trainable,
)
from eagletools.train.held_out import HeldOut, format_metrics
from eagletools.train.inputs import (
    TrainInputs,
    features,
    staged_inputs,
    training_dtype,
    vocab_counts,
)
from eagletools.train.recipe import TrainConfig, dump_config, saved_config
from eagletools.train.schedule import Schedule, time_budget
from eagletools.train.ttt import StepStats, step_counts, summarize, teacher_targets
from eagletools.vocab import run_vocab, save_run_vocab

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Where a run stands: saved with every checkpoint, restored by --resume."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # global batches of the epoch already trained on
    tokens: int = 0
    skipped_nan_steps: int = 0
    bad_in_row: int = 0
    skipped_masked_samples: int = 0
    seconds: float = 0.0  # in training steps
    budget_s: float | None = None  # the steps' time budget, fixed when training first starts


class Trainer:
    """One training run; `run()` returns the final held-out metrics."""

    def __init__(
        self,
        config: TrainConfig,
        output_dir: str | Path,
        inputs: TrainInputs,
        resume: bool = False,
        started: float | None = None,
    ):
        """`started`: when the run began (`time.perf_counter()`), for training.total_minutes;
        None: now."""
        started = time.perf_counter() if started is None else started
        self.config, self.out, self.inputs = config, Path(output_dir), inputs
        if config.training.num_threads:
            torch.set_num_threads(config.training.num_threads)
        torch.manual_seed(config.training.seed)
        self._setup_accelerator()
        self._setup_data()
        self._setup_optimizer(self._setup_model())
        self._setup_teacher()
        self.state = TrainState(skipped_masked_samples=self.skipped_masked)
        self.history: list[dict[str, float]] = []
        if resume:
            self._resume()
        elif ckpt.list_checkpoints(self.out / "checkpoints"):
            raise UserError(
                f"{self.out} already holds a training run; pass --resume to continue it "
                "or choose another --output-dir"
            )
        self._setup_schedule(started)

    # -- setup -------------------------------------------------------------

    def _setup_accelerator(self) -> None:
        """accelerate for the processes (DDP/FSDP); bf16 autocast and compile are ours.

        accelerate keeps one state per process and refuses a second `Accelerator` with
        another mixed precision, so a second run in the same process (pipeline, notebook,
        tests) could not change either; owning both here keeps every run's accelerate
        setup the same.
        """
        from accelerate import Accelerator

        c = self.config
        self.accelerator = Accelerator(
            # without a GPU, processes started by `accelerate launch` train on CPU over gloo
            cpu=not torch.cuda.is_available(),
            mixed_precision="no",
            dynamo_backend="no",
            log_with=None if c.tracking.report_to == "none" else c.tracking.report_to,
            project_dir=str(self.out),
        )
        self.device = self.accelerator.device
        self.dtype = training_dtype(c.training.precision, self.device)
        self.autocast = functools.partial(
            torch.autocast, self.device.type, torch.bfloat16, self.dtype == torch.bfloat16
        )
        fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
        kind = self.accelerator.distributed_type.value
        if fsdp_asked and kind != "FSDP":
            # on CPU accelerate quietly turns an FSDP launch into DDP over gloo
            log.warning("FSDP was asked but accelerate runs %s here (FSDP needs GPUs); "
                        "the draft and optimizer are replicated, not sharded", kind)  # fmt: skip

    def _setup_data(self) -> None:
        """Held-out split, samples with something to learn, and the draft vocabulary."""
        c, t, src = self.config, self.config.training, self.inputs.source
        if len(src) == 0:
            raise UserError(f"{c.data.train}: the dataset is empty after filtering")
        train_idx, eval_idx = split_indices(len(src), c.data.eval_samples, t.seed)
        self.train_idx, skipped = trainable(src, train_idx)
        self.eval_idx, skipped_eval = trainable(src, eval_idx)
        self.skipped_masked = skipped + skipped_eval
        if self.skipped_masked:
            log.warning("skipped %d samples whose every token is masked out of the loss",
                        self.skipped_masked)  # fmt: skip
        if not self.train_idx:
            raise UserError(
                f"{c.data.train}: no training sample is left after filtering "
                f"({len(train_idx)} had every token masked out of the loss); "
                "check the chat template and data.max_length"
            )
        self.batches = EpochBatches(src, self.train_idx, self.accelerator.num_processes, t)
        step = self.batches.global_batch * t.grad_accum
        if len(self.train_idx) < step:
            raise UserError(
                f"{c.data.train}: {len(self.train_idx)} training samples are fewer than one "
                f"optimizer step takes ({step} = training.batch_size x training.grad_accum x "
                "processes); use more data or a smaller training.batch_size"
            )
        v, counted = c.vocab, self.train_idx[: c.vocab.count_samples]
        count = functools.partial(vocab_counts, self.inputs, counted, v.count, self.accelerator)
        self.vocab, self.vocab_report = run_vocab(
            self.out, path=v.path, size=v.draft_vocab_size, count=count,
            num_samples=len(counted), counted_by=v.count,
        )  # fmt: skip

    def _setup_model(self) -> nn.Module:
        """The draft, sized and initialised from the target, in its kind's objective (for
        EAGLE-3 the training-time-test unroll)."""
        d, t, head_model = self.config.draft, self.config.training, self.inputs.head_model
        kind = KINDS[d.kind]
        draft = kind.from_target(
            head_model,
            self.vocab,
            aux_layer_ids=self.inputs.aux_layer_ids,
            init_head_from_target=d.init_head_from_target,
            norm_before_residual=d.norm_before_residual,
            fc_norm=d.fc_norm,
            norm_before_fc=d.norm_before_fc,
            norm_output=d.norm_output,
            intermediate_size=d.intermediate_size or head_model.config.intermediate_size,
            num_hidden_layers=d.num_hidden_layers,
            mask_token_id=d.mask_token_id,
        )
        # frozen, so kept in the target's dtype: `from_target` widens a bf16 target's rows to
        # fp32, the same values in twice the bytes (1 GB a process at Llama-3.1-8B's 525M)
        draft.embed_tokens.to(head_model.get_input_embeddings().weight.dtype)
        if d.freeze_head:  # the target's rows, frozen; the norm (at 1) learns the scale
            with torch.no_grad():
                draft.lm_head.weight.copy_(self.inputs.lm_head_weight[self.vocab.selected])
            draft.lm_head.weight.requires_grad_(False)
        return kind.objective(draft, t)

    def _setup_optimizer(self, model: nn.Module) -> None:
        """AdamW (or Muon and AdamW) over the trainable weights; accelerate wraps model and
        optimizer together."""
        from eagletools.devices import fast_matmul_dtype
        from eagletools.train.muon import MuonAdamW, muon_groups

        t = self.config.training
        trained = [p for p in model.draft.parameters() if p.requires_grad]
        if t.optimizer == "muon":
            groups = muon_groups(model.draft.named_parameters(), t.muon_lr_ratio)
            optimizer = MuonAdamW(
                groups, t.lr, tuple(t.betas), t.weight_decay,
                ns_dtype=fast_matmul_dtype(self.device),
            )  # fmt: skip
        else:
            optimizer = torch.optim.AdamW(
                trained, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                fused=self.device.type in ("cpu", "cuda"),  # one kernel, not ~10 per tensor
            )  # fmt: skip
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # after prepare: FSDP2 swaps every parameter for a new one, and clipping the old
        # objects would see no gradients (docs/design.md, GPU scale)
        self.params = [p for p in self._unwrapped().draft.parameters() if p.requires_grad]
        self._unwrapped().register_fsdp_methods()
        if t.compile:  # one graph over all sequence lengths (held-out evaluation stays eager)
            if self.device.type == "cpu":
                require_cpu_compiler("training.compile")
            self.model = torch.compile(self.model, backend="inductor", dynamic=True)
        self.draft = self._unwrapped().draft

    def _setup_teacher(self) -> None:
        """The target's lm_head on this device; offline, a memo of each sample's argmax;
        the held-out conversations, scored by the draft under that teacher."""
        t = self.config.training
        self.lm_head = self.inputs.lm_head_weight.to(self.device)
        self.d2t = self.draft.d2t
        # offline the hidden states repeat every epoch, so their argmax does too
        self.argmax_memo = ArgmaxMemo() if self.inputs.target_model is None else None
        self.held_out = HeldOut(self.inputs.source, self.eval_idx, t.eval_batch_size,
                                t.eval_ttt_steps, self._held_out_stats, self.accelerator)  # fmt: skip

    def _setup_schedule(self, started: float) -> None:
        """The schedule, its time budget fixed when training first starts (a resumed run
        keeps it); a packed epoch's row count varies a little with its shuffle, and the
        first one's stands in."""
        t = self.config.training
        if self.state.budget_s is None:
            self.state.budget_s = self._time_budget(started)
        per_epoch = steps_per_epoch(len(self.batches.epoch(0)), t.grad_accum)
        tokens = sum(map(self.inputs.source.length, self.train_idx))
        self.schedule = Schedule.of(t, per_epoch, tokens, self.state.budget_s)

    def _time_budget(self, started: float) -> float | None:
        """The steps' seconds, the same on every rank (`schedule.time_budget`); under
        training.total_minutes after the final held-out pass, estimated now."""
        t = self.config.training
        held_out = 0.0
        if t.total_minutes is not None and self.eval_idx:
            held_out = self.held_out.seconds()

        def mean(x: float) -> float:
            return float(self.accelerator.reduce(torch.tensor(x, device=self.device), "mean"))

        return time_budget(t, time.perf_counter() - started, held_out, mean)

    def _unwrapped(self) -> nn.Module:
        """The kind's objective without DDP/FSDP or compile wrappers (eager)."""
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    # -- state -------------------------------------------------------------

    def _resume(self) -> None:
        found = ckpt.list_checkpoints(self.out / "checkpoints")
        if not found:
            raise UserError(
                f"--resume: no checkpoint under {self.out / 'checkpoints'}; start without --resume"
            )
        state = ckpt.load_checkpoint(found[-1], self.draft, self.optimizer)
        if saved_config(state["recipe"], str(found[-1])) != self.config:
            raise UserError(
                f"--resume: {found[-1]} was written with another recipe; resume with the same "
                f"recipe and overrides (see {self.out / 'recipe.yaml'})"
            )
        self.state = TrainState(**state["position"])
        self.history = ckpt.read_history(self.out, self.state.step)
        log.info("resumed from %s at step %d", found[-1], self.state.step)

    def _save(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Write a checkpoint; returns the gathered state, so the final write reuses it."""
        full = ckpt.full_state(self.draft, self.optimizer)  # every rank: FSDP gathers shards
        if self.accelerator.is_main_process:
            state = {"position": dataclasses.asdict(self.state), "recipe": self.config.to_dict()}
            ckpt.save_checkpoint(
                self.out / "checkpoints", self.state.step, full, self.draft.config.to_dict(),
                state, self.config.training.keep_last,
            )  # fmt: skip
            ckpt.write_history(self.out, self.history)
        self.accelerator.wait_for_everyone()
        return full

    # -- steps -------------------------------------------------------------

    def _teacher(
        self, batch: Any, last_hidden: torch.Tensor, training: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs, argmax). A loss that trains every position needs no full-vocab argmax:
        training then skips that product (its logged hits count the in-vocab argmax);
        held-out metrics always use the full one."""
        memo = self.argmax_memo
        full = not training or not self.config.training.train_oov
        known = memo.lookup(batch) if memo is not None and full else None
        device = self.device
        probs, argmax = teacher_targets(
            last_hidden.to(device), self.lm_head, self.d2t,
            known_argmax=None if known is None else known.to(device), full_argmax=full,
        )  # fmt: skip
        if memo is not None and known is None and full:
            memo.store(batch, argmax)
        return probs, argmax

    def _forward(self, batch: Any, norm: torch.Tensor) -> tuple[torch.Tensor, StepStats]:
        device = self.device
        aux, last_hidden = features(self.inputs, batch)
        probs, argmax = self._teacher(batch, last_hidden)
        documents = None if batch.documents is None else batch.documents.to(device)
        with self.autocast():
            return self.model(
                batch.input_ids.to(device), aux.to(device), batch.loss_mask.to(device),
                probs, argmax, norm, documents=documents,
            )  # fmt: skip

    def _micro_batches(self) -> list[Any]:
        """This rank's share of the next `grad_accum` global batches (advancing epochs)."""
        s, accum = self.state, self.config.training.grad_accum
        if s.batch + accum > len(self.batches.epoch(s.epoch)):
            s.epoch, s.batch = s.epoch + 1, 0  # the epoch's last whole optimizer step is done
        return self.batches.micro_batches(s.epoch, s.batch, self.accelerator.process_index)

    def _finished(self) -> bool:
        """The schedule's end; time is each rank's own, so all stop on the first late one."""
        s = self.state
        if self.schedule.spent(s.step, s.tokens):
            return True
        if self.schedule.budget_s is None:
            return False
        late = torch.tensor(float(self.schedule.late(s.seconds)), device=self.device)
        return bool(self.accelerator.reduce(late, "sum") > 0)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum` micro-batches; returns its metrics."""
        t, s = self.config.training, self.state
        lr = self.schedule.learning_rate(s.step, s.tokens, s.seconds)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = self._micro_batches()
        norm = sum(step_counts(b.loss_mask, t.ttt_steps, b.documents) for b in batches)
        norm = norm.to(self.device)
        norm = self.accelerator.reduce(norm, "sum") / self.accelerator.num_processes
        total = StepStats.zeros(1, t.ttt_steps, self.device)
        losses = []
        tokens = 0
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(self.model):
                loss, stats = self._forward(batch, norm)
                self.accelerator.backward(loss)
            losses.append(loss.detach())
            tokens += batch.num_tokens
            total.add_(stats)
        grad_norm = self.accelerator.clip_grad_norm_(self.params, t.grad_clip)
        finite = torch.isfinite(torch.stack(losses).sum()) & torch.isfinite(grad_norm)
        bad = self.accelerator.reduce((~finite).float().to(self.device), "sum") > 0
        if bad:
            self.state.skipped_nan_steps += 1
            self.state.bad_in_row += 1
        else:
            self.optimizer.step()
            self.state.bad_in_row = 0
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.batch += t.grad_accum
        self.state.tokens += int(
            self.accelerator.reduce(torch.tensor(tokens, device=self.device), "sum")
        )
        if self.state.bad_in_row >= t.max_bad_steps:
            raise UserError(
                f"the loss was not finite in {t.max_bad_steps} optimizer steps in a row (up to "
                f"step {self.state.step}); lower training.lr, check the data or hidden-state "
                "cache for NaN/inf, or raise training.max_bad_steps"
            )
        metrics = summarize(total.map(lambda x: self.accelerator.reduce(x, "sum")), t.ttt_decay)
        metrics.update(lr=lr, grad_norm=float(grad_norm), skipped=float(bad))
        return metrics

    @torch.no_grad()
    def _held_out_stats(self, rows: list[int]) -> StepStats:
        """Per-conversation stats of these held-out rows: the whole teacher, every position
        the draft vocab can hit, eval_ttt_steps deep, eager (`HeldOut`'s score)."""
        batch = self.inputs.source.batch(rows)
        aux, last_hidden = features(self.inputs, batch)
        probs, argmax = self._teacher(batch, last_hidden, training=False)
        with self.autocast():
            _, stats = self._unwrapped()(
                batch.input_ids.to(self.device), aux.to(self.device),
                batch.loss_mask.to(self.device), probs, argmax,
                steps=self.config.training.eval_ttt_steps, train_oov=False,
            )  # fmt: skip
        return stats

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, acc_j, both acceptance lengths with bootstrap 95% intervals."""
        return self.held_out.metrics(self.config.training.ttt_decay)

    def held_out_per_sample(self) -> StepStats:
        """Per-conversation held-out sums (`HeldOut.per_sample`), for a paired comparison."""
        return self.held_out.per_sample()

    # -- the loop ----------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train until the schedule ends, evaluating and saving on the way; the final
        checkpoint, draft and metrics.json once it has."""
        from tqdm.auto import tqdm

        t = self.config.training
        self._start()
        bar = tqdm(total=self.schedule.total, initial=self.state.step, desc="train", unit="step",
                   disable=not self.accelerator.is_main_process)  # fmt: skip
        start, start_tokens = time.perf_counter(), self.state.tokens
        eval_metrics: dict[str, float] = {}
        finished = self._finished()
        saved = None  # the state the last checkpoint gathered
        while not finished:
            step_start = time.perf_counter()
            metrics = self.train_step()
            self.state.seconds += time.perf_counter() - step_start
            step = self.state.step
            finished = self._finished()
            speed = (self.state.tokens - start_tokens) / (time.perf_counter() - start)
            metrics["tokens_per_s"] = speed
            self.history.append({"step": step, "loss": metrics["loss"], "lr": metrics["lr"]})
            bar.total = self.schedule.end_step(step, self.state.tokens, self.state.seconds)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc_0']:.2f}",
                            tok_s=f"{speed:.0f}")  # fmt: skip
            if step % t.log_every == 0 or finished:
                self.accelerator.log({f"train/{k}": v for k, v in metrics.items()}, step=step)
            if (t.eval_every and step % t.eval_every == 0) or finished:
                eval_metrics = self.evaluate() if self.eval_idx else {}
                self.accelerator.log({f"eval/{k}": v for k, v in eval_metrics.items()}, step=step)
                if eval_metrics and self.accelerator.is_main_process:
                    log.info("step %d held-out %s", step, format_metrics(eval_metrics))
            if (t.save_every and step % t.save_every == 0) or finished:
                saved = self._save()
        bar.close()
        elapsed = time.perf_counter() - start
        result = self._result(
            eval_metrics, elapsed, (self.state.tokens - start_tokens) / max(elapsed, 1e-9)
        )
        if finished:  # a run resumed after its end saves nothing in the loop
            tensors, _ = saved or ckpt.full_state(self.draft, self.optimizer)
            if self.accelerator.is_main_process:
                self._write_final(tensors, eval_metrics)
                write_text(self.out / "metrics.json", json.dumps(result, indent=2))
        self._close()
        return result

    def _start(self) -> None:
        """The run folder's recipe and vocabulary, and the trackers."""
        c = self.config
        if self.accelerator.is_main_process:
            write_text(self.out / "recipe.yaml", dump_config(c))
            save_run_vocab(self.out, self.vocab, self.vocab_report)
        if c.tracking.report_to != "none":
            self.accelerator.init_trackers(
                c.tracking.project,
                config=c.flat(),
                init_kwargs={"wandb": {"name": c.tracking.run_name, "dir": str(self.out)}},
            )

    def _result(self, held_out: dict[str, float], seconds: float, speed: float) -> dict[str, Any]:
        """What `run` returns and metrics.json holds: the last held-out metrics and the run's."""
        steps = self.config.training.eval_ttt_steps
        return {
            **held_out,
            "acc": [held_out[f"acc_{j}"] for j in range(steps) if held_out],
            "steps": self.state.step,
            "trained_tokens": self.state.tokens,
            "train_seconds": seconds,
            "tokens_per_s": speed,
            "precision": "bf16" if self.dtype == torch.bfloat16 else "fp32",
            "skipped_nan_steps": self.state.skipped_nan_steps,
            "skipped_masked_samples": self.skipped_masked,
            "train_samples": len(self.train_idx),
            "eval_samples": len(self.eval_idx),
            "vocab": self.vocab_report,
            **self.inputs.identity,
        }

    def _close(self) -> None:
        """Meet the other ranks, then free the process group while nothing else holds it.

        Its gloo threads must be joined here, by this thread, while the interpreter lives.
        torch 2.13's `ProcessGroupGloo` destructor joins its workers while it holds the GIL,
        and a worker freeing a finished collective's Python tensors needs the GIL: one
        2-process run in ~20 hung so when DDP's reducer was collected. A group that outlives
        this call (held by a cycle collected later) dies in interpreter exit instead, where
        such a worker aborts the process ("terminate called without an active exception").
        So every holder goes first, cycles included; the last barrier's work is freed by
        this thread after the group.
        """
        last = None
        if self.accelerator.num_processes > 1:
            last = torch.distributed.barrier(async_op=True)
            last.wait()
        self.model = self.optimizer = None  # DDP's reducer holds the process group
        self.accelerator.free_memory()
        gc.collect()  # free_memory collects before it drops its own references to the model
        self.accelerator.end_training()  # destroys the group: its workers are joined here
        del last

    def _write_final(self, tensors: dict[str, torch.Tensor], held_out: dict[str, Any]) -> None:
        """The deployable draft in its kind's layout (EAGLE-3: `eagle`), with d2t/t2d, and the acceptance its
        held-out pass recorded, which `doctor` holds a converted copy against."""
        from eagletools.formats import Checkpoint, save_checkpoint
        from eagletools.formats.checks import read_draft, static_findings
        from eagletools.formats.record import RECORD, record_from_metrics, record_text

        record = record_from_metrics(held_out, self.draft.config.to_dict())
        layout = KINDS[self.draft.config.kind].layouts[0]
        final = save_checkpoint(
            Checkpoint(layout, self.draft.config, tensors, str(self.out / "checkpoints")),
            self.out / "final",
            layout,
            overwrite=True,
            extra_files={RECORD: record_text(record)} if record else None,
        )
        errors = [f.line() for f in static_findings(read_draft(final)) if f.level == "error"]
        if errors:  # doctor's static checks on what a user would deploy (a NaN, a field)
            raise UserError(
                f"{final}: the trained draft fails doctor's checks:\n  " + "\n  ".join(errors)
            )


def train(
    config: TrainConfig,
    output_dir: str | Path,
    *,
    resume: bool = False,
    target: Any = None,
    dataset: Any = None,
) -> dict[str, Any]:
    """Train a draft per `config` into `output_dir`; returns the final metrics. The data
    stages a recipe asks for run first (`inputs.staged_inputs`); `target`/`dataset` skip
    loading them (tests, notebooks)."""
    started = time.perf_counter()  # training.total_minutes counts from here
    config, inputs = staged_inputs(config, Path(output_dir), target, dataset)
    return Trainer(config, output_dir, inputs, resume=resume, started=started).run()
