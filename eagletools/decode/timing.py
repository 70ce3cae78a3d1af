"""The one timing loop: conversations through ways of decoding, each prompt in turn.

A `Method` is a context manager (a serving engine's server lives while it is
entered) whose `generate(ids)` decodes one prompt of token ids and returns a
timed `Completion` with its own counters. Methods entered together (a group)
take each prompt in turn, so a change in machine load hits them alike; groups
run one after another (an engine's plain server, then its server with the
draft). A multi-turn conversation feeds each method its own earlier answers
through the target's chat template. Other processes' CPU use is counted around
the timed runs (`LoadMeter`), so a report can say when other work skewed the
timings. It sits below eval/ because the tree shape tune
(decode.tuning) times with it too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eagletools.data.chat import chat_ids
from eagletools.engines import Completion, Counters

if TYPE_CHECKING:
    import torch


class Method:
    """One way to decode, named by its record key in results.json.

    `reference` is the key of the method whose greedy outputs this one must
    equal (a drafted decoder's plain decoding), or None.
    """

    def __init__(self, key: str, max_new_tokens: int, reference: str | None = None) -> None:
        self.key, self.max_new_tokens, self.reference = key, max_new_tokens, reference

    def __enter__(self) -> Method:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def reset(self) -> None:
        """Forget earlier questions: each question starts cold; its turns may reuse state."""

    def generate(self, ids: list[int], max_new_tokens: int | None = None) -> Completion:
        raise NotImplementedError


class Decoder(Method):
    """Our `BaselineDecoder` or `SpeculativeDecoder`; a speculative one counts accepted drafts."""

    def __init__(self, key, decoder, max_new_tokens, sampling=None, generator=None, reference=None):
        from eagletools.decode import Sampling

        super().__init__(key, max_new_tokens, reference)
        self.decoder, self.sampling, self.generator = decoder, sampling or Sampling(), generator

    def reset(self) -> None:
        self.decoder.reset()

    def generate(self, ids: list[int], max_new_tokens: int | None = None) -> Completion:
        r = self.decoder.generate(
            ids, max_new_tokens or self.max_new_tokens, self.sampling, generator=self.generator
        )  # fmt: skip
        drafts = getattr(self.decoder, "draft", None) is not None
        return Completion(r.tokens, r.seconds, accepted=r.accepted if drafts else None)


@dataclass
class Run:
    """One question through one method: each turn's tokens, and the sums over its turns."""

    tokens: list[list[int]]
    seconds: float
    accepted: list[int] | None = None
    counters: Counters | None = None
    engine_tokens_per_s: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def record(self) -> dict:
        n = self.num_tokens
        out = {"new_tokens": n, "seconds": round(self.seconds, 4),
               "tokens_per_s": n / self.seconds if self.seconds else 0.0,
               "tokens": self.tokens}  # fmt: skip
        if self.accepted is not None:
            out["accepted"] = self.accepted
        if self.counters is not None:
            out["acceptance"] = asdict(self.counters)
        if readings := self.engine_tokens_per_s:
            out["engine_tokens_per_s"] = sum(readings) / len(readings)
        return out


def converse(method: Method, tokenizer, turns: Sequence[str]) -> Run:
    """Each user turn in order; the reply (text of the generated tokens) joins the history."""
    messages, done = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        done.append(method.generate(chat_ids(tokenizer, messages)))
        reply = tokenizer.decode(done[-1].tokens, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
    accepted = [c.accepted for c in done if c.accepted is not None]
    counters = [c.counters for c in done if c.counters is not None]
    return Run(
        [c.tokens for c in done],
        sum(c.seconds for c in done),
        [a for turn in accepted for a in turn] if accepted else None,
        sum(counters, Counters()) if counters else None,
        [c.engine_tokens_per_s for c in done if c.engine_tokens_per_s],
    )


def machine() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "load_average_at_start": _load_average(),
    }


ISA_LEVELS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
              ("avx2", "AVX2"))  # fmt: skip


