"""A benchmark inside a serving engine: the same prompts, with and without the draft.

The engine runs as its own server (engines/). Two servers run one after the
other, since one with a draft cannot decode plainly: the plain one gives the
baseline outputs and tokens/s, the one with the draft its tokens/s, outputs
(compared with the plain ones token by token) and the engine's own
acceptance counters, read around each request. Prompts are rendered to token
ids here with the target's chat template and sent as ids, so every engine
(and `--engine ours`) decodes exactly the same prompts. The draft is a chain
of `depth` tokens: the engines draft chains, not trees.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from eagletools.decode.session import Settings
from eagletools.decode.timing import Method, run_methods
from eagletools.engines import ENGINES, Engine
from eagletools.errors import UserError
from eagletools.eval.measure import build_results
from eagletools.eval.methods import EngineServer
from eagletools.eval.questions import Question
from eagletools.formats import speculators

log = logging.getLogger(__name__)


def engine_inputs(s: Settings, engine: Engine) -> tuple[Path, str, str | None]:
    """(the target's HF folder, the target as `engine` loads it, the draft as it loads it)."""
    from eagletools.targets.load import dequantised_folder, resolve_spec

    location, extra = resolve_spec(s.target)
    folder = dequantised_folder(s.target) if extra else Path(location)
    draft = _engine_draft(s.draft, engine, s.target) if s.draft else None
    if engine.name != "llama.cpp":
        return folder, str(folder) if folder.is_dir() else location, draft
    from eagletools.engines.llamacpp import target_gguf

    if not folder.is_dir():
        raise UserError(
            f"--target {s.target}: llama.cpp needs the target's weights on disk; download "
            "the model folder first and pass its path"
        )
    return folder, str(target_gguf(folder, s.dtype)), draft


def _engine_draft(draft: str, engine: Engine, target: str) -> str:
    from eagletools.formats import detect_format, sniff_format

    path = Path(draft)
    if "gguf" in engine.draft_formats:
        found = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
        if len(found) == 1 and sniff_format(found[0]) == "gguf":
            return str(found[0].resolve())
        fmt = "a folder with " + ("several .gguf files" if found else "no .gguf file")
        fmt = fmt if path.is_dir() else "not a GGUF file"
    else:
        fmt = detect_format(draft) if path.is_dir() else f"a {path.suffix or 'plain'} file"
        if fmt in engine.draft_formats:
            return str(path.resolve())
    wanted = engine.draft_formats[0]
    raise UserError(
        f"--draft {draft}: {engine.name} loads {' or '.join(engine.draft_formats)} drafts, this is "
        f"{fmt}; convert it: eagletools convert {draft} {path.with_name(path.name + '-' + wanted)} "
        f"--to {wanted} --target {target}"
    )


def _max_len(target: Path | str) -> int:
    """Context the server reserves: the target's, at most 4096 (two benchmark turns fit)."""
    from eagletools.targets.load import load_config

    return min(getattr(load_config(str(target)), "max_position_embeddings", 4096), 4096)


def launch_args(s: Settings, engine: Engine) -> tuple[dict, str | None]:
    """(the server's `ServeRequest` fields but port and draft, the draft as `engine` loads it)."""
    folder, target, draft = engine_inputs(s, engine)
    kind, tokens = "eagle3", s.depth  # the eagle layout and GGUF hold nothing else
    if draft and speculators.matches(Path(draft)):
        kind = speculators.draft_kind(Path(draft))
    if kind == "dflash":  # its slots see each other: a shorter block is another draft
        tokens = speculators.block_tokens(Path(draft))
        if tokens != s.depth:
            log.warning("%s: a DFlash draft proposes its whole trained block: %d tokens a "
                        "step, not --depth %d", draft, tokens, s.depth)  # fmt: skip
    args = dict(
        target=target, num_speculative_tokens=tokens, dtype=s.dtype,
        max_model_len=_max_len(folder if folder.is_dir() else target), device=s.device,
        threads=s.threads or os.cpu_count(),  # every engine gets the same cores
        draft_kind=kind,
    )  # fmt: skip
    return args, draft


def engine_methods(
    s: Settings,
    engine: Engine,
    log_dir: str | Path,
    keys: tuple[str, str] = ("baseline", "speculative"),
) -> list[list[Method]]:
    """The engine's plain server, then (with a draft) its server with the draft, under
    `keys`: one group each, since a server started with a draft cannot decode plainly."""
    args, draft = launch_args(s, engine)
    plain, spec = keys
    groups: list[list[Method]] = [
        [EngineServer(plain, engine, args | {"draft": None}, s.max_new_tokens, log_dir,
                      s.engine_port, s.engine_timeout)],
    ]  # fmt: skip
    if draft:
        groups.append(
            [EngineServer(spec, engine, args | {"draft": draft}, s.max_new_tokens, log_dir,
                          s.engine_port, s.engine_timeout, reference=plain)]
        )  # fmt: skip
    return groups


def run_engine_eval(
    s: Settings, questions: list[Question], log_dir: str | Path, progress: bool = True
) -> dict:
    """Every question through the engine `s.engine`, plain then with `s.draft`.

    The servers' logs go to `log_dir` (on failure the error quotes their tail).
    """
    from eagletools.data.chat import set_chat_template
    from eagletools.targets.load import load_tokenizer

    engine = ENGINES[s.engine]
    groups = engine_methods(s, engine, log_dir)
    tokenizer = load_tokenizer(s.target)
    set_chat_template(tokenizer, s.chat_template)
    started = time.perf_counter()
    measured = run_methods(groups, [q.turns for q in questions], tokenizer, progress)
    first = groups[0][0].request
    return build_results(
        asdict(s) | {"topk": 1, "num_draft_tokens": s.depth + 1}, s.depth, questions, measured,
        [m for group in groups for m in group],
        engine={
            "name": engine.name, "target": first["target"],
            "draft": groups[-1][0].request["draft"],
            "minutes": round((time.perf_counter() - started) / 60, 2),
        },
    )  # fmt: skip
