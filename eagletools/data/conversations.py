"""Conversation data in one form, whatever the source.

Sources: a built-in dataset name, a JSON file (a top-level array, parsed
incrementally so a file cut off mid-record still yields every whole record),
a JSONL file (optionally .gz), a Parquet/Arrow file, a local folder that the
`datasets` library reads (`save_to_disk` output or data files), or a Hugging
Face hub dataset id (`org/name`, read with `datasets.load_dataset`; see
`HubOptions`).
Records: ShareGPT (`conversations: [{from, value}]`), OpenAI-style
(`messages: [{role, content}]`, also UltraChat 200k) and older UltraChat
(`data: [user, assistant, ...]`). Bad records are repaired when the fix is
unambiguous, else dropped; the `LoadReport` counts both by reason.
"""

from __future__ import annotations

import ast
import gzip
import io
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagletools import assets
from eagletools.errors import UserError

log = logging.getLogger(__name__)

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
# the column holding a record's turns, in the order they are looked for -> its layout
_LAYOUTS = {
    "messages": "OpenAI: messages = [{role, content}] (UltraChat 200k: also prompt, prompt_id)",
    "conversations": "ShareGPT: conversations = [{from, value}]",
    "conversation": "ShareGPT variant: conversation = [{from, value}]",
    "data": "UltraChat (older): data = [user, assistant, ...] strings",
}
_TURN_LISTS = tuple(_LAYOUTS)
_LOCAL_SUFFIXES = (".json", ".jsonl", ".gz", ".parquet", ".arrow")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class HubOptions:
    """How a hub dataset id is read; built-in names and local files ignore it."""

    split: str = "train"
    revision: str | None = None  # branch, tag or commit; a commit pins the data
    streaming: bool = False  # rows stream in, no full download; always on with num_samples


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str


Conversation = list[Message]


