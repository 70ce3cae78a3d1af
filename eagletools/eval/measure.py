"""Timed runs as results: each question's record, its match with its reference, and
results.json's dict (schema in eval.report). The timing itself is decode.timing's.
"""

from __future__ import annotations

from collections.abc import Sequence

from eagletools.decode.timing import Measured, Method, Run
from eagletools.eval.metrics import match_fields, summarize
from eagletools.eval.questions import Question


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(turn, token index) where two outputs first differ, or None."""
    for turn, (x, y) in enumerate(zip(a, b, strict=True)):
        for i in range(max(len(x), len(y))):
            if i >= len(x) or i >= len(y) or x[i] != y[i]:
                return turn, i
    return None


def record(question: Question, runs: dict[str, Run], methods: Sequence[Method]) -> dict:
    """One question's record: each method's figures, and its match with its reference."""
    out = {"id": question.id, "category": question.category, "turns": len(question.turns)}
    for m in methods:
        out[m.key] = runs[m.key].record()
    for m in methods:
        if m.reference is None:
            continue
        match, where = match_fields(m.key)
        diff = first_difference(runs[m.key].tokens, runs[m.reference].tokens)
        out[match] = diff is None
        if diff is not None:
            out[where] = {"turn": diff[0], "index": diff[1]}
    return out


def build_results(
    settings: dict,
    depth: int,
    questions: list[Question],
    measured: Measured,
    methods: Sequence[Method],
    **extra,
) -> dict:
    """The results dict written as results.json (schema in eval.report)."""
    records = [
        record(q, {k: runs[i] for k, runs in measured.runs.items()}, methods)
        for i, q in enumerate(questions)
    ]
    return {
        "settings": settings,
        "machine": measured.machine,
        "summary": summarize(records, depth),
        **extra,
        "per_prompt": records,
    }
