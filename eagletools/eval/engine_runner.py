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
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from eagletools.engines import ENGINES, Counters, Engine, ServeRequest
from eagletools.engines.server import free_port, serve
from eagletools.errors import UserError
from eagletools.eval.benchmarks import Question
from eagletools.eval.runner import Settings, converse, first_difference, machine

log = logging.getLogger(__name__)

ENGINE_NAMES = ("ours", *ENGINES)


def engine_inputs(s: Settings, engine: Engine) -> tuple[Path, str, str | None]:
    """(the target's HF folder, the target as `engine` loads it, the draft as it loads it)."""
    from eagletools.target.load import dequantised_folder, resolve_spec

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
    from eagletools.target.load import load_config

    return min(getattr(load_config(str(target)), "max_position_embeddings", 4096), 4096)


def _engine_generate(engine: Engine, server, s: Settings) -> Callable:
    def generate(ids: list[int]) -> tuple[list[int], float, tuple[Counters, float | None]]:
        before = engine.counters(server)
        done = engine.complete(server, ids, s.max_new_tokens)
        return (
            done.tokens,
            done.seconds,
            (engine.counters(server) - before, done.engine_tokens_per_s),
        )

    return generate


def run_server(
    engine: Engine, s: Settings, launch_args: dict, questions, tokenizer, log_dir: Path, progress
) -> list:
    """One server over every question: per question (turn tokens, seconds, counters,
    the engine's own tokens/s readings)."""
    from tqdm.auto import tqdm

    launch = engine.launch(ServeRequest(port=free_port(s.engine_port), **launch_args))
    kind = "with the draft" if launch_args["draft"] else "plain"
    log_path = log_dir / f"{engine.name}-{kind.replace(' ', '-')}.log"
    log.info("%s %s: %s", engine.name, kind, " ".join(launch.argv))
    out = []
    with serve(
        f"{engine.name} ({kind})", launch.argv, launch.port, log_path, launch.health,
        s.engine_timeout, launch.env,
    ) as server:  # fmt: skip
        generate = _engine_generate(engine, server, s)
        generate(tokenizer("Hello").input_ids)  # warm-up: first-request allocation untimed
        for q in tqdm(questions, desc=f"{engine.name} {kind}", unit="prompt", disable=not progress):
            turns = converse(generate, tokenizer, q.turns)
            counters = sum((c for _, _, (c, _) in turns), Counters())
            engine_tps = [tps for _, _, (_, tps) in turns if tps]
            out.append(
                ([t for t, _, _ in turns], sum(sec for _, sec, _ in turns), counters, engine_tps)
            )
    return out


def _record(tokens: list[list[int]], seconds: float, engine_tps: list[float]) -> dict:
    n = sum(len(t) for t in tokens)
    record = {"new_tokens": n, "seconds": round(seconds, 4), "tokens_per_s": n / seconds}
    if engine_tps:
        record["engine_tokens_per_s"] = sum(engine_tps) / len(engine_tps)
    return record


def launch_args(s: Settings, engine: Engine) -> tuple[dict, str | None]:
    """(the server's `ServeRequest` fields but port and draft, the draft as `engine` loads it)."""
    folder, target, draft = engine_inputs(s, engine)
    args = dict(
        target=target, num_speculative_tokens=s.depth, dtype=s.dtype,
        max_model_len=_max_len(folder if folder.is_dir() else target), device=s.device,
        threads=s.threads or os.cpu_count(),  # every engine gets the same cores
    )  # fmt: skip
    return args, draft


def run_engine_eval(
    s: Settings, questions: list[Question], log_dir: str | Path, progress: bool = True
) -> dict:
    """Every question through the engine `s.engine`, plain then with `s.draft`.

    The servers' logs go to `log_dir` (on failure the error quotes their tail).
    """
    from eagletools.data.chat import set_chat_template
    from eagletools.eval.metrics import summarize
    from eagletools.target.load import load_tokenizer

    engine = ENGINES[s.engine]
    args, draft = launch_args(s, engine)
    tokenizer = load_tokenizer(s.target)
    set_chat_template(tokenizer, s.chat_template)
    at_start = machine()
    started = time.perf_counter()
    log_dir = Path(log_dir)
    plain = run_server(engine, s, args | {"draft": None}, questions, tokenizer, log_dir, progress)
    spec = None
    if draft:
        spec = run_server(
            engine, s, args | {"draft": draft}, questions, tokenizer, log_dir, progress
        )
    records = []
    for i, q in enumerate(questions):
        tokens, seconds, _, tps = plain[i]
        record = {"id": q.id, "category": q.category, "turns": len(q.turns),
                  "baseline": _record(tokens, seconds, tps)}  # fmt: skip
        if spec:
            stokens, sseconds, counters, stps = spec[i]
            record["speculative"] = _record(stokens, sseconds, stps) | {
                "acceptance": asdict(counters)
            }
            diff = first_difference(stokens, tokens)
            record["greedy_match"] = diff is None
            if diff is not None:
                record["baseline_difference"] = {"turn": diff[0], "index": diff[1]}
        records.append(record)
    return {
        "settings": asdict(s) | {"topk": 1, "num_draft_tokens": s.depth + 1},
        "engine": {
            "name": engine.name,
            "target": args["target"],
            "draft": draft,
            "minutes": round((time.perf_counter() - started) / 60, 2),
        },  # fmt: skip
        "machine": at_start | {"load_average_at_end": machine()["load_average_at_start"]},
        "summary": summarize(records, s.depth),
        "autotune": None,
        "per_prompt": records,
    }
