"""`eagletools doctor`: the static checks (`formats.checks`), and the draft run against
its target, acceptance compared with its record.

Weights that keep their shapes but are wrong (k_proj and v_proj swapped,
o_proj transposed) and aux ids shifted by one pass every static check and
every engine's loader; only running the draft shows them. Our own chain
decoder (greedy, exact) runs a few built-in prompts in seconds on a CPU, and
its per-position acceptance is set against the held-out acceptance training
recorded (`formats.record`): far below it is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagletools.errors import UserError
from eagletools.formats import gguf
from eagletools.formats.checkpoint import sniff_format
from eagletools.formats.checks import (
    Draft,
    Finding,
    check_finite,
    engine_findings,
    gguf_findings,
    read_draft,
    static_findings,
    target_findings,
)

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, with a small Python example.",
    "What are three good habits for writing clear emails at work?",
    "Summarise the causes of the French Revolution in a few sentences.",
)
MAX_NEW_TOKENS = 48
DEFAULT_DEPTH = 4  # without a record: the chain measured
MAX_DEPTH = 5
FAR_BELOW = 0.5  # measured accepted drafts per step under this share of the record's: an error
MEANINGFUL = 0.2  # a record below this many accepted drafts per step cannot tell damage apart
LIKELY_CAUSES = (
    "weights that keep their shapes but are wrong (k_proj/v_proj swapped, o_proj "
    "transposed: re-export from the training checkpoint), aux layer ids shifted by one "
    "(eagle_config ids are decoder-layer outputs, HF index - 1: convert from the training "
    "checkpoint), or another target than the one it was trained for"
)


@dataclass
class Measured:
    depth: int
    steps: int
    tau: float
    rates: list[float]  # share of verify steps accepting at least i+1 drafts


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A prompt as the target is served it: its chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        from eagletools.data.chat import chat_ids

        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt, add_special_tokens=False)["input_ids"] or [0]


@torch.inference_mode()
def measure(
    draft: Any,
    target: Any,
    depth: int,
    prompts: Sequence[str] = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> Measured:
    """Greedy chain decoding of `prompts` with `draft` (an `Eagle3Draft` fitted to
    `target`, a loaded `Target`), fp32 on the CPU: its acceptance per position."""
    from eagletools.decode.engine import SpeculativeDecoder
    from eagletools.decode.model import Transformer
    from eagletools.eval.metrics import acceptance

    runtime = Transformer.from_hf(target.model, torch.float32)
    decoder = SpeculativeDecoder(runtime, draft, target.tokenizer, topk=1, depth=depth,
                                 num_draft_tokens=depth + 1, cuda_graphs=False)  # fmt: skip
    accepted: list[int] = []
    for prompt in prompts:
        decoder.reset()
        ids = prompt_ids(target.tokenizer, prompt)
        accepted += decoder.generate(ids, max_new_tokens=max_new_tokens).accepted
    tau, rates = acceptance(accepted, depth)
    return Measured(depth, len(accepted), tau, rates)


def load_and_measure(
    path: str, target_spec: str, record: dict[str, Any] | None, allow_pickle: bool = False
) -> Measured:
    """Load the target and the draft at `path` (fitted to it, as `eval` runs it) and
    `measure` a chain as deep as the record (DEFAULT_DEPTH without one)."""
    from eagletools.formats.checkpoint import load_draft
    from eagletools.targets import load_target

    target = load_target(target_spec, dtype=torch.float32, device="cpu")
    draft = load_draft(path, target=target, allow_pickle=allow_pickle)
    depth = min(len(record["acc"]), MAX_DEPTH) if record else DEFAULT_DEPTH
    return measure(draft, target, depth)


def judge(measured: Measured, record: dict[str, Any] | None) -> tuple[str, str]:
    """(level, message): `error` when the draft accepts far fewer drafts than its record."""
    from eagletools.formats.record import LENGTH, expected_rates

    got = ", ".join(f"{r:.2f}" for r in measured.rates)
    line = f"tau {measured.tau:.2f} over {measured.steps} steps of a {measured.depth}-draft chain, per position [{got}]"
    if record is None:
        return "info", line + "; no training record to compare (acceptance.json)"
    expected = expected_rates(record, measured.depth)
    want = ", ".join(f"{r:.2f}" for r in expected)
    interval = ""
    if LENGTH + "_lo" in record and len(record["acc"]) == measured.depth:
        interval = f", interval [{record[LENGTH + '_lo']:.2f}, {record[LENGTH + '_hi']:.2f}]"
    line += f"; recorded in training: tau {1 + sum(expected):.2f}{interval}, per position [{want}]"
    if sum(expected) < MEANINGFUL:
        return "info", line + " (too low a record to tell damage apart)"
    if measured.tau - 1 < FAR_BELOW * sum(expected):
        first = next(
            (
                i
                for i, (m, e) in enumerate(zip(measured.rates, expected, strict=False))
                if m < FAR_BELOW * e
            ),
            0,
        )
        return "error", f"{line}: far below from position {first}; likely {LIKELY_CAUSES}"
    return "ok", line


def numeric_findings(d: Draft, target: str, allow_pickle: bool) -> list[Finding]:
    """The draft run on the target (`measure`); not run on a draft that cannot
    load, holds a NaN, or does not fit the target (those are errors already)."""
    if d.ckpt is None or any(f.level == "error" for f in check_finite(d)):
        return []
    try:
        measured = load_and_measure(str(d.path), target, d.record, allow_pickle)
    except UserError as err:
        return [Finding("numeric", "info", "acceptance", f"not run: {err}")]
    level, message = judge(measured, d.record)
    return [Finding("numeric", level, "acceptance", message)]


def doctor(
    path: str | Path,
    target: str | None = None,
    engines: list[str] = (),
    numeric: bool = True,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Every check on the draft at `path`: static, per engine, against `target` (its
    config and embeddings) and, with `numeric`, its measured acceptance against its record."""
    path = Path(path).expanduser()
    if sniff_format(path) == gguf.NAME:
        return _report(path, gguf.NAME, gguf_findings(path), None)
    d = read_draft(path, allow_pickle)
    findings, layers = static_findings(d), None
    if target:
        from eagletools.targets import load_target_summary

        summary = load_target_summary(target)
        layers = summary.info.num_layers
        findings += target_findings(d, summary)
    for engine in engines:
        findings += engine_findings(d, engine, layers)
    if target and numeric:
        findings += numeric_findings(d, target, allow_pickle)
    return _report(path, d.format, findings, d.record)


def _report(path: Path, fmt: str, findings: list[Finding], record: Any) -> dict[str, Any]:
    ok = not any(f.level == "error" for f in findings)
    return {"path": str(path), "format": fmt, "ok": ok, "record": record is not None,
            "findings": [f.to_dict() for f in findings]}  # fmt: skip
