"""What every engine provides: a command line, a completion call, acceptance counters.

An engine is data plus three functions over explicit state (the server, the
request), not a class hierarchy: `launch` builds the server's command line,
`complete` sends one prompt of token ids and returns the new token ids, and
`counters` reads the engine's own cumulative speculative-decoding counters,
which the caller differences around each request.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagletools.engines.server import Server
from eagletools.errors import UserError


@dataclass
class Counters:
    """Speculative steps, accepted drafts, and per position the steps accepting >= i+1."""

    steps: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def _combine(self, other: Counters, op: Callable[[int, int], int]) -> Counters:
        width = max(len(self.per_position), len(other.per_position))
        mine = self.per_position + [0] * (width - len(self.per_position))
        theirs = other.per_position + [0] * (width - len(other.per_position))
        return Counters(
            op(self.steps, other.steps),
            op(self.accepted, other.accepted),
            [op(a, b) for a, b in zip(mine, theirs, strict=True)],
        )

    def __sub__(self, before: Counters) -> Counters:
        return self._combine(before, operator.sub)

    def __add__(self, other: Counters) -> Counters:
        return self._combine(other, operator.add)


@dataclass
class Completion:
    """One prompt decoded by any benchmark method (eval.methods), with its own counters."""

    tokens: list[int]
    seconds: float  # wall clock of the request, as the client sees it
    engine_tokens_per_s: float | None = None  # the engine's own figure, when it reports one
    accepted: list[int] | None = None  # our decoder's drafts accepted per verify step
    counters: Counters | None = None  # an engine's counters over the request (with a draft)


@dataclass(frozen=True)
class ServeRequest:
    """What a server is started for: the target, the draft (None: plain decoding), and how."""

    target: str
    draft: str | None
    num_speculative_tokens: int
    dtype: str
    port: int
    max_model_len: int
    device: str
    threads: int | None
    draft_kind: str = "eagle3"  # `eagletools.kinds`: peagle drafts a block per forward


@dataclass
class Launch:
    """One server: what to run, where it listens and how to know it is up."""

    argv: list[str]
    port: int
    health: str = "/health"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Engine:
    name: str
    make_target: str  # the Makefile target that installs it
    draft_formats: tuple[str, ...]  # checkpoint formats its loader takes
    program: Callable[[], Path]  # its executable, or a UserError saying how to install it
    launch: Callable[[ServeRequest], Launch]
    complete: Callable[[Server, list[int], int], Completion]
    counters: Callable[[Server], Counters]


def engines_dir() -> Path:
    """Where `make engine-*` installs engines: $EAGLETOOLS_ENGINES, else ./.engines."""
    return Path(os.environ.get("EAGLETOOLS_ENGINES", ".engines")).expanduser()


def find_program(
    engine: str, make_target: str, env_var: str, candidates: list[Path], on_path: bool = True
) -> Path:
    """The engine's executable: $ENV_VAR, a `make` install, or PATH; else how to install it."""
    if value := os.environ.get(env_var):
        path = Path(value).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise UserError(f"{env_var}={value}: no executable file there")
        return path
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    if on_path and (found := shutil.which(candidates[0].name)):
        return Path(found)
    elsewhere = f"put `{candidates[0].name}` on PATH, or " if on_path else ""
    raise UserError(
        f"{engine} is not installed: run `make {make_target}` in the eagletools checkout "
        f"(it installs into {engines_dir()}/; set EAGLETOOLS_ENGINES when running elsewhere), "
        f"or {elsewhere}set {env_var} to its path"
    )


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        if line.startswith("#") or not (m := _SAMPLE.match(line)):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
    """The sum of every sample named `name` (over engines, models and other labels)."""
    return sum(value for n, _, value in samples if n == name)
