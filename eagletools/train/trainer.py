"""The training loop: one process on CPU, DDP/FSDP on GPUs, through accelerate.

Online, the target runs in the loop (no grad) and yields the aux states and
last hidden state per batch; offline, both come memory-mapped from a
hidden-state cache. Either way the teacher is the target's `lm_head` over
the draft-vocab rows only, and the loss is the training-time-test unroll.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagletools.atomic import atomic_file, write_text
from eagletools.compiling import require_cpu_compiler
from eagletools.data.batch import SampleSource
from eagletools.errors import UserError
from eagletools.stages import Stage, run_stages
from eagletools.train import checkpoint as ckpt
from eagletools.train.data import (
    ArgmaxMemo,
    TokenSamples,
    plan_epoch,
    split_indices,
    steps_per_epoch,
    total_steps,
    trainable,
)
from eagletools.train.recipe import TrainConfig, dump_config
from eagletools.train.ttt import (
    StepStats,
    TTTModel,
    bootstrap_intervals,
    step_counts,
    summarize,
    target_argmax,
    teacher_targets,
)

log = logging.getLogger(__name__)


@dataclass
class TrainInputs:
    """Where samples, aux states and the teacher come from."""

    source: SampleSource
    head_model: torch.nn.Module  # a target (or a skeleton of one) to size the draft from
    lm_head_weight: torch.Tensor  # [V, Ht]
    aux_layer_ids: list[int]
    target_model: torch.nn.Module | None  # online: runs per batch; offline: None
    identity: dict[str, Any]


def lr_factor(
    step: int, progress: float, warmup_steps: int, min_ratio: float, schedule: str = "cosine"
) -> float:
    """Linear warmup over `warmup_steps`, then a cosine or linear decay over `progress`
    in [0, 1]."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    done = min(1.0, progress)
    decay = 0.5 * (1 + math.cos(math.pi * done)) if schedule == "cosine" else 1 - done
    return min_ratio + (1 - min_ratio) * decay


def online_inputs(config: TrainConfig, target: Any = None, dataset: Any = None) -> TrainInputs:
    """The target in the loop; samples from the prepared (tokenised) dataset."""
    from eagletools.data import prepare_dataset
    from eagletools.target import resolve_aux_layer_ids

    if target is None:
        target = load_teacher(config)
    if dataset is None:
        d = config.data
        dataset = prepare_dataset(
            config.target.spec, d.train, d.max_length, d.num_samples,
            chat_template=d.chat_template, tokenizer=target.tokenizer, hub=d.hub(),
        )  # fmt: skip
    model = target.model
    layer_ids = resolve_aux_layer_ids(config.target.aux_layer_ids, target.info.num_layers)
    return TrainInputs(
        source=TokenSamples(dataset),
        head_model=model,
        lm_head_weight=model.get_output_embeddings().weight.detach(),
        aux_layer_ids=list(layer_ids),
        target_model=model,
        identity={"target": target.info.name_or_path, "mode": "online"},
    )


def offline_inputs(config: TrainConfig, path: str | Path | None = None) -> TrainInputs:
    from eagletools.data.hidden_states import HiddenStateCache

    cache = HiddenStateCache.open(path or config.data.hidden_states)
    cache.check_target(config.target.spec)
    if config.target.aux_layer_ids is not None:
        cache.check_layers(config.target.aux_layer_ids, source="target.aux_layer_ids")
    skeleton = cache.target_skeleton()
    head = skeleton.get_output_embeddings().weight.detach()  # as the cache stored it
    return TrainInputs(
        source=cache,
        head_model=skeleton,
        lm_head_weight=head.to(teacher_dtype(config)),
        aux_layer_ids=cache.aux_layer_ids,
        target_model=None,
        identity={"target": cache.manifest["target"]["name_or_path"], "mode": "offline"},
    )


