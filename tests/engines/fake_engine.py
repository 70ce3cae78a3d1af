"""A stand-in for `vllm serve` and `llama-server`: their flags, endpoints and counters.

Replies are deterministic functions of the prompt, so plain and speculative
servers agree; with a draft, every request counts verify steps and accepted
drafts the way the real engines report them. FAKE_ENGINE_MODE selects faults:
`never-ready` (health never answers), `crash` (exits at once), `spawn` (leaves
a child process in its group, which must be cleaned up too), `diverge` (the
speculative server changes one token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

ARGS = sys.argv[1:]
MODE = os.environ.get("FAKE_ENGINE_MODE", "")
LLAMA = "--metrics" in ARGS  # llama-server; vLLM serves /metrics unasked
PORT = int(ARGS[ARGS.index("--port") + 1])
if LLAMA:
    K = int(ARGS[ARGS.index("--spec-draft-n-max") + 1]) if "-md" in ARGS else 0
else:
    spec = ARGS[ARGS.index("--speculative-config") + 1] if "--speculative-config" in ARGS else None
    K = json.loads(spec)["num_speculative_tokens"] if spec else 0
STATE = {"steps": 0, "accepted": 0, "per_position": [0] * K}
LOG = sys.stdout


def reply_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = [(sum(prompt) * 7 + 13 * i) % 90 + 5 for i in range(n)]
    if MODE == "diverge" and K and n > 3:
        tokens[3] += 1
    return tokens


def count(n: int) -> None:
    """Steps of 1 + a accepted drafts, a cycling 0..K, until n tokens are out."""
    made, step, per_position = 0, 0, [0] * K
    while made < n and K:
        a = min(step % (K + 1), n - made - 1)
        STATE["steps"] += 1
        STATE["accepted"] += a
        for i in range(a):
            STATE["per_position"][i] += 1
            per_position[i] += 1
        made += a + 1
        step += 1
    if LLAMA and K:
        steps = max(step, 1)
        accepted = sum(per_position)
        rates = ", ".join(f"{c / steps:.3f}" for c in per_position)
        print(
            f"slot print_timing: draft acceptance = 0.5 ({accepted:5d} accepted / 9 generated), "
            f"mean len = 1.5",
            file=LOG,
        )
        print(f"slot print_timing:      acc per pos = ({rates})", file=LOG, flush=True)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, body: str, kind: str = "application/json") -> None:
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            if MODE == "never-ready":
                self.send_error(503)
            else:
                self._send("{}")
        elif self.path == "/metrics":
            self._send(metrics(), "text/plain")
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body.get("max_tokens", body.get("n_predict"))
        tokens = reply_tokens(body["prompt"], n)
        count(n)
        if LLAMA:
            timings = {"predicted_per_second": 123.0}
            self._send(json.dumps({"tokens": tokens, "content": "x", "timings": timings}))
        else:
            self._send(json.dumps({"choices": [{"text": "x", "token_ids": tokens}]}))


def metrics() -> str:
    if LLAMA:
        return (
            "# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
            f"llamacpp:spec_decode_num_drafts_total {STATE['steps']}\n"
            f"llamacpp:spec_decode_num_accepted_tokens_total {STATE['accepted']}\n"
        )
    lines = [
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="target"}} {STATE["steps"]}.0',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="target"}} '
        f"{STATE['accepted']}.0",
    ]
    for i, c in enumerate(STATE["per_position"]):
        lines.append(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
            f'model_name="target",position="{i}"}} {c}.0'
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(f"fake engine: {' '.join(ARGS)}", flush=True)
    if MODE == "crash":
        print("error: cannot load the draft", flush=True)
        sys.exit(3)
    if MODE == "spawn":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_ENGINE_CHILD"], "w") as f:
            f.write(str(child.pid))
    time.sleep(0.2)
    HTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
