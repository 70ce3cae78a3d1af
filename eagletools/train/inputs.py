"""What a training run reads: its data stages, samples, aux states and the teacher.

Online, the target runs in the loop (no grad) and yields the aux states and
last hidden state per batch; offline, both come memory-mapped from a
hidden-state cache. The data stages (`data.jobs`) a recipe asks for run first.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagletools.data.batch import Batch, SampleSource
from eagletools.data.jobs import DataJob, DataSource, HiddenStatesJob, RegenerateJob
from eagletools.errors import UserError
from eagletools.stages import run_stages
from eagletools.train.data import TokenSamples
from eagletools.train.packing import document_positions
from eagletools.train.recipe import TrainConfig
from eagletools.train.ttt import target_argmax


@dataclass
class TrainInputs:
    """Where samples, aux states and the teacher come from."""

    source: SampleSource
    head_model: torch.nn.Module  # a target (or a skeleton of one) to size the draft from
    lm_head_weight: torch.Tensor  # [V, Ht]
    aux_layer_ids: list[int]
    target_model: torch.nn.Module | None  # online: runs per batch; offline: None
    identity: dict[str, Any]


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """training.precision as the dtype training computes in; `auto` picks the device's
    faster matmuls (`devices.fast_matmul_dtype`)."""
    from eagletools.devices import fast_matmul_dtype

    if precision == "auto":
        return fast_matmul_dtype(device)
    return torch.bfloat16 if precision == "bf16" else torch.float32


def teacher_dtype(config: TrainConfig) -> torch.dtype:
    """target.dtype, or fp32 when training computes in fp32: there bf16 weights would only
    add casts, and slower matmuls where the CPU emulates bf16 products."""
    from eagletools.devices import resolve_device
    from eagletools.dtypes import parse_dtype

    if training_dtype(config.training.precision, resolve_device("auto")) == torch.float32:
        return torch.float32
    return parse_dtype(config.target.dtype, "target.dtype")


def load_teacher(config: TrainConfig) -> Any:
    """The target on this rank's device, in `teacher_dtype`."""
    from eagletools.devices import resolve_device
    from eagletools.targets import load_target

    t = config.target
    try:
        return load_target(t.spec, teacher_dtype(config), resolve_device("auto"), t.attention)
    except ImportError as err:  # transformers' words for a missing flash-attn build
        raise UserError(
            f"target.attention: {t.attention} cannot run here ({err}); install its package on "
            "a CUDA machine, or set target.attention: sdpa (or flex_attention)"
        ) from err


def regeneration_job(config: TrainConfig, output: Path) -> RegenerateJob:
    """data.regenerate: the target's own replies to data.train's prompts; with data.offline
    the states the cache needs are kept on the way (`data.captures`)."""
    from eagletools.dtypes import dtype_name

    d = config.data
    return RegenerateJob(  # the section is the job's settings, `enabled` aside
        DataSource(d.train, d.num_samples, d.hub()), output, d.regenerate, config.training.seed,
        target=config.target.spec, dtype=dtype_name(str(teacher_dtype(config))),
        chat_template=d.chat_template, keep_states=d.offline,
        aux_layer_ids=config.target.aux_layer_ids,
    )  # fmt: skip


def cache_job(
    config: TrainConfig, output: Path, captured: Path | None = None, dataset: Any = None
) -> HiddenStatesJob:
    """data.offline: the target run once over the data into a cache every epoch reads;
    the states regeneration kept in `captured` serve their samples, and are deleted once
    the cache holds them."""
    from eagletools.dtypes import dtype_name

    d = config.data
    return HiddenStatesJob(
        config.target.spec, DataSource(d.train, d.num_samples, d.hub()), output,
        dtype=dtype_name(str(teacher_dtype(config))), max_length=d.max_length,
        chat_template=d.chat_template, aux_layer_ids=config.target.aux_layer_ids,
        captured=captured, delete_captured=True, dataset=dataset,
    )  # fmt: skip


def staged_inputs(
    config: TrainConfig, out: Path, target: Any = None, dataset: Any = None
) -> tuple[TrainConfig, TrainInputs]:
    """Run the data stages a recipe asks for, each skipped once its output is complete and
    made with the same settings: the target's own replies (data.regenerate), then the
    hidden-state cache (data.offline). Returns the recipe as trained (data.train: the
    regenerated conversations) and its inputs; the target loads only if a stage needs it."""
    from eagletools.data.regenerate import parts_dir

    jobs: list[DataJob] = []
    if config.data.regenerate.enabled and not config.data.hidden_states:
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
    load = functools.cache(lambda: target or load_teacher(config))
    run_stages([job.stage(load) for job in jobs])
    inputs = offline_inputs(config, cache) if cache else online_inputs(config, load(), dataset)
    return config, inputs


def online_inputs(config: TrainConfig, target: Any = None, dataset: Any = None) -> TrainInputs:
    """The target in the loop; samples from the prepared (tokenised) dataset."""
    from eagletools.data import prepare_dataset
    from eagletools.targets import resolve_aux_layer_ids

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
    """Samples, aux states and the teacher's hidden states from a hidden-state cache."""
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


def features(inputs: TrainInputs, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B,T,A*Ht], last_hidden [B,T,Ht]) for a batch; the target sees each
    conversation of a packed row as if alone (its own mask and positions)."""
    if inputs.target_model is None:
        return batch.aux, batch.last_hidden
    from eagletools.targets import capture_aux

    model = inputs.target_model
    mask, positions = batch.attention_mask.to(model.device), None
    if batch.documents is not None:
        # positions only: Hugging Face finds the documents where they restart and builds each
        # layer's own mask (sliding windows kept; varlen or block masks under flash or flex
        # attention), where a [B,1,T,T] mask of ours would be dense and full-attention
        mask, positions = None, document_positions(batch.documents.to(model.device))
    out = capture_aux(model, batch.input_ids.to(model.device), mask, inputs.aux_layer_ids,
                      positions)  # fmt: skip
    return out.aux, out.last_hidden


def vocab_counts(
    inputs: TrainInputs, indices: list[int], counted_by: str, accelerator: Any
) -> torch.Tensor:
    """Counts [V] for the draft vocabulary (vocab.count): the reply tokens, or the target's
    argmax where they are predicted."""
    from eagletools.vocab import reply_counts

    if counted_by == "target_argmax":
        return argmax_counts(inputs, indices, accelerator)
    return reply_counts(inputs.source, indices, inputs.lm_head_weight.shape[0])


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
