"""Serving engines that run an eagletools draft: vLLM and llama.cpp, as their own servers.

`eagletools eval --engine NAME` measures a draft inside the engine a user
deploys to; `ENGINES[name]` says how to find, start and read each one.
"""

from eagletools.engines.base import (
    Completion,
    Counters,
    Engine,
    Launch,
    ServeRequest,
    find_program,
)
from eagletools.engines.llamacpp import LLAMACPP
from eagletools.engines.vllm import VLLM

ENGINES: dict[str, Engine] = {e.name: e for e in (VLLM, LLAMACPP)}

__all__ = [
    "ENGINES", "Completion", "Counters", "Engine", "Launch", "ServeRequest", "find_program",
]  # fmt: skip