@dataclass
class LoadReport:
    source: str
    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"{self.source}: read {self.read} records, kept {self.kept}"]
        for title, counts in (("dropped", self.dropped), ("repaired", self.repaired)):
            if counts:
                parts = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
                lines.append(f"  {title} {sum(counts.values())} ({parts})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "read": self.read,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
            "repaired": dict(sorted(self.repaired.items())),
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadReport:
        return cls(
            d["source"],
            d["read"],
            d["kept"],
            Counter(d["dropped"]),
            Counter(d["repaired"]),
            d["notes"],
        )


class BadRecord(Exception):
    """A record that cannot be used; its message is the reason counted."""


def _text(value: Any) -> str:
    """Message content as text; OpenAI content parts are joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    if value is None:
        return ""
    raise BadRecord("non_text_content")


def _raw_turns(record: Any) -> list[tuple[str, str]]:
    if not isinstance(record, dict):
        raise BadRecord("not_an_object")
    key = next((k for k in _TURN_LISTS if isinstance(record.get(k), list)), None)
    if key is None:
        raise BadRecord("no_turn_list")
    turns = record[key]
    if turns and all(isinstance(t, str) for t in turns):  # UltraChat: alternating, user first
        return [("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(turns)]
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadRecord("malformed_turn")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise BadRecord("unknown_role")
        out.append((ROLES[role.lower()], _text(content)))
    return out


def normalize(record: Any, repaired: Counter) -> Conversation:
    """One record as [system?] user, assistant, user, assistant, ...; raises BadRecord."""
    turns = _raw_turns(record)
    msgs: list[list[str]] = []
    for i, (role, content) in enumerate(turns):
        if not content.strip():
            repaired["empty_message_removed"] += 1
        elif role == "system" and (i > 0 or msgs):
            repaired["late_system_removed"] += 1
        elif msgs and msgs[-1][0] == role:
            msgs[-1][1] += "\n\n" + content
            repaired["consecutive_turns_merged"] += 1
        else:
            msgs.append([role, content])
    start = 1 if msgs and msgs[0][0] == "system" else 0
    while len(msgs) > start and msgs[start][0] == "assistant":
        del msgs[start]
        repaired["leading_assistant_removed"] += 1
    if not any(role == "assistant" for role, _ in msgs):
        raise BadRecord("no_assistant_turn" if turns else "empty")
    if msgs[-1][0] != "assistant":
        msgs.pop()
        repaired["trailing_user_removed"] += 1
    return [Message(role, content) for role, content in msgs]


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path), encoding="utf-8")
    return open(path, encoding="utf-8")


def _iter_json_array(path: Path, report: LoadReport) -> Iterator[Any]:
    """Records of a top-level JSON array, read in chunks; a cut-off tail is reported."""
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
        buf = f.read(1 << 20)
        pos = len(buf) - len(buf.lstrip()) + 1  # just after the "["
        consumed, eof = 0, False  # characters dropped from the front of buf; end of file seen
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if buf.startswith("]", pos):
                return
            try:
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not eof:  # the record may continue in the next chunk
                    chunk = f.read(1 << 22)
                    eof = not chunk
                    consumed += pos
                    buf, pos = buf[pos:] + chunk, 0
                    continue
                if pos < len(buf):
                    report.dropped["truncated_tail"] += 1
                    report.notes.append(
                        f"record at character {consumed + pos} does not parse to the end of the "
                        f"file ({len(buf) - pos} characters lost; a file cut off mid-record?): "
                        f"{err.msg}"
                    )
                else:
                    report.notes.append("the file ends without the closing ] of its array")
                return
            yield record


def _iter_jsonl(path: Path) -> Iterator[Any]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{path}: line {lineno} is not valid JSON ({err.msg} at column {err.colno}); "
                    "fix or delete that line"
                ) from None


def _no_layout(source: str | Path, columns: list[str]) -> UserError:
    known = "\n".join(f"  {layout}" for layout in _LAYOUTS.values())
    return UserError(
        f"{source}: none of the known conversation columns; found {sorted(columns)}. "
        f"Known layouts:\n{known}"
    )


def _layout(columns: list[str], source: str | Path) -> str:
    """The layout a dataset's columns name (UltraChat told apart by its prompt columns)."""
    key = next((k for k in _TURN_LISTS if k in columns), None)
    if key is None:
        raise _no_layout(source, columns)
    if key == "messages" and {"prompt", "prompt_id"} & set(columns):
        return "UltraChat: messages = [{role, content}] with prompt, prompt_id"
    return _LAYOUTS[key]


def _rows(ds: Any, source: str | Path, report: LoadReport) -> Iterator[Any]:
    """A (streamed) `datasets` dataset's rows, once its columns show a known layout."""
    if ds.column_names is not None:  # None: a stream whose features are not declared
        report.notes.append(f"layout: {_layout(ds.column_names, source)}")
    yield from ds


def _unknown_split(err: ValueError) -> list[str] | None:
    """The splits a `datasets` "Unknown split" / "Bad split" error lists ([] if none)."""
    message = str(err)
    if "Unknown split" not in message and "Bad split" not in message:
        return None
    listed = re.search(r"(?:Should be one of|Available splits:) (\[.*?\])", message)
    try:
        return [str(s) for s in ast.literal_eval(listed.group(1))] if listed else []
    except (ValueError, SyntaxError):
        return []


def _iter_hub(
    repo: str, hub: HubOptions, num_samples: int | None, report: LoadReport
) -> Iterator[Any]:
    import datasets

    streaming = hub.streaming or num_samples is not None
    try:
        ds = datasets.load_dataset(
            repo, split=hub.split, revision=hub.revision, streaming=streaming
        )
    except ValueError as err:
        splits = _unknown_split(err)
        if splits is None:
            raise UserError(
                f"hub dataset {repo}: the datasets library cannot read it: {err}"
            ) from err
        available = f" (it has: {', '.join(splits)})" if splits else ""
        raise UserError(
            f"hub dataset {repo}: no split {hub.split!r}{available}; "
            "pick one with --data-split (data.split in a recipe)"
        ) from err
    except OSError as err:
        raise UserError(
            f"hub dataset {repo} (no local path of that name): cannot load it ({err}); check "
            "the id and --data-revision, and for a gated dataset log in (hf auth login or HF_TOKEN)"
        ) from err
    report.notes.append(
        f"hub split {hub.split!r}, revision {hub.revision or 'default'}"
        + (", streamed" if streaming else "")
    )
    yield from _rows(ds, repo, report)


def _iter_datasets(path: Path, report: LoadReport) -> Iterator[Any]:
    import datasets

    try:
        if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(path))
        elif path.is_dir():
            ds = datasets.load_dataset(str(path), split="train")
        else:
            kind = {".parquet": "parquet", ".arrow": "arrow"}[path.suffix]
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except (ValueError, FileNotFoundError, OSError) as err:
        raise UserError(f"{path}: the datasets library cannot read it: {err}") from err
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{path}: a dataset with splits {list(ds)}; expected a 'train' split")
        ds = ds["train"]
    yield from _rows(ds, path, report)


