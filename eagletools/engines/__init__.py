"""Every engine a draft is written for, once; and the serving engines eagletools runs
(vLLM and llama.cpp) as their own servers.

`ENGINE_NAMES` is the registry's every engine as the docs spell it (the columns of
formats.engines' option table); `ENGINES[name]` says how to find, start and read each
one `eagletools eval --engine NAME` measures a draft inside, the engine a user deploys
to. `OURS` is our own tree decoder, `eval --engine`'s default.
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

# (name, as the docs spell it, the server eagletools starts; None: written for, not run here)
REGISTRY: tuple[tuple[str, str, Engine | None], ...] = (
    ("vllm", "vLLM", VLLM),
    ("sglang", "SGLang", None),
    ("sgl-jax", "sgl-jax", None),
    ("llama.cpp", "llama.cpp", LLAMACPP),
    ("tensorrt-llm", "TensorRT-LLM", None),
    ("eagle", "original EAGLE code", None),
)
ENGINE_NAMES: dict[str, str] = {name: title for name, title, _ in REGISTRY}
ENGINES: dict[str, Engine] = {name: server for name, _, server in REGISTRY if server}
OURS = "ours"
ENGINE_TIMEOUT = 900.0  # seconds a server may take to become ready (vLLM compiles at start)

__all__ = [
    "ENGINES", "ENGINE_NAMES", "ENGINE_TIMEOUT", "OURS", "REGISTRY", "Completion", "Counters",
    "Engine", "Launch", "ServeRequest", "find_program",
]  # fmt: skip
