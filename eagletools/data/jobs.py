"""Data-stage jobs: the target's own replies and the hidden-state cache, for both front ends.

`eagletools data regenerate|hidden-states` and `train` build the same job and
call `run(target)`. A job's `identity()` holds everything its output depends
on, and the output keeps it (`OUT.parts/identity.json`; the cache manifest's
`job`): a rerun with the same identity reuses or resumes the output, one with
another is refused rather than mixing the two. Under `accelerate launch`,
regeneration runs on the main process and the cache is sharded over every
process; either way every process waits for the others at the end.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from eagletools.data.chat import read_chat_template
from eagletools.data.conversations import HubOptions
from eagletools.stages import Stage

if TYPE_CHECKING:
    from eagletools.decode.sampling import Sampling

log = logging.getLogger(__name__)

Echo = Callable[[str], Any]  # where a job reports what it read and wrote


@dataclass
class DataSource:
    """Conversations: a built-in dataset, a local file or folder, or a hub dataset id."""

    spec: str
    num_samples: int | None = None  # the first N usable conversations (None: all)
    hub: HubOptions = field(default_factory=HubOptions)

    def identity(self) -> dict[str, Any]:
        """The data's content (a file's hash; a hub id with its split and revision), not its
        name: an edited file is other data."""
        from eagletools.data.prepare import data_identity

        return {"data": data_identity(self.spec, self.hub), "num_samples": self.num_samples}


class DataJob(abc.ABC):
    """A data stage: settings, the identity of its output, and `run(target)`."""

    name: ClassVar[str]
    output: Path

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """Everything the output depends on."""

    @abc.abstractmethod
    def is_done(self) -> bool:
        """Whether `output` is complete and was made with `identity()`."""

    @abc.abstractmethod
    def run(self, target: Any, echo: Echo = log.info) -> Path:
        """Write (or resume) `output` with the loaded `target`; returns `output`."""

    def stage(self, load_target: Callable[[], Any]) -> Stage:
        """The job as a resumable stage that loads the target only when it runs."""
        return Stage(self.name, self.output, lambda: self.run(load_target()), self._agreed_done)

    def _agreed_done(self, _: Path) -> bool:
        """`is_done` as the main process answers it: every process then runs the job (and its
        collectives) or skips it, even one that checks after the main one wrote."""
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([self.is_done()])[0]


def _processes() -> Any:
    """accelerate's view of the processes (one, unless started by `accelerate launch`)."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


