"""The training loop: one process on CPU, DDP/FSDP on GPUs, through accelerate.

The samples, aux states and teacher come from `train.inputs` (online or from a
hidden-state cache); either way the teacher is the target's `lm_head` over the
draft-vocab rows only, and the loss is the training-time-test unroll.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagletools.atomic import atomic_file, write_text
from eagletools.compiling import require_cpu_compiler
from eagletools.data.jobs import DataJob
from eagletools.errors import UserError
from eagletools.stages import run_stages
from eagletools.train import checkpoint as ckpt
from eagletools.train.data import (
    ArgmaxMemo,
    epoch_rows,
    even_shards,
    split_indices,
    steps_per_epoch,
    trainable,
)
from eagletools.train.inputs import (
    TrainInputs,
    cache_job,
    features,
    load_teacher,
    offline_inputs,
    online_inputs,
    regeneration_job,
    training_dtype,
    vocab_counts,
)
from eagletools.train.recipe import TrainConfig, dump_config
from eagletools.train.schedule import lr_factor, step_seconds_budget
from eagletools.train.ttt import (
    StepStats,
    TTTModel,
    format_metrics,
    held_out_metrics,
    step_counts,
    summarize,
    teacher_targets,
)
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
        self._setup_schedule()
        self.state = TrainState(skipped_masked_samples=self.skipped_masked)
        self.history: list[dict[str, float]] = []
        if resume:
            self._resume()
        elif ckpt.list_checkpoints(self.out / "checkpoints"):
            raise UserError(
                f"{self.out} already holds a training run; pass --resume to continue it "
                "or choose another --output-dir"
            )
        if self.state.budget_s is None:
            self.state.budget_s = self._time_budget(started)

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
        self.global_batch = t.batch_size * self.accelerator.num_processes
        if len(self.train_idx) < self.global_batch * t.grad_accum:
            raise UserError(
                f"{c.data.train}: {len(self.train_idx)} training samples are fewer than one "
                f"optimizer step takes ({self.global_batch * t.grad_accum} = training.batch_size "
                "x training.grad_accum x processes); use more data or a smaller "
                "training.batch_size"
            )
        v, counted = c.vocab, self.train_idx[: c.vocab.count_samples]
        count = functools.partial(vocab_counts, self.inputs, counted, v.count, self.accelerator)
        self.vocab, self.vocab_report = run_vocab(
            self.out, path=v.path, size=v.draft_vocab_size, count=count,
            num_samples=len(counted), counted_by=v.count,
        )  # fmt: skip

    def _setup_model(self) -> TTTModel:
        """The draft, sized and initialised from the target, in its training-time-test unroll."""
        from eagletools.draft import Eagle3Draft

        d, t, head_model = self.config.draft, self.config.training, self.inputs.head_model
        draft = Eagle3Draft.from_target(
            head_model,
            self.vocab,
            aux_layer_ids=self.inputs.aux_layer_ids,
            init_head_from_target=d.init_head_from_target,
            norm_before_residual=d.norm_before_residual,
            fc_norm=d.fc_norm,
            norm_output=d.norm_output,
            intermediate_size=d.intermediate_size or head_model.config.intermediate_size,
            num_hidden_layers=d.num_hidden_layers,
        )
        # frozen, so kept in the target's dtype: `from_target` widens a bf16 target's rows to
        # fp32, the same values in twice the bytes (1 GB a process at Llama-3.1-8B's 525M)
        draft.embed_tokens.to(head_model.get_input_embeddings().weight.dtype)
        if d.freeze_head:  # the target's rows, frozen; the norm (at 1) learns the scale
            with torch.no_grad():
                draft.lm_head.weight.copy_(self.inputs.lm_head_weight[self.vocab.selected])
            draft.lm_head.weight.requires_grad_(False)
        return TTTModel(draft, t.ttt_steps, t.ttt_decay, t.attn_chunk, t.drop_missed, t.train_oov)

    def _setup_optimizer(self, model: TTTModel) -> None:
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
        """The target's lm_head on this device; offline, a memo of each sample's argmax."""
        self.lm_head = self.inputs.lm_head_weight.to(self.device)
        self.d2t = self.draft.d2t
        # offline the hidden states repeat every epoch, so their argmax does too
        self.argmax_memo = ArgmaxMemo() if self.inputs.target_model is None else None

    def _setup_schedule(self) -> None:
        """Total optimizer steps and warmup steps of the learning-rate schedule; a packed
        epoch's row count varies a little with its shuffle, and the first one's stands in."""
        t = self.config.training
        self._plan: tuple[int, list[list[list[int]]]] | None = None  # (epoch, its batches)
        per_epoch = steps_per_epoch(len(self._epoch_plan(0)), t.grad_accum)
        epochs = t.num_epochs
        if t.max_tokens is not None:  # the epochs it fills (the bar, warmup_ratio)
            epochs = t.max_tokens / max(1, sum(map(self.inputs.source.length, self.train_idx)))
        self.total = t.max_steps or max(1, math.ceil(per_epoch * epochs))
        self.warmup = (
            t.warmup_steps if t.warmup_steps is not None else round(t.warmup_ratio * self.total)
        )

    def _unwrapped(self) -> TTTModel:
        """The TTT model without DDP/FSDP or compile wrappers (eager)."""
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    # -- state -------------------------------------------------------------

    def _resume(self) -> None:
        found = ckpt.list_checkpoints(self.out / "checkpoints")
        if not found:
            raise UserError(
                f"--resume: no checkpoint under {self.out / 'checkpoints'}; start without --resume"
            )
        state = ckpt.load_checkpoint(found[-1], self.draft, self.optimizer)
        if state["recipe"] != self.config.to_dict():
            raise UserError(
                f"--resume: {found[-1]} was written with another recipe; resume with the same "
                f"recipe and overrides (see {self.out / 'recipe.yaml'})"
            )
        self.state = TrainState(**state["position"])
        self.history = [h for h in self._read_history() if h["step"] <= self.state.step]
        log.info("resumed from %s at step %d", found[-1], self.state.step)

    def _read_history(self) -> list[dict[str, float]]:
        path = self.out / "train_log.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def _save(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Write a checkpoint; returns the gathered state, so the final write reuses it."""
        full = ckpt.full_state(self.draft, self.optimizer)  # every rank: FSDP gathers shards
        if self.accelerator.is_main_process:
            state = {"position": dataclasses.asdict(self.state), "recipe": self.config.to_dict()}
            ckpt.save_checkpoint(
                self.out / "checkpoints", self.state.step, full, self.draft.config.to_dict(),
                state, self.config.training.keep_last,
            )  # fmt: skip
            with atomic_file(self.out / "train_log.jsonl") as tmp:
                tmp.write_text("".join(json.dumps(h) + "\n" for h in self.history))
        self.accelerator.wait_for_everyone()
        return full

    # -- steps -------------------------------------------------------------

    def _teacher(
        self, batch: Any, last_hidden: torch.Tensor, training: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs, argmax); the recipe's sharper teacher in training only, so held-out
        losses compare across runs. A loss that trains every position needs no
        full-vocab argmax: training then skips that product (its logged hits count
        the in-vocab argmax); held-out metrics always use the full one."""
        t, memo = self.config.training, self.argmax_memo
        full = not training or t.drop_missed or not t.train_oov
        known = memo.lookup(batch) if memo is not None and full else None
        device = self.device
        probs, argmax = teacher_targets(
            last_hidden.to(device), self.lm_head, self.d2t,
            known_argmax=None if known is None else known.to(device),
            temperature=t.teacher_temperature if training else 1.0,
            argmax_weight=t.teacher_argmax_weight if training else 0.0,
            full_argmax=full,
            topk=t.teacher_topk if training else 0,
        )  # fmt: skip
        if memo is not None and known is None and full:
            memo.store(batch, argmax)
        return probs, argmax

    def _forward(
        self, batch: Any, norm: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, StepStats]:
        device = self.device
        aux, last_hidden = features(self.inputs, batch)
        probs, argmax = self._teacher(batch, last_hidden)
        documents = None if batch.documents is None else batch.documents.to(device)
        with self.autocast():
            return self.model(
                batch.input_ids.to(device), aux.to(device), batch.loss_mask.to(device),
                probs, argmax, norm, steps=depth, documents=documents,
            )  # fmt: skip

    def _depth(self) -> int:
        """The unroll's steps now: training.ttt_steps, or fewer early under training.ttt_ramp
        (a function of the schedule's progress, so a resumed run unrolls as the first)."""
        t = self.config.training
        if t.ttt_ramp == 0:
            return t.ttt_steps
        reached = math.floor(max(0.0, self._progress()) * t.ttt_steps / t.ttt_ramp)
        return min(t.ttt_steps, 1 + reached)

    def _epoch_plan(self, epoch: int) -> list[list[list[int]]]:
        """The epoch's global batches of rows (positions into `train_idx`: one per row, or
        packed), planned once per epoch rather than per step."""
        if self._plan is None or self._plan[0] != epoch:
            t = self.config.training
            lengths = [self.inputs.source.length(i) for i in self.train_idx]
            plan = epoch_rows(lengths, self.global_batch, t.pack_tokens, t.seed, epoch,
                              t.bucket_size)  # fmt: skip
            self._plan = (epoch, plan)
        return self._plan[1]

    def _micro_batches(self) -> list[Any]:
        """This rank's share of the next `grad_accum` global batches (advancing epochs)."""
        t = self.config.training
        if self.state.batch + t.grad_accum > len(self._epoch_plan(self.state.epoch)):
            self.state.epoch += 1  # the epoch's last whole optimizer step is done
            self.state.batch = 0
        plan = self._epoch_plan(self.state.epoch)
        start, rank = self.state.batch, self.accelerator.process_index
        out = []
        for global_batch in plan[start : start + t.grad_accum]:
            mine = global_batch[rank * t.batch_size : (rank + 1) * t.batch_size]
            rows = [[self.train_idx[i] for i in row] for row in mine]
            batch = self.inputs.source.pack(rows, t.pack_tokens or None)
            if t.loss_on == "all":  # the teacher is the target's distribution there too
                batch = dataclasses.replace(batch, loss_mask=batch.attention_mask)
            out.append(batch)
        return out

    def _progress(self) -> float:
        """Share of the schedule done: the largest of the steps (unless training.max_tokens
        alone ends the run), the time (`_time_budget`) and the tokens."""
        t, s = self.config.training, self.state
        shares = [s.seconds / s.budget_s] if s.budget_s is not None else []
        shares += [s.tokens / t.max_tokens] if t.max_tokens is not None else []
        if t.max_tokens is None or t.max_steps is not None:
            shares.append((s.step - self.warmup) / max(1, self.total - self.warmup))
        return max(shares)

    def _finished(self) -> bool:
        """The first budget spent ends the run: steps (unless training.max_tokens replaces
        them), tokens (a global count), or time on any rank (all ranks stop together)."""
        t, s = self.config.training, self.state
        by_steps = t.max_tokens is None or t.max_steps is not None
        if (by_steps and s.step >= self.total) or s.tokens >= (t.max_tokens or math.inf):
            return True
        if s.budget_s is None:
            return False
        late = torch.tensor(float(s.seconds >= s.budget_s), device=self.device)
        return bool(self.accelerator.reduce(late, "sum") > 0)

    def _set_lr(self) -> float:
        t = self.config.training
        lr = t.lr * lr_factor(
            self.state.step, self._progress(), self.warmup, t.min_lr_ratio, t.schedule
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(self) -> dict[str, float]:
        t = self.config.training
        lr = self._set_lr()
        batches = self._micro_batches()
        depth = self._depth()
        norm = sum(step_counts(b.loss_mask, depth, b.documents) for b in batches)
        norm = norm.to(self.device)
        norm = self.accelerator.reduce(norm, "sum") / self.accelerator.num_processes
        total = StepStats.zeros(1, depth, self.device)
        losses = []
        tokens = 0
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(self.model):
                loss, stats = self._forward(batch, norm, depth)
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

    def _held_out_chunks(self) -> list[list[int]]:
        """The held-out conversations by length, `eval_batch_size` a forward (little padding)."""
        src, size = self.inputs.source, self.config.training.eval_batch_size
        order = sorted(range(len(self.eval_idx)), key=lambda i: src.length(self.eval_idx[i]))
        return [order[i : i + size] for i in range(0, len(order), size)]

    @torch.no_grad()
    def _held_out_stats(self, chunk: list[int]) -> StepStats:
        t = self.config.training
        batch = self.inputs.source.batch([self.eval_idx[i] for i in chunk])
        aux, last_hidden = features(self.inputs, batch)
        probs, argmax = self._teacher(batch, last_hidden, training=False)
        with self.autocast():
            _, stats = self._unwrapped()(
                batch.input_ids.to(self.device), aux.to(self.device),
                batch.loss_mask.to(self.device), probs, argmax, steps=t.eval_ttt_steps,
                drop_missed=False, train_oov=False,
            )  # fmt: skip
        return stats

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, acc_j, simulated and exact acceptance length, each length with a
        bootstrap 95% interval over the held-out conversations (sharded over ranks)."""
        start = time.perf_counter()
        metrics = held_out_metrics(self.held_out_per_sample(), self.config.training.ttt_decay)
        return {**metrics, "eval_seconds": time.perf_counter() - start}

    def held_out_per_sample(self) -> StepStats:
        """Per-conversation held-out sums, every rank's rows: what `evaluate` summarises,
        and what a paired comparison of two drafts resamples (ttt.paired_difference)."""
        total = StepStats.zeros(len(self.eval_idx), self.config.training.eval_ttt_steps,
                                self.device)  # fmt: skip
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        for chunk, counted in even_shards(self._held_out_chunks(), rank, world):
            stats = self._held_out_stats(chunk)
            if counted:
                total.add_(stats, torch.tensor(chunk, device=self.device))
        return total.map(lambda x: self.accelerator.reduce(x, "sum"))

    def _time_budget(self, started: float) -> float | None:
        """The steps' seconds (`schedule.step_seconds_budget`), the same on every rank. Under
        training.total_minutes the final held-out pass is estimated from its longest batch
        timed now, scaled by tokens: an overestimate, since shorter rows cost less a token."""
        t = self.config.training
        held_out = 0.0
        if t.total_minutes is not None and self.eval_idx:
            chunks, src = self._held_out_chunks(), self.inputs.source
            begun = time.perf_counter()
            float(self._held_out_stats(chunks[-1]).count.sum())  # a host read: GPUs finish first
            tokens = [sum(src.length(self.eval_idx[i]) for i in c) for c in chunks]
            world = self.accelerator.num_processes
            held_out = (time.perf_counter() - begun) * sum(tokens) / tokens[-1] / world
        budget = step_seconds_budget(t.max_minutes, t.total_minutes,
                                     time.perf_counter() - started, held_out)  # fmt: skip
        if budget is None:
            return None
        budget = float(self.accelerator.reduce(torch.tensor(budget, device=self.device), "mean"))
        if budget <= 0:
            raise UserError(
                f"training.total_minutes={t.total_minutes}: the data stages and set-up took "
                f"{(time.perf_counter() - started) / 60:.1f} minutes and the held-out pass "
                f"needs ~{held_out / 60:.1f}, leaving no time to train; raise "
                "training.total_minutes or lower data.num_samples (or data.eval_samples)"
            )
        if t.total_minutes is not None:
            log.info("training.total_minutes=%s: %.1f minutes of training steps (held-out "
                     "pass ~%.1f)", t.total_minutes, budget / 60, held_out / 60)  # fmt: skip
        return budget

    # -- the loop ----------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        t, c = self.config.training, self.config
        if self.accelerator.is_main_process:
            write_text(self.out / "recipe.yaml", dump_config(c))
            save_run_vocab(self.out, self.vocab, self.vocab_report)
        if c.tracking.report_to != "none":
            self.accelerator.init_trackers(
                c.tracking.project,
                config=c.flat(),
                init_kwargs={"wandb": {"name": c.tracking.run_name, "dir": str(self.out)}},
            )
        bar = tqdm(total=self.total, initial=self.state.step, desc="train", unit="step",
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
        per_step = [eval_metrics[f"acc_{j}"] for j in range(t.eval_ttt_steps) if eval_metrics]
        result = {
            **eval_metrics,
            "acc": per_step,
            "steps": self.state.step,
            "trained_tokens": self.state.tokens,
            "train_seconds": elapsed,
            "tokens_per_s": (self.state.tokens - start_tokens) / max(elapsed, 1e-9),
            "precision": "bf16" if self.dtype == torch.bfloat16 else "fp32",
            "skipped_nan_steps": self.state.skipped_nan_steps,
            "skipped_masked_samples": self.skipped_masked,
            "train_samples": len(self.train_idx),
            "eval_samples": len(self.eval_idx),
            "vocab": self.vocab_report,
            **self.inputs.identity,
        }
        if finished:  # a run resumed after its end saves nothing in the loop
            tensors, _ = saved or ckpt.full_state(self.draft, self.optimizer)
            if self.accelerator.is_main_process:
                self._write_final(tensors)
                write_text(self.out / "metrics.json", json.dumps(result, indent=2))
        self._close()
        return result

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

    def _write_final(self, tensors: dict[str, torch.Tensor]) -> None:
        """The deployable draft in the `eagle` format, with d2t/t2d."""
        from eagletools.formats import Checkpoint, save_checkpoint

        source = str(self.out / "checkpoints")
        save_checkpoint(
            Checkpoint("eagle", self.draft.config, tensors, source),
            self.out / "final",
            "eagle",
            overwrite=True,
        )


def train(
    config: TrainConfig,
    output_dir: str | Path,
    *,
    resume: bool = False,
    target: Any = None,
    dataset: Any = None,
) -> dict[str, Any]:
    """Train a draft per `config` into `output_dir`; returns the final metrics.

    The data stages run first, each skipped once its output is complete and made with
    the same settings: the target's own replies (data.regenerate), then the hidden-state
    cache (data.offline). `target`/`dataset` skip loading them (tests, notebooks).
    """
    from eagletools.data.regenerate import parts_dir

    started = time.perf_counter()  # training.total_minutes counts from here
    out, d = Path(output_dir), config.data
    jobs: list[DataJob] = []
    if d.regenerate.enabled and not d.hidden_states:
        if dataset is not None:
            raise UserError(
                "data.regenerate rewrites the replies of the conversations in data.train, but "
                "a tokenised dataset was passed: pass the conversations as data.train instead, "
                "or set data.regenerate.enabled=false"
            )
        jobs.append(regeneration_job(config, out / "regenerated.jsonl"))
        config = copy.deepcopy(config)
        config.data.train = str(jobs[0].output)  # train on the regenerated conversations
    cache = config.data.hidden_states
    if config.data.offline and not cache:
        captured = parts_dir(jobs[0].output) if jobs else None
        jobs.append(cache_job(config, out / "hidden-states", captured, dataset))
        cache = jobs[-1].output
    load = functools.cache(lambda: target or load_teacher(config))  # only when a stage needs it
    run_stages([job.stage(load) for job in jobs])
    inputs = offline_inputs(config, cache) if cache else online_inputs(config, load(), dataset)
    return Trainer(config, out, inputs, resume=resume, started=started).run()