def _records(
    source: Path | str, hub: HubOptions, num_samples: int | None, report: LoadReport
) -> Iterator[Any]:
    if isinstance(source, str):
        return _iter_hub(source, hub, num_samples, report)
    path = source
    name = path.name.removesuffix(".gz")
    if path.is_dir() or path.suffix in (".parquet", ".arrow"):
        return _iter_datasets(path, report)
    if name.endswith(".jsonl"):
        return _iter_jsonl(path)
    if name.endswith(".json"):
        with _open_text(path) as f:
            first = f.read(4096).lstrip()[:1]
        return _iter_json_array(path, report) if first == "[" else _iter_jsonl(path)
    raise UserError(
        f"{path}: unknown data format; give a .json, .jsonl(.gz), .parquet, .arrow file, "
        "a datasets folder, a hub dataset id (org/name) or a built-in dataset name"
    )


def data_source(spec: str | Path) -> Path | str:
    """What a data spec names: a local file or folder (built-in datasets are fetched), or,
    when no such path exists, a hub dataset id (`org/name`), returned as a str."""
    spec = str(spec)
    if spec in assets.ASSETS and assets.ASSETS[spec].kind == "dataset":
        return assets.resolve(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if _HUB_ID.match(spec) and not spec.endswith(_LOCAL_SUFFIXES):
        return spec
    known = ", ".join(sorted(a.name for a in assets.ASSETS.values() if a.kind == "dataset"))
    raise UserError(
        f"data {spec!r}: no such file or folder, not a built-in dataset (known: {known}) "
        "and not a hub dataset id (org/name)"
    )


def load_conversations(
    spec: str | Path, num_samples: int | None = None, hub: HubOptions | None = None
) -> tuple[list[Conversation], LoadReport]:
    """Up to `num_samples` usable conversations, in file order, and what was dropped.

    Asking for more than the data has is not an error, but the report says so.
    """
    if num_samples is not None and num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {num_samples}")
    source = data_source(spec)
    report = LoadReport(source=str(spec))
    conversations: list[Conversation] = []
    keys_without_turns: list[str] | None = None  # of the first record with no turn list
    for record in _records(source, hub or HubOptions(), num_samples, report):
        report.read += 1
        try:
            conversations.append(normalize(record, report.repaired))
        except BadRecord as bad:
            report.dropped[str(bad)] += 1
            if str(bad) == "no_turn_list" and keys_without_turns is None:
                keys_without_turns = list(record)
            continue
        if num_samples is not None and len(conversations) >= num_samples:
            report.notes.append(f"stopped after {num_samples} conversations (--num-samples)")
            break
    report.kept = len(conversations)
    if not conversations:
        if keys_without_turns is not None and report.dropped["no_turn_list"] == report.read:
            raise _no_layout(source, keys_without_turns)
        raise UserError(f"{source}: no usable conversation\n{report.summary()}")
    if num_samples is not None and report.kept < num_samples:
        shortfall = (
            f"--num-samples {num_samples} asks for more than the data has: "
            f"{report.kept} usable conversations in {report.read} records"
        )
        report.notes.append(shortfall)
        log.warning("%s: %s", spec, shortfall)
    return conversations, report
