"""Benchmark questions: MT-bench, HumanEval, Spec-Bench, or any JSONL file.

Every source becomes a list of `Question(id, category, turns)`. A file may
give `turns` (a list of user messages, the MT-bench / Spec-Bench format) or a
single `prompt` / `question` / `instruction` string; `question_id` / `id` /
`task_id` and `category` are optional. A bad line is an error with its
line number: a benchmark silently missing prompts would skew every figure.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from eagletools.errors import UserError

BUILTIN = ("mt-bench", "humaneval", "spec-bench")
SPEC_BENCH_ENV = "EAGLETOOLS_SPEC_BENCH"
# the development checkout keeps Spec-Bench beside the clone (../shared/data/...)
_SPEC_BENCH_NEAR = Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"


@dataclass(frozen=True)
class Question:
    id: str
    category: str
    turns: tuple[str, ...]


def spec_bench_path() -> Path:
    path = Path(os.environ.get(SPEC_BENCH_ENV, _SPEC_BENCH_NEAR))
    if not path.is_file():
        raise UserError(
            f"Spec-Bench questions not found at {path}: pass the file itself with --bench "
            f"question.jsonl, or set {SPEC_BENCH_ENV} to its path"
        )
    return path


def load_benchmark(
    spec: str, num_prompts: int | None = None, max_turns: int | None = None
) -> list[Question]:
    """Questions of a built-in benchmark or a JSONL file, in file order."""
    from eagletools import assets

    if spec == "mt-bench":
        path = assets.resolve("mt-bench")
    elif spec == "humaneval":
        path = assets.resolve("humaneval")
    elif spec == "spec-bench":
        path = spec_bench_path()
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(
                f"--bench {spec}: not a built-in benchmark ({', '.join(BUILTIN)}) and no such file"
            )
    questions = read_questions(path, default_category="humaneval" if spec == "humaneval" else "")
    if num_prompts is not None:
        if num_prompts < 1:
            raise UserError(f"--num-prompts must be at least 1, got {num_prompts}")
        questions = questions[:num_prompts]
    if max_turns is not None:
        if max_turns < 1:
            raise UserError(f"--max-turns must be at least 1, got {max_turns}")
        questions = [Question(q.id, q.category, q.turns[:max_turns]) for q in questions]
    return questions


def read_questions(path: Path, default_category: str = "") -> list[Question]:
    opener = gzip.open if path.suffix == ".gz" else open
    questions = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                questions.append(_parse(line, f"{path} line {number}", default_category, number))
    if not questions:
        raise UserError(f"{path}: no questions (expected one JSON object per line)")
    return questions


def _parse(line: str, where: str, default_category: str, number: int) -> Question:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise UserError(f"{where}: field 'turns' must be a non-empty list of non-empty strings")
    else:
        text = next((record[k] for k in ("prompt", "question", "instruction") if k in record), None)
        if not isinstance(text, str) or not text.strip():
            raise UserError(
                f"{where}: needs field 'turns' (list of strings) or 'prompt' (a non-empty string)"
            )
        turns = [text]
    qid = next((record[k] for k in ("question_id", "id", "task_id") if k in record), number)
    category = record.get("category", default_category)
    if not isinstance(category, str):
        raise UserError(f"{where}: field 'category' must be a string")
    return Question(str(qid), category, tuple(turns))
