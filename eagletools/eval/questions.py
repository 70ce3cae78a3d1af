"""Benchmark questions: MT-bench, HumanEval, Spec-Bench, or any JSONL file.

Every source becomes a list of `Question(id, category, turns)`. A file may
give `turns` (a list of user messages, the MT-bench / Spec-Bench format) or a
single `prompt` / `question` / `instruction` string; `question_id` / `id` /
`task_id` and `category` are optional. A bad line is an error with its
line number: a benchmark silently missing prompts would skew every figure.

Spec-Bench's 480 questions (github.com/hemingkx/Spec-Bench, Apache-2.0, its
LICENSE beside them) ship inside the package, in eval/data/spec_bench/.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from eagletools.errors import UserError

BUILTIN = ("mt-bench", "humaneval", "spec-bench")
SPEC_BENCH = "data/spec_bench/question.jsonl"  # inside eagletools.eval


@dataclass(frozen=True)
class Question:
    id: str
    category: str
    turns: tuple[str, ...]


def load_benchmark(
    spec: str, num_prompts: int | None = None, max_turns: int | None = None
) -> list[Question]:
    """Questions of a built-in benchmark or a JSONL file, in file order."""
    from eagletools import assets

    if spec == "spec-bench":  # package data; as_file also covers a zipped install
        with resources.as_file(resources.files("eagletools.eval") / SPEC_BENCH) as path:
            questions = read_questions(path)
    else:
        if spec in ("mt-bench", "humaneval"):
            path = assets.resolve(spec)
        else:
            path = Path(spec).expanduser()
            if not path.is_file():
                raise UserError(
                    f"--bench {spec}: not a built-in benchmark ({', '.join(BUILTIN)}) "
                    "and no such file"
                )
        questions = read_questions(path, "humaneval" if spec == "humaneval" else "")
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
