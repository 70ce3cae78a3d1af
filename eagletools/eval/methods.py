"""The ways of decoding only a benchmark times, beside our decoders (decode.timing.Decoder):
Hugging Face `generate`, nothing counted, and a serving engine's server, its counters
differenced around each request. `decode.timing.run_methods` drives any set of them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path

from eagletools.decode.timing import Method
from eagletools.engines import ENGINE_TIMEOUT, Completion, Engine, ServeRequest
from eagletools.engines.server import free_port, serve

log = logging.getLogger(__name__)


class HuggingFace(Method):
    """Hugging Face `generate`; `kwargs` go to it (prompt lookup, an assistant model, ...)."""

    def __init__(self, key, model, max_new_tokens, eos: set[int], sampling=None, reference=None,
                 **kwargs):  # fmt: skip
        super().__init__(key, max_new_tokens, reference)
        if sampling is None or sampling.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                top_p=sampling.top_p,
            )  # fmt: skip
        self.model, self.eos, self.kwargs = model, sorted(eos), kwargs

    def generate(self, ids: list[int], max_new_tokens: int | None = None) -> Completion:
        import torch

        x = torch.tensor([ids], device=self.model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), eos_token_id=self.eos,
                pad_token_id=self.eos[0], max_new_tokens=max_new_tokens or self.max_new_tokens,
                **self.kwargs,
            )  # fmt: skip
        return Completion(out[0, len(ids) :].tolist(), time.perf_counter() - start)


class EngineServer(Method):
    """A serving engine's server, up while entered; its counters differenced per request."""

    def __init__(self, key, engine: Engine, request: dict, max_new_tokens: int, log_dir: Path,
                 port: int | None = None, timeout: float = ENGINE_TIMEOUT, reference=None):  # fmt: skip
        super().__init__(key, max_new_tokens, reference)
        self.engine, self.request, self.port, self.timeout = engine, request, port, timeout
        kind = "with the draft" if request["draft"] else "plain"
        self.label = f"{engine.name} ({kind})"
        self.log_path = Path(log_dir) / f"{engine.name}-{kind.replace(' ', '-')}.log"
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> EngineServer:
        launch = self.engine.launch(ServeRequest(port=free_port(self.port), **self.request))
        log.info("%s: %s", self.label, " ".join(launch.argv))
        with contextlib.ExitStack() as stack:
            self.server = stack.enter_context(
                serve(self.label, launch.argv, launch.port, self.log_path, launch.health,
                      self.timeout, launch.env)
            )  # fmt: skip
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)

    def generate(self, ids: list[int], max_new_tokens: int | None = None) -> Completion:
        before = self.engine.counters(self.server)
        done = self.engine.complete(self.server, ids, max_new_tokens or self.max_new_tokens)
        counters = self.engine.counters(self.server) - before if self.request["draft"] else None
        return replace(done, counters=counters)