@dataclass
class RegenerationSettings:
    """How the target rewrites the replies: the one home of the defaults that `eagletools
    data regenerate` and a recipe's `data.regenerate` share, so that a file either one
    writes with its defaults is one the other reuses (the same job identity)."""

    max_turns: int | None = field(
        default=1, metadata={"help": "user turns kept per conversation (none: all)"}
    )
    max_prompt_tokens: int | None = field(
        default=256,
        metadata={"help": "a local target ends a conversation before a longer history (none: "
                  "no limit)"},
    )  # fmt: skip
    max_new_tokens: int = field(default=256, metadata={"help": "tokens per reply at most"})
    temperature: float = field(default=0.0, metadata={"help": "0: greedy, as drafts are evaluated"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (1: off)"})
    batch_size: int = field(
        default=48,
        metadata={"help": "histories per batched forward; on a server, requests at a time"},
    )

    @property
    def chunk_size(self) -> int:
        """Conversations per resumable part: a few batches, so a part keeps the batch full."""
        return 4 * self.batch_size


@dataclass
class RegenerateJob(DataJob):
    """Replace the data's assistant replies with the target's own, turn by turn (JSONL).

    The hidden states kept with `keep_states` are not in the identity: they carry their
    layers, and the cache takes them only at its own.
    """

    name: ClassVar[str] = "regenerate"
    data: DataSource
    output: Path
    settings: RegenerationSettings = field(default_factory=RegenerationSettings)
    seed: int = 0  # a batch's sampling seed is seed + its start
    target: str | None = None  # a local target's spec (the caller loads it)
    dtype: str = "bfloat16"  # the dtype the caller loads that target in
    chat_template: str | None = None  # a local target renders the prompts with it
    server: str | None = None  # an OpenAI-compatible server URL instead of a local target
    model: str | None = None  # the model on the server (None: its first listed)
    keep_states: bool = False  # a local target keeps the states the cache needs per part
    aux_layer_ids: list[int] | None = None  # those states' layers (None: the default)

    @property
    def sampling(self) -> Sampling:
        from eagletools.decode.sampling import Sampling

        s = self.settings
        return Sampling(
            s.temperature, top_p=s.top_p, seed=self.seed, max_new_tokens=s.max_new_tokens
        )

    def identity(self) -> dict[str, Any]:
        s = self.settings
        if self.server:
            backend = {"server": self.server, "model": self.model}
        else:  # a local batch's padding and seed (seed + its start) shape its replies
            template = read_chat_template(self.chat_template)
            backend = {"target": self.target, "dtype": self.dtype, "chat_template": template,
                       "batch_size": s.batch_size}  # fmt: skip
        return {**self.data.identity(), **backend, **asdict(self.sampling),
                "max_turns": s.max_turns, "max_prompt_tokens": s.max_prompt_tokens,
                "chunk_size": s.chunk_size}  # fmt: skip

    def is_done(self) -> bool:
        from eagletools.data.regenerate import is_regenerated

        return is_regenerated(self.output, self.identity())

    def run(self, target: Any = None, echo: Echo = log.info) -> Path:
        """Regenerate on the main process (`target` is None for a server)."""
        from eagletools.data.conversations import load_conversations
        from eagletools.data.regenerate import regenerate

        state = _processes()
        if state.is_main_process:
            d = self.data
            conversations, report = load_conversations(d.spec, d.num_samples, d.hub)
            echo(report.summary())
            regenerate(conversations, self._generator(target), self.output,
                       identity=self.identity(), chunk_size=self.settings.chunk_size,
                       max_turns=self.settings.max_turns)  # fmt: skip
            with open(self.output) as f:
                written = sum(1 for _ in f)
            dropped = len(conversations) - written
            note = f" ({dropped} dropped: prompt too long)" if dropped else ""
            echo(f"{self.output}: {written} conversations with regenerated replies{note}")
        state.wait_for_everyone()
        return self.output

    def _generator(self, target: Any) -> Any:
        from eagletools.data.chat import set_chat_template
        from eagletools.data.regenerate import local_generator, server_generator
        from eagletools.targets import resolve_aux_layer_ids

        if self.server:
            return server_generator(
                self.server, self.sampling, self.model, self.settings.batch_size
            )
        set_chat_template(target.tokenizer, self.chat_template)
        layers = []
        if self.keep_states:
            layers = resolve_aux_layer_ids(self.aux_layer_ids, target.info.num_layers)
        s = self.settings
        return local_generator(target, self.sampling, s.batch_size, s.max_prompt_tokens, layers)


@dataclass
class HiddenStatesJob(DataJob):
    """Run the target once over the tokenised data into the offline hidden-state cache
    (`data.hidden_states`), sharded over the processes.

    The identity says whether captures served, not where they lie: they hold the states of
    the data's own replies, wherever the folder is named from.
    """

    name: ClassVar[str] = "hidden states"
    target: str
    data: DataSource
    output: Path
    dtype: str = "bfloat16"  # the dtype the caller loads the target in (the cache is bf16)
    max_length: int = 2048  # tokens per sample (truncated)
    chat_template: str | None = None
    aux_layer_ids: list[int] | None = None  # HF indexing (None: the default)
    shard_size: int = 256  # samples per shard file: the layout a resume continues
    batch_tokens: int = 8192  # tokens per target forward
    captured: Path | None = None  # a regeneration's parts: its kept states serve its samples
    delete_captured: bool = False  # once the cache is complete (they are as large)
    num_proc: int = 1  # tokenising worker processes
    dataset: Any = None  # already tokenised (tests, notebooks): taken as given

    def identity(self) -> dict[str, Any]:
        data = {"data": "given"} if self.dataset is not None else self.data.identity()
        return {"target": self.target, "dtype": self.dtype, **data,
                "chat_template": read_chat_template(self.chat_template),
                "max_length": self.max_length, "aux_layer_ids": self.aux_layer_ids,
                "shard_size": self.shard_size, "captured": self.captured is not None}  # fmt: skip

    def is_done(self) -> bool:
        from eagletools.data.hidden_states import manifest_job

        return manifest_job(self.output) == self.identity()

    def run(self, target: Any, echo: Echo = log.info) -> Path:
        from eagletools.data.hidden_states import HiddenStateCache, write_hidden_states

        state = _processes()
        dataset, key = self._tokenised(target, echo)
        write_hidden_states(
            target, dataset, self.output, data_key=key, max_length=self.max_length,
            layer_ids=self.aux_layer_ids, shard_size=self.shard_size,
            batch_tokens=self.batch_tokens, rank=state.process_index,
            world_size=state.num_processes, captured=self.captured, job=self.identity(),
        )  # fmt: skip
        state.wait_for_everyone()
        if state.is_main_process and HiddenStateCache.is_complete(self.output):
            cache = HiddenStateCache.open(self.output)
            echo(f"{self.output}: {len(cache)} samples, "
                 f"{cache.bytes_per_token():.0f} bytes per token")  # fmt: skip
            if self.delete_captured and self.captured is not None:
                for part in Path(self.captured).glob("part-*.safetensors"):  # the cache has them
                    part.unlink()
        return self.output

    def _tokenised(self, target: Any, echo: Echo) -> tuple[Any, str]:
        """(dataset, data key): the given dataset, or the data prepared with the target's
        tokenizer (from the prepared-data cache when there)."""
        from eagletools.data.prepare import prepare

        if self.dataset is not None:
            return self.dataset, "given"
        d = self.data
        prepared = prepare(self.target, d.spec, self.max_length, d.num_samples,
                           chat_template=self.chat_template, num_proc=self.num_proc,
                           tokenizer=target.tokenizer, hub=d.hub)  # fmt: skip
        echo(prepared.summary())
        return prepared.dataset, prepared.key