@functools.cache
def cpu_model() -> str:
    """The CPU as a figure must name it: model name, family and model, and the widest
    vector ISA, e.g. `AMD EPYC (family 25 model 1, AVX2)`. Cloud CPUs often report a
    bare `AMD EPYC`, under which a Zen 3 (AVX2) and a Zen 4 (AVX-512 BF16) decode at
    different speeds."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model", "flags"):
                fields.setdefault(key.strip(), value.strip())
            elif not line.strip() and fields:
                break  # the first core describes them all
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = next((label for flag, label in ISA_LEVELS if flag in flags), None)
    detail = [f"family {fields['cpu family']} model {fields['model']}"] if "model" in fields else []
    detail += [isa] if isa else []
    return f"{name} ({', '.join(detail)})" if detail else name


def machine_key(device: torch.device) -> str:
    """What a figure measured on `device` depends on besides the work: the device type,
    the GPU or CPU model, the cores and torch's threads (a key of the eagletools cache)."""
    import torch

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return f"{device.type}|{where}|{os.cpu_count()} cpus|{torch.get_num_threads()} threads"


def loaded_by_others(load: dict | None, cpu_count: int | None) -> bool:
    """Whether other processes kept over half the cores busy while timing (`LoadMeter.result`)."""
    return bool(load) and load["others"] > (cpu_count or 1) / 2


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and its children (an engine's server is ours too)."""
    import psutil  # accelerate's dependency

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            total += times.user + times.system
    return total


# psutil.cpu_times() fields that are CPU time taken from us: not idle, iowait, and not
# guest/guest_nice, which Linux counts inside user/nice already
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")


def _busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has run (all cores; a VM's stolen time
    too: it slows a timing as another process would)."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in BUSY_FIELDS)


class LoadMeter:
    """Other processes' CPU use around timed runs: the machine's busy CPU seconds less
    this process tree's, per wall second. Counted, not read off the load average,
    which lags by a minute and counts our own threads (the compile or prefill just
    before a timing read as "other work" on 2 cores)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.cpu = self.busy = self.wall = 0.0

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        cpu, busy, start = _own_cpu_seconds(), _busy_cpu_seconds(), time.perf_counter()
        self.sample()
        try:
            yield
        finally:
            self.sample()
            self.cpu += _own_cpu_seconds() - cpu
            self.busy += _busy_cpu_seconds() - busy
            self.wall += time.perf_counter() - start

    def result(self) -> dict:
        """`others`: CPUs other processes kept busy on average; `max`: the peak load
        average, for the record."""
        peak = max(self.samples, default=os.getloadavg()[0])
        own = self.cpu / self.wall if self.wall else 0.0
        others = (self.busy - self.cpu) / self.wall if self.wall else 0.0
        return {"max": round(peak, 2), "own_cpus": round(own, 2),
                "others": round(max(others, 0.0), 2), "samples": len(self.samples)}  # fmt: skip


@dataclass
class Measured:
    runs: dict[str, list[Run]]  # by method key, one per conversation
    machine: dict  # machine() at the start, the load average at the end and during timing


def run_methods(
    groups: Sequence[Sequence[Method]],
    conversations: Sequence[Sequence[str]],
    tokenizer,
    progress: bool = True,
) -> Measured:
    """Every conversation through every method; each group entered, warmed up on a short
    prompt (first allocations and compilation untimed), then timed prompt by prompt."""
    from tqdm.auto import tqdm

    warm_up = chat_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    at_start, meter = machine(), LoadMeter()
    runs: dict[str, list[Run]] = {}
    for group in groups:
        with contextlib.ExitStack() as stack:
            for method in group:
                stack.enter_context(method).generate(warm_up, 8)
            desc = " / ".join(m.key for m in group)
            for turns in tqdm(conversations, desc=desc, unit="prompt", disable=not progress):
                with meter.timing():
                    for method in group:
                        method.reset()
                        runs.setdefault(method.key, []).append(converse(method, tokenizer, turns))
    at_end = {"load_average_at_end": _load_average(), "load_during_timing": meter.result()}
    return Measured(runs, at_start | at_end)