def features(inputs: TrainInputs, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B,T,A*Ht], last_hidden [B,T,Ht]) for a batch."""
    if inputs.target_model is None:
        return batch.aux, batch.last_hidden
    from eagletools.target import capture_aux

    out = capture_aux(
        inputs.target_model, batch.input_ids, batch.attention_mask, inputs.aux_layer_ids
    )
    return out.aux, out.last_hidden


def build_vocab_for(
    config: TrainConfig, inputs: TrainInputs, train_idx: list[int], out: Path, accelerator: Any
):
    """The draft vocabulary: a given file, the one of a resumed run, or counted now."""
    from eagletools.vocab import DraftVocab, count_tokens, vocab_from_counts

    saved = out / "vocab.safetensors"
    if config.vocab.path:
        return DraftVocab.load(config.vocab.path), {"path": config.vocab.path}
    if saved.is_file():
        return DraftVocab.load(saved), json.loads((out / "vocab_report.json").read_text())
    import datasets

    src, v = inputs.source, config.vocab
    counted = train_idx[: v.count_samples]
    vocab_size = inputs.lm_head_weight.shape[0]
    size = min(v.draft_vocab_size, vocab_size)
    if v.count == "target_argmax":
        counts = argmax_counts(inputs, counted, accelerator)
    else:
        rows = {
            "input_ids": [src.batch([i]).input_ids[0].tolist() for i in counted],
            "loss_mask": [src.loss_mask(i).tolist() for i in counted],
        }
        counts = count_tokens(datasets.Dataset.from_dict(rows), vocab_size)
    vocab, report = vocab_from_counts(counts, size, len(counted))
    return vocab, {**report, "count": v.count}


@torch.no_grad()
def argmax_counts(
    inputs: TrainInputs, indices: list[int], accelerator: Any, batch_size: int = 8
) -> torch.Tensor:
    """Counts [V] of the target's argmax at the positions whose next token is a reply
    token: what the draft must predict there. Sharded over the processes."""
    src, device = inputs.source, accelerator.device
    lm_head = inputs.lm_head_weight.to(device)
    counts = torch.zeros(lm_head.shape[0], dtype=torch.long, device=device)
    order = sorted(indices, key=src.length)[accelerator.process_index :: accelerator.num_processes]
    for start in range(0, len(order), batch_size):
        batch = src.batch(order[start : start + batch_size])
        _, last_hidden = features(inputs, batch)
        best = target_argmax(last_hidden.flatten(0, 1).to(device), lm_head)
        before_reply = _shift_left(batch.loss_mask.bool().to(device))
        counts += torch.bincount(best[before_reply.flatten()], minlength=counts.numel())
    return accelerator.reduce(counts, "sum").cpu()


def _shift_left(mask: torch.Tensor) -> torch.Tensor:
    """mask [B,T] -> [B,T] true at t where mask[t+1] is."""
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


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
    seconds: float = 0.0


class Trainer:
    """One training run; `run()` returns the final held-out metrics."""

    def __init__(
        self, config: TrainConfig, output_dir: str | Path, inputs: TrainInputs, resume: bool = False
    ):
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
            log.warning(
                "skipped %d samples whose every token is masked out of the loss",
                self.skipped_masked,
            )
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
        self._plan: tuple[int, list[list[int]]] | None = None  # (epoch, its global batches)
        self.vocab, self.vocab_report = build_vocab_for(
            c, self.inputs, self.train_idx, self.out, self.accelerator
        )

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
        )
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
                ns_dtype=fast_matmul_dtype(self.device),  # the demo's: 0.26 s bf16, 0.49 fp32 (Zen 4)
            )  # fmt: skip
        else:
            optimizer = torch.optim.AdamW(
                trained, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                # one kernel per step instead of ~10 per tensor: 5 vs 31 ms for the SmolLM2
                # draft on CPU
                fused=self.device.type in ("cpu", "cuda"),
            )  # fmt: skip
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # after prepare: FSDP2 swaps every parameter for a new one, and clipping the old
        # objects would see no gradients (docs/design.md, GPU scale)
        self.params = [p for p in self._unwrapped().draft.parameters() if p.requires_grad]
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
        """Total optimizer steps and warmup steps of the learning-rate schedule."""
        t = self.config.training
        self.total = t.max_steps or total_steps(
            len(self.train_idx), self.global_batch, t.grad_accum, t.num_epochs
        )
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
        )  # fmt: skip
        if memo is not None and known is None and full:
            memo.store(batch, argmax)
        return probs, argmax

    def _forward(self, batch: Any, norm: torch.Tensor | None) -> tuple[torch.Tensor, StepStats]:
        device = self.device
        aux, last_hidden = features(self.inputs, batch)
        probs, argmax = self._teacher(batch, last_hidden)
        with self.autocast():
            return self.model(
                batch.input_ids.to(device), aux.to(device), batch.loss_mask.to(device),
                probs, argmax, norm,
            )  # fmt: skip

    def _epoch_plan(self, epoch: int) -> list[list[int]]:
        """The epoch's global batches, planned once per epoch rather than per step."""
        if self._plan is None or self._plan[0] != epoch:
            t = self.config.training
            lengths = [self.inputs.source.length(i) for i in self.train_idx]
            plan = plan_epoch(lengths, self.global_batch, t.seed, epoch, t.bucket_size)
            self._plan = (epoch, plan)
        return self._plan[1]

    def _micro_batches(self) -> list[Any]:
        """This rank's share of the next `grad_accum` global batches (advancing epochs)."""
        t = self.config.training
        per_epoch = steps_per_epoch(len(self.train_idx), self.global_batch, t.grad_accum)
        if self.state.batch >= per_epoch * t.grad_accum:
            self.state.epoch += 1
            self.state.batch = 0
        plan = self._epoch_plan(self.state.epoch)
        start, rank = self.state.batch, self.accelerator.process_index
        out = []
        for global_batch in plan[start : start + t.grad_accum]:
            mine = global_batch[rank * t.batch_size : (rank + 1) * t.batch_size]
            batch = self.inputs.source.batch([self.train_idx[i] for i in mine])
            if t.loss_on == "all":  # the teacher is the target's distribution there too
                batch = dataclasses.replace(batch, loss_mask=batch.attention_mask)
            out.append(batch)
        return out

    def _progress(self) -> float:
        """Share of the schedule done: by steps, or by time under training.max_minutes."""
        t, step = self.config.training, self.state.step
        by_steps = (step - self.warmup) / max(1, self.total - self.warmup)
        if t.max_minutes is None:
            return by_steps
        return max(by_steps, self.state.seconds / (60 * t.max_minutes))

    def _out_of_time(self) -> bool:
        """training.max_minutes reached on any rank (all ranks stop together)."""
        limit = self.config.training.max_minutes
        if limit is None:
            return False
        late = torch.tensor(float(self.state.seconds >= 60 * limit), device=self.device)
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
        norm = sum(step_counts(b.loss_mask, t.ttt_steps) for b in batches).to(self.device)
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
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, acc_j, simulated and exact acceptance length, each length with a
        bootstrap 95% interval over the held-out conversations (sharded over ranks)."""
        t, start = self.config.training, time.perf_counter()
        src = self.inputs.source
        order = sorted(range(len(self.eval_idx)), key=lambda i: src.length(self.eval_idx[i]))
        size = t.eval_batch_size
        chunks = [order[i : i + size] for i in range(0, len(order), size)]
        total = StepStats.zeros(len(order), t.eval_ttt_steps, self.device)
        model = self._unwrapped()
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        for chunk in chunks[rank::world]:
            batch = src.batch([self.eval_idx[i] for i in chunk])
            aux, last_hidden = features(self.inputs, batch)
            probs, argmax = self._teacher(batch, last_hidden, training=False)
            with self.autocast():
                _, stats = model(
                    batch.input_ids.to(self.device), aux.to(self.device),
                    batch.loss_mask.to(self.device), probs, argmax, steps=t.eval_ttt_steps,
                    drop_missed=False, train_oov=False,
                )  # fmt: skip
            total.add_(stats, torch.tensor(chunk, device=self.device))
        per_sample = total.map(lambda x: self.accelerator.reduce(x, "sum"))
        seconds = time.perf_counter() - start
        return {**summarize(per_sample, t.ttt_decay), **bootstrap_intervals(per_sample),
                "eval_seconds": seconds}  # fmt: skip

    # -- the loop ----------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        t, c = self.config.training, self.config
        if self.accelerator.is_main_process:
            write_text(self.out / "recipe.yaml", dump_config(c))
            self.vocab.save(self.out / "vocab.safetensors")
            write_text(self.out / "vocab_report.json", json.dumps(self.vocab_report, indent=2))
        if c.tracking.report_to != "none":
            self.accelerator.init_trackers(
                c.tracking.project,
                config=_flat(c.to_dict()),
                init_kwargs={"wandb": {"name": c.tracking.run_name, "dir": str(self.out)}},
            )
        bar = tqdm(total=self.total, initial=self.state.step, desc="train", unit="step",
                   disable=not self.accelerator.is_main_process)  # fmt: skip
        start, start_tokens = time.perf_counter(), self.state.tokens
        eval_metrics: dict[str, float] = {}
        finished = self.state.step >= self.total
        saved = None  # the state the last checkpoint gathered
        while not finished:
            step_start = time.perf_counter()
            metrics = self.train_step()
            self.state.seconds += time.perf_counter() - step_start
            step = self.state.step
            finished = step >= self.total or self._out_of_time()
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
                    log.info("step %d held-out %s", step, _fmt(eval_metrics))
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


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _fmt(metrics: dict[str, float]) -> str:
    keys = ["loss", "acc_0", "acc_1"]
    out = [f"{k}={metrics[k]:.3f}" for k in keys if k in metrics]
    for name in ("simulated", "exact"):
        key = f"{name}_acceptance_length"
        if key in metrics:
            out.append(f"{key}={metrics[key]:.3f} [{metrics[key + '_lo']:.3f}, "
                       f"{metrics[key + '_hi']:.3f}]")  # fmt: skip
    return " ".join(out)


def train(
    config: TrainConfig,
    output_dir: str | Path,
    *,
    resume: bool = False,
    target: Any = None,
    dataset: Any = None,
) -> dict[str, Any]:
    """Train a draft per `config` into `output_dir`; returns the final metrics.

    The data stages run first, each skipped once its output is complete: the target's
    own replies (data.regenerate), then the hidden-state cache (data.offline).
    `target`/`dataset` skip loading them (tests, notebooks).
    """
    from eagletools.data.hidden_states import HiddenStateCache

    out, d = Path(output_dir), config.data
    regenerating = d.regenerate.enabled and not d.hidden_states
    if regenerating and dataset is not None:
        raise UserError(
            "data.regenerate rewrites the replies of the conversations in data.train, but a "
            "tokenised dataset was passed: pass the conversations as data.train instead, "
            "or set data.regenerate.enabled=false"
        )
    load = functools.cache(lambda: target or load_teacher(config))  # only when a stage needs it
    stages = []
    if regenerating:
        from eagletools.data.regenerate import is_regenerated, parts_dir

        regenerated, identity = out / "regenerated.jsonl", _regeneration_identity(config)
        source = config  # whose conversations get the target's replies

        def regenerate() -> Path:
            return regenerated_data(source, out, load(), capture=source.data.offline)

        done = _agreed(lambda path: is_regenerated(path, identity))
        stages.append(Stage("regenerate", regenerated, regenerate, done))
        config = copy.deepcopy(config)
        config.data.train = str(regenerated)
    cache = config.data.hidden_states
    if config.data.offline and not cache:
        cache = out / "hidden-states"
        captured = parts_dir(regenerated) if regenerating else None
        run = functools.partial(build_cache, config, cache, load, dataset, captured)
        stages.append(Stage("hidden states", cache, run, _agreed(HiddenStateCache.is_complete)))
    run_stages(stages)
    inputs = offline_inputs(config, cache) if cache else online_inputs(config, load(), dataset)
    return Trainer(config, out, inputs, resume=resume).run()


def _agreed(done: Callable[[Path], bool]) -> Callable[[Path], bool]:
    """`done` as the main process answers it: every rank then runs a stage (and its
    collectives) or skips it, even when another rank checks after the main one wrote."""

    def check(path: Path) -> bool:
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([done(path)])[0]

    return check


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """training.precision as the dtype training computes in; `auto` picks the device's faster
    matmuls (the demo's online tokens/s: fp32 at 1.4x bf16's on a Xeon without AMX, bf16 at
    1.7x fp32's on an EPYC)."""
    from eagletools.devices import fast_matmul_dtype

    if precision == "auto":
        return fast_matmul_dtype(device)
    return torch.bfloat16 if precision == "bf16" else torch.float32


def load_teacher(config: TrainConfig) -> Any:
    """The target on this rank's device, in `teacher_dtype`."""
    from eagletools.devices import resolve_device
    from eagletools.target import load_target

    return load_target(config.target.spec, teacher_dtype(config), resolve_device("auto"))


def teacher_dtype(config: TrainConfig) -> torch.dtype:
    """target.dtype, or fp32 when training computes in fp32: there bf16 weights would only
    add casts, and slower matmuls where bf16 is slower (an AVX2 CPU emulates bf16 products:
    the full-vocab argmax's product ran at 19 GFLOPS there against fp32's 91)."""
    from eagletools.devices import resolve_device
    from eagletools.dtypes import parse_dtype

    if training_dtype(config.training.precision, resolve_device("auto")) == torch.float32:
        return torch.float32
    return parse_dtype(config.target.dtype, "target.dtype")


def regenerated_data(
    config: TrainConfig, output_dir: str | Path, target: Any, capture: bool = False
) -> Path:
    """data.regenerate: the target's own replies to the data's prompts, written once by the
    main process into OUT/regenerated.jsonl (a rerun resumes or reuses it); with `capture`,
    the hidden states the offline cache needs are kept on the way (`data.captures`)."""
    from accelerate import PartialState

    from eagletools.data.chat import set_chat_template
    from eagletools.data.conversations import load_conversations
    from eagletools.data.regenerate import Sampling, local_generator, regenerate
    from eagletools.target import resolve_aux_layer_ids

    d, r = config.data, config.data.regenerate
    out = Path(output_dir) / "regenerated.jsonl"
    state = PartialState(cpu=not torch.cuda.is_available())
    if state.is_main_process:
        conversations, report = load_conversations(d.train, d.num_samples, d.hub())
        log.info("%s", report.summary())
        sampling = Sampling(
            r.temperature, seed=config.training.seed, max_new_tokens=r.max_new_tokens
        )
        set_chat_template(target.tokenizer, d.chat_template)  # the prompts' template, too
        chosen, num_layers = config.target.aux_layer_ids, target.info.num_layers
        layers = resolve_aux_layer_ids(chosen, num_layers) if capture else []
        generate = local_generator(target, sampling, r.batch_size, r.max_prompt_tokens, layers)
        regenerate(conversations, generate, out, identity=_regeneration_identity(config),
                   max_turns=r.max_turns, chunk_size=4 * r.batch_size)  # fmt: skip
    state.wait_for_everyone()
    return out


def _regeneration_identity(config: TrainConfig) -> dict[str, Any]:
    """What the regenerated replies depend on; replies made with other values are not reused.
    The template's text, not its file name: prompts are rendered with it."""
    from eagletools.data.chat import read_chat_template

    d = config.data
    return {"data": d.train, "split": d.split, "revision": d.revision,
            "num_samples": d.num_samples, "target": config.target.spec,
            "chat_template": read_chat_template(d.chat_template),
            "seed": config.training.seed, **dataclasses.asdict(d.regenerate)}  # fmt: skip


def build_cache(
    config: TrainConfig,
    path: Path,
    load_target: Callable[[], Any],
    dataset: Any = None,
    captured: Path | None = None,
) -> None:
    """data.offline: run the target once over the data into `path` (resumable, sharded over
    processes), so every epoch after reads it instead of running the target; samples whose
    states regeneration kept in `captured` skip that run, and once the cache is complete
    those captures (as large as the cache) are deleted."""
    from accelerate import PartialState

    from eagletools.data import prepare
    from eagletools.data.hidden_states import HiddenStateCache, write_hidden_states

    state = PartialState(cpu=not torch.cuda.is_available())
    d, target = config.data, load_target()
    key = "given"
    if dataset is None:
        prepared = prepare(config.target.spec, d.train, d.max_length, d.num_samples,
                           chat_template=d.chat_template, tokenizer=target.tokenizer,
                           hub=d.hub())  # fmt: skip
        dataset, key = prepared.dataset, prepared.key
    write_hidden_states(
        target, dataset, path, data_key=key, max_length=d.max_length,
        layer_ids=config.target.aux_layer_ids, rank=state.process_index,
        world_size=state.num_processes, captured=captured,
    )  # fmt: skip
    state.wait_for_everyone()
    if captured is not None and state.is_main_process and HiddenStateCache.is_complete(path):
        for part in captured.glob("part-*.safetensors"):  # the cache holds them now
            part.unlink()
