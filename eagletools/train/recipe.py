"""Typed training recipes: YAML files plus dotted CLI overrides.

A recipe is data: every field below has a type and a default, a YAML file
sets some of them, and `section.key=value` overrides set more. A key that is
not a field is an error naming the key and the file, so a typo never trains
silently with a default.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from eagletools.data.jobs import RegenerationSettings
from eagletools.dtypes import dtype_name
from eagletools.errors import UserError
from eagletools.kinds import KINDS

if TYPE_CHECKING:
    from eagletools.data.conversations import HubOptions

Check = tuple[bool, str, str]  # (holds, the dotted key, what it must be)
TRACKERS = ("none", "wandb", "tensorboard")  # tracking.report_to
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2",
                             "flash_attention_3")  # fmt: skip
# levers measured as no help and removed (the figures: docs/lab.md), each with the value
# that left training as it is now: a recipe naming one is told so rather than that the key
# is unknown, and a checkpoint saved with one at that value still resumes
RETIRED = {"training.ttt_ramp": 0.0, "training.drop_missed": False,
           "training.teacher_temperature": 1.0, "training.teacher_argmax_weight": 0.0,
           "training.teacher_topk": 0}  # fmt: skip


@dataclass
class TargetSection:
    spec: str = "smollm2-135m"  # built-in name, HF folder, hub id or .gguf file
    dtype: str = "bfloat16"  # any spelling: bf16, bfloat16, fp32, ...
    aux_layer_ids: list[int] | None = None  # HF indexing; None: [2, N//2, N-3]
    attention: str = "sdpa"  # the online teacher's HF attn_implementation: flex_attention or
    # flash_attention_2 mask packed rows without a dense [T,T] mask (GPU)

    def checks(self) -> list[Check]:
        return [
            (self.attention in ATTENTION_IMPLEMENTATIONS, "target.attention",
             f"must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"),
        ]  # fmt: skip


@dataclass
class RegenerateSection(RegenerationSettings):
    """data.regenerate: train on the target's own replies to the data's prompts.

    `train` writes them first into OUT/regenerated.jsonl (resumable) with the
    batched runtime, then prepares, splits and trains on that file. The other fields and
    their defaults are `eagletools data regenerate`'s (data.jobs.RegenerationSettings).
    """

    enabled: bool = False

    def checks(self) -> list[Check]:
        return [
            (self.max_turns is None or self.max_turns >= 1, "data.regenerate.max_turns",
             "must be at least 1 (or null: all turns)"),
            (self.max_new_tokens >= 1, "data.regenerate.max_new_tokens", "must be at least 1"),
            (self.batch_size >= 1, "data.regenerate.batch_size", "must be >= 1"),
        ]  # fmt: skip


@dataclass
class DataSection:
    train: str = "sharegpt"  # built-in name, local file/folder, or hub dataset id (org/name)
    num_samples: int | None = None  # conversations to load (None: all)
    split: str = "train"  # hub datasets: the split to read
    revision: str | None = None  # hub datasets: branch, tag or commit (a commit pins the data)
    streaming: bool = False  # hub datasets: stream rows, no full download (on with num_samples)
    max_length: int = 2048
    eval_samples: int = 64  # held-out conversations, split off with the seed
    chat_template: str | None = None
    hidden_states: str | None = None  # offline: a cache from `eagletools data hidden-states`
    offline: bool = False  # build that cache in OUT/hidden-states first, then train from it
    regenerate: RegenerateSection = field(default_factory=RegenerateSection)

    def hub(self) -> HubOptions:
        """How `train` is read when it is a hub dataset id."""
        from eagletools.data.conversations import HubOptions

        return HubOptions(self.split, self.revision, self.streaming)

    def checks(self) -> list[Check]:
        return [
            (self.max_length >= 4, "data.max_length", "must be at least 4"),
            (self.eval_samples >= 0, "data.eval_samples", "must be >= 0"),
            (bool(self.split), "data.split", "must name a split, e.g. train"),
        ]


@dataclass
class VocabSection:
    draft_vocab_size: int = 32000
    path: str | None = None  # a saved DraftVocab; None: build it from the training data
    count: str = "replies"  # replies: the loss mask's tokens | target_argmax: the target's
    # argmax at those positions (what the draft must predict; differs where the replies
    # are not the target's own), one more target pass over count_samples conversations
    count_samples: int | None = None  # training conversations counted (None: all)

    def checks(self) -> list[Check]:
        return [
            (self.count in ("replies", "target_argmax"), "vocab.count",
             "must be replies or target_argmax"),
            (self.count_samples is None or self.count_samples >= 1, "vocab.count_samples",
             "must be at least 1 (or null: all)"),
            (self.draft_vocab_size >= 1, "vocab.draft_vocab_size", "must be positive"),
        ]  # fmt: skip


@dataclass
class DraftSection:
    kind: str = "eagle3"  # eagle3 (a forward per drafted token); peagle, dflash (a block in
    # one: training.ttt_steps tokens, dflash's slots seeing each other both ways)
    mask_token_id: int | None = None  # peagle, dflash: its slots' token (None: the target's
    # last id)
    norm_before_residual: bool = False
    fc_norm: bool = False  # EAGLE-3.1 per-aux-state norms before `fc`
    norm_before_fc: bool = False  # one norm over all aux states before `fc` (not with fc_norm)
    norm_output: bool = False  # EAGLE-3.1: later steps take the normed output
    init_head_from_target: bool = True  # start norm/lm_head as the target's rows
    freeze_head: bool = False  # lm_head = the target's rows of the draft vocab, frozen;
    # the draft's norm starts at 1 and trains (needs init_head_from_target: false)
    intermediate_size: int | None = None  # the MLP's width (None: the target's)
    num_hidden_layers: int = 1  # > 1: plain Llama layers after the EAGLE-3 one (vLLM, TRT-LLM)
    engines: list[str] = field(default_factory=list)  # serving engines the draft is for
    # (formats.engines.ENGINES): training refuses an option one of them ignores

    def options(self) -> dict[str, bool]:
        """Which of the options `formats.engines` tracks this draft uses, by config name."""
        return {"norm_before_residual": self.norm_before_residual, "fc_norm": self.fc_norm,
                "norm_before_fc": self.norm_before_fc,
                "norm_output": self.norm_output, "freeze_head": self.freeze_head,
                "num_hidden_layers": self.num_hidden_layers > 1, "peagle": self.kind == "peagle",
                "peagle_fc_norm": self.kind == "peagle" and self.fc_norm,
                "dflash": self.kind == "dflash"}  # fmt: skip

    def checks(self) -> list[Check]:
        return [
            (not (self.freeze_head and self.init_head_from_target), "draft.freeze_head",
             "starts the norm at 1 with the target's lm_head rows; set "
             "draft.init_head_from_target: false with it"),
            (self.intermediate_size is None or self.intermediate_size >= 1,
             "draft.intermediate_size", "must be positive (or null: the target's)"),
            (self.num_hidden_layers >= 1, "draft.num_hidden_layers", "must be at least 1"),
            (not (self.norm_before_fc and self.fc_norm), "draft.norm_before_fc",
             "cannot be true with draft.fc_norm (one norm over all aux states, or one per "
             "state; speculators refuses both): set one of them to false"),
            (self.kind in KINDS, "draft.kind", f"must be one of {', '.join(KINDS)}"),
            (self.kind != "dflash" or self.init_head_from_target, "draft.init_head_from_target",
             "is false, but a DFlash head is the target's rows, frozen (as speculators trains "
             "it): set it to true"),
        ]  # fmt: skip


@dataclass
class TrainingSection:
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    loss_on: str = "replies"  # replies: the loss mask's tokens | all: every token, prompts
    # too (the teacher is the target's distribution wherever it is); held-out: replies
    eval_ttt_steps: int = 7  # the held-out unroll (acc_j, simulated acceptance length),
    # apart from ttt_steps so that runs trained at different depths compare
    train_oov: bool = False  # also train where the target's argmax is outside the draft
    # vocab (speculators does): the teacher there is its in-vocab distribution; training
    # then skips the full-vocab product (its logged hits count the in-vocab argmax)
    optimizer: str = "adamw"  # adamw | muon (Muon for the hidden 2-D weights, AdamW else)
    muon_lr_ratio: float = 10.0  # Muon's rate = lr * this
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_ratio: float = 0.015
    warmup_steps: int | None = None  # overrides warmup_ratio
    schedule: str = "cosine"  # cosine | linear: the decay after warmup (speculators: linear)
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    grad_clip: float = 0.5
    batch_size: int = 1  # per process, per micro-batch
    grad_accum: int = 1
    num_epochs: float = 1.0
    max_steps: int | None = None  # optimizer steps; overrides num_epochs
    max_minutes: float | None = None  # stop after this much training time; the
    # schedule then follows the larger of the step and the time progress
    total_minutes: float | None = None  # the whole `eagletools train` run (data stages,
    # set-up, training, the final held-out pass): training takes what the rest leaves, fixed
    # when it first starts (mid-run held-out passes, training.eval_every, are not counted)
    max_tokens: int | None = None  # stop once this many tokens (all ranks) are trained,
    # the schedule following them: runs of two trainers compare at equal tokens
    precision: str = "auto"  # bf16 (autocast) | fp32 (either spelling) | auto: the device's
    # faster matmul dtype (bf16 on GPUs and CPUs with AMX, fp32 on other CPUs); fp32 also
    # runs the teacher (the target while training) in fp32
    seed: int = 0
    bucket_size: int = 64  # batches are drawn from length-sorted buckets of this many batches
    pack_tokens: int = 0  # > 0: pack conversations end to end into rows of up to this many
    # tokens (batch_size rows a micro-batch), each attending and taught as if alone;
    # 0: one conversation a row, padded to the batch's longest (train.packing)
    eval_every: int = 200  # optimizer steps; 0: only at the end
    eval_batch_size: int = 8  # held-out conversations per forward (length-sorted, so
    # little padding): held-out metrics are per conversation, whatever the batch
    save_every: int = 500  # optimizer steps; 0: only at the end
    keep_last: int = 2
    log_every: int = 10
    max_bad_steps: int = 5  # stop after this many non-finite losses in a row
    attn_chunk: int = 512  # query chunk of the TTT attention (memory vs speed)
    anchor_share: float = 0.125  # DFlash: the share of positions a step anchors a block
    # at, drawn anew each step (speculators: up to 512 of an 8,192-token row)
    compile: bool = False  # torch.compile the training unroll: compiling once, then faster steps
    num_threads: int | None = None  # torch CPU threads (None: torch's default)

    def checks(self) -> list[Check]:
        return [
            (self.ttt_steps >= 1, "training.ttt_steps", "must be at least 1"),
            (self.eval_ttt_steps >= 1, "training.eval_ttt_steps", "must be at least 1"),
            (0 < self.ttt_decay <= 1, "training.ttt_decay", "must be in (0, 1]"),
            (self.loss_on in ("replies", "all"), "training.loss_on", "must be replies or all"),
            (self.lr > 0, "training.lr", "must be positive"),
            (self.optimizer in ("adamw", "muon"), "training.optimizer", "must be adamw or muon"),
            (self.schedule in ("cosine", "linear"), "training.schedule",
             "must be cosine or linear"),
            (self.muon_lr_ratio > 0, "training.muon_lr_ratio", "must be positive"),
            (len(self.betas) == 2, "training.betas", "must be two numbers, e.g. [0.9, 0.95]"),
            (0 <= self.warmup_ratio < 1, "training.warmup_ratio", "must be in [0, 1)"),
            (self.batch_size >= 1, "training.batch_size", "must be at least 1"),
            (self.eval_batch_size >= 1, "training.eval_batch_size", "must be at least 1"),
            (self.grad_accum >= 1, "training.grad_accum", "must be at least 1"),
            (self.num_epochs > 0, "training.num_epochs", "must be positive"),
            (self.max_steps is None or self.max_steps >= 1, "training.max_steps", "must be >= 1"),
            (self.max_minutes is None or self.max_minutes > 0, "training.max_minutes",
             "must be > 0"),
            (self.total_minutes is None or self.total_minutes > 0, "training.total_minutes",
             "must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "training.max_tokens",
             "must be >= 1"),
            (self.warmup_steps is None or self.warmup_steps >= 0, "training.warmup_steps",
             "must be >= 0"),
            (self.precision in ("auto", "bf16", "fp32"), "training.precision",
             "must be auto, bf16 or fp32"),
            (self.keep_last >= 1, "training.keep_last", "must be at least 1"),
            (self.max_bad_steps >= 1, "training.max_bad_steps", "must be at least 1"),
            (self.attn_chunk >= 1, "training.attn_chunk", "must be at least 1"),
            (0 < self.anchor_share <= 1, "training.anchor_share", "must be in (0, 1]"),
            (self.pack_tokens >= 0, "training.pack_tokens", "must be >= 0 (0: no packing)"),
        ]  # fmt: skip


@dataclass
class TrackingSection:
    report_to: str = "none"  # one of TRACKERS
    project: str = "eagletools"
    run_name: str | None = None

    def checks(self) -> list[Check]:
        return [(self.report_to in TRACKERS, "tracking.report_to",
                 f"must be one of {', '.join(TRACKERS)}")]  # fmt: skip


@dataclass
class EvalSection:
    """What `eagletools pipeline` measures after training (`train` ignores it)."""

    benchmarks: list[str] = field(default_factory=lambda: ["mt-bench", "spec-bench"])
    num_prompts: int = 8  # per benchmark; Spec-Bench is sampled across its categories
    max_new_tokens: int = 128
    # the tree; null in all three: the shape measured fastest here (decode.session), or
    # 4, 5, 16 with tune: false
    topk: int | None = None
    depth: int | None = None
    num_draft_tokens: int | None = None
    tune: bool = True
    autotune: bool = False
    hf_baseline: bool = True  # also time Hugging Face generate
    compile: bool = False  # decoding steps by inductor: faster, after a minute per shape
    device: str = "auto"  # auto: CUDA where torch sees it, else CPU; or cpu, cuda, cuda:N
    # serving engines that also run the draft on the first benchmark, where installed
    # (make engine-vllm / engine-llamacpp): vllm, llama.cpp
    engines: list[str] = field(default_factory=list)
    engine_depth: int = 3  # the chain the engines draft (vLLM's num_speculative_tokens)

    def checks(self) -> list[Check]:
        return [
            (self.num_prompts >= 1, "eval.num_prompts", "must be at least 1"),
            (self.max_new_tokens >= 1, "eval.max_new_tokens", "must be at least 1"),
        ]


@dataclass
class TrainConfig:
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    vocab: VocabSection = field(default_factory=VocabSection)
    draft: DraftSection = field(default_factory=DraftSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def validate(self, source: str = "recipe") -> None:
        """Check every field; dtype fields take any spelling and keep their readers' one:
        torch's name in target.dtype, accelerate's in training.precision."""
        t = self.training
        self.target.dtype = dtype_name(self.target.dtype, f"{source}: target.dtype")
        if t.precision != "auto":
            precision = dtype_name(t.precision, f"{source}: training.precision")
            t.precision = {"bfloat16": "bf16", "float32": "fp32"}.get(precision, precision)
        sections = (self.target, t, self.data, self.data.regenerate, self.vocab, self.draft,
                    self.eval, self.tracking)  # fmt: skip
        for ok, key, why in (check for section in sections for check in section.checks()):
            if not ok:
                raise UserError(f"{source}: {key} {why}")
        if 0 < t.pack_tokens < self.data.max_length:
            raise UserError(
                f"{source}: training.pack_tokens={t.pack_tokens} is shorter than "
                f"data.max_length={self.data.max_length}, so a row could not hold one whole "
                f"conversation; set training.pack_tokens to at least {self.data.max_length} "
                "(or 0: no packing)"
            )
        from eagletools.formats.engines import check_recipe_options

        check_recipe_options(self.draft.options(), self.draft.engines, f"{source}: draft.engines")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Every field by its dotted key (`training.lr`), as trackers log a run's config."""
        return _flat(self.to_dict())


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against the annotation `tp` (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except UserError:
                pass
        raise UserError(f"{source}: {key} must be {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"{source}: {key} must be a list, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise UserError(f"{source}: {key} must be {_type_name(tp)}, got {value!r}")
    return value


def _apply(obj: Any, data: dict[str, Any], prefix: str, source: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in RETIRED:
            raise UserError(
                f"{source}: {dotted} was retired: measured as no help (the figures are in "
                "docs/lab.md); remove it from the recipe"
            )
        if key not in names:
            raise UserError(f"{source}: unknown key {dotted!r}; known: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"{source}: {dotted} must be a mapping, got {value!r}")
            _apply(current, value, f"{dotted}.", source)
        else:
            setattr(obj, key, _coerce(value, hints[key], dotted, source))


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """['training.lr=2e-4', 'data.num_samples=100'] -> a nested dict (values parsed as YAML)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r}: expected section.key=value, e.g. training.lr=2e-4")
        value = _yaml_load(raw) if raw else None
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r}: {part} is set twice")
        node[leaf] = value
    return nested


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"{path}: cannot read recipe ({err.strerror})") from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def _yaml_load(text: str) -> Any:
    """YAML with 1.2-style floats, so `lr: 2e-4` is a number."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?[0-9][0-9_]*\.[0-9_]*$"
    ),
    list("-+0123456789."),
)


def load_config(
    recipe: str | Path | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """A validated `TrainConfig` from a YAML recipe (optional) and dotted overrides."""
    config = TrainConfig()
    if recipe is not None:
        path = Path(recipe)
        _apply(config, _read_yaml(path), "", str(path))
    if overrides:
        _apply(config, parse_overrides(overrides), "", "command-line override")
    config.validate(str(recipe) if recipe is not None else "recipe")
    return config


def saved_config(recipe: dict[str, Any], source: str) -> TrainConfig:
    """The recipe a checkpoint saved (`TrainConfig.to_dict()` then), read as today's: keys
    added since take their defaults, retired ones that changed nothing are dropped (one
    set otherwise stays, and is refused by name)."""
    recipe = {section: dict(values) for section, values in recipe.items()}
    for dotted, inert in RETIRED.items():
        section, key = dotted.split(".")
        if key in recipe.get(section, {}) and recipe[section][key] == inert:
            del recipe[section][key]
    config = TrainConfig()
    _apply(config, recipe, "", source)
    return config


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
