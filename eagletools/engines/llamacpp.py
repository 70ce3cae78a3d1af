"""llama.cpp (`llama-server`): EAGLE-3 drafts as GGUF (`eagletools convert --to gguf`).

The target runs from a GGUF that llama.cpp's own converter writes from the
target's HF folder (cached by folder and dtype). Verify steps and accepted
drafts come from llama-server's Prometheus counters (`--metrics`); the
per-position rates only from its per-request log line `acc per pos`, printed
at log verbosity 4, which is why the server runs with `-lv 4`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from eagletools import assets
from eagletools.atomic import atomic_file
from eagletools.engines.base import (
    Completion,
    Counters,
    Engine,
    Launch,
    ServeRequest,
    engines_dir,
    find_program,
    metric_sum,
    parse_metrics,
)
from eagletools.engines.server import Server, request
from eagletools.errors import UserError

_PREFIX = "llamacpp:spec_decode_"
_ACCEPTED = re.compile(r"draft acceptance = [\d.]+ \(\s*(\d+) accepted")
_PER_POSITION = re.compile(r"acc per pos = \(([^)]*)\)")
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def program() -> Path:
    return find_program(
        "llama.cpp",
        "engine-llamacpp",
        "EAGLETOOLS_LLAMA_SERVER",
        [engines_dir() / "llama.cpp/bin/llama-server"],
    )


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the source `make engine-llamacpp` keeps."""
    script = program().resolve().parent.parent / "src" / "convert_hf_to_gguf.py"
    if not script.is_file():
        script = engines_dir() / "llama.cpp/src/convert_hf_to_gguf.py"
    if not script.is_file():
        raise UserError(
            "llama.cpp's convert_hf_to_gguf.py was not found beside llama-server: run "
            "`make engine-llamacpp`, or convert the target yourself and pass the .gguf as --target"
        )
    return script


def target_gguf(folder: str | Path, dtype: str) -> Path:
    """The target's HF folder as GGUF in `dtype`, by llama.cpp's own converter, cached."""
    folder = Path(folder).resolve()
    weights = sorted(folder.glob("*.safetensors"))
    stamp = "|".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    key = hashlib.sha256(f"{folder}|{stamp}|{dtype}".encode()).hexdigest()[:16]
    out = assets.cache_dir() / "gguf" / f"{folder.name}-{GGUF_TYPES[dtype]}-{key}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    script = converter()
    with atomic_file(out) as tmp:
        cmd = [sys.executable, str(script), str(folder), "--outtype", GGUF_TYPES[dtype],
               "--outfile", str(tmp)]  # fmt: skip
        env = {"PYTHONPATH": str(script.parent / "gguf-py"), "NO_LOCAL_GGUF": ""}
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise UserError(f"llama.cpp's converter failed on {folder}:\n{tail}")
    return out


def launch(r: ServeRequest) -> Launch:
    argv = [
        str(program()), "-m", r.target, "--host", "127.0.0.1", "--port", str(r.port),
        "-c", str(r.max_model_len), "-np", "1", "--metrics", "-lv", "4", "--no-webui",
        "--seed", "0",
    ]  # fmt: skip
    if r.threads:
        argv += ["-t", str(r.threads), "-tb", str(r.threads)]
    if r.device == "cpu":
        argv += ["-ngl", "0"]
    if r.draft:
        argv += [
            "-md", r.draft, "--spec-type", "draft-eagle3",
            # draft exactly K tokens every step, as a chain of depth K does
            "--spec-draft-n-max", str(r.num_speculative_tokens), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0",
        ]  # fmt: skip
        if r.device == "cpu":
            argv += ["-ngld", "0"]
    return Launch(argv, r.port, "/health")


def complete(server: Server, prompt: list[int], max_tokens: int) -> Completion:
    payload = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "return_tokens": True,
        "cache_prompt": True,
    }
    start = time.perf_counter()
    reply = json.loads(request(server.url + "/completion", payload))
    seconds = time.perf_counter() - start
    timings = reply.get("timings", {})
    return Completion(list(reply["tokens"]), seconds, timings.get("predicted_per_second"))


def counters(server: Server) -> Counters:
    """Steps and accepted drafts from /metrics; per-position counts from the log's rates."""
    samples = parse_metrics(request(server.url + "/metrics").decode())
    steps = int(metric_sum(samples, _PREFIX + "num_drafts_total"))
    accepted = int(metric_sum(samples, _PREFIX + "num_accepted_tokens_total"))
    return Counters(steps, accepted, _per_position(server.log))


def _per_position(log: Path) -> list[int]:
    """Per-position counts summed over every finished request in the server's log.

    Each request logs its accepted drafts and its per-position rates (count /
    its verify steps, 3 decimals); its steps follow from `accepted / steps =
    sum(rates)`, and rates x steps, rounded, are its counts.
    """
    text = log.read_text(errors="replace")
    accepted = [int(a) for a in _ACCEPTED.findall(text)]
    total = Counters()
    for n, rates_text in zip(accepted, _PER_POSITION.findall(text), strict=False):
        rates = [float(r) for r in rates_text.split(",") if r.strip()]
        steps = round(n / sum(rates)) if sum(rates) else 0
        total += Counters(per_position=[round(r * steps) for r in rates])
    return total.per_position


LLAMACPP = Engine("llama.cpp", "engine-llamacpp", ("gguf",), program, launch, complete, counters)
