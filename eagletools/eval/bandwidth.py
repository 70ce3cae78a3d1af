"""Bandwidth achieved: how close decoding comes to the machine's memory limit.

A plain decoder reads every weight once per token, so weight bytes x tokens/s
is the memory traffic it sustains (gpt-fast's "bandwidth achieved"); over the
machine's measured read bandwidth it says how much faster decoding could get
at all. The read bandwidth is measured once per machine (a sum over a tensor
much larger than the caches) and kept in the eagletools cache.
"""

from __future__ import annotations

import time

import torch
from torch import nn

PROBE_BYTES = 1 << 29  # 512 MiB: several times any L3


def weight_bytes(model: nn.Module) -> int:
    """Bytes a one-token forward reads: every parameter but the embedding tables (one row)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in embeddings)


def _measure(device: torch.device, rounds: int = 9) -> float:
    """The fastest of `rounds` sums: a limit is what the machine can do at best. On a
    2-core AVX2 EPYC the median of 4 read 11.0 and 17.7 GB/s within an hour, the
    fastest of 8 22.4-24.0 three times in a row (docs/lab.md, Part 8)."""
    x = torch.ones(PROBE_BYTES // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        x.sum().item()  # .item() waits for a GPU too
        times.append(time.perf_counter() - start)
    return PROBE_BYTES / min(times[1:])


def read_bandwidth(device: torch.device | str = "cpu") -> float:
    """The machine's memory read bandwidth in bytes/s, measured once and cached on disk."""
    from eagletools.assets import cache_dir, read_cache_json, write_cache_json
    from eagletools.decode.timing import machine_key

    device = torch.device(device)
    key, path = machine_key(device), cache_dir() / "read_bandwidth.json"
    known = read_cache_json(path)
    if key not in known:
        known[key] = _measure(device)
        write_cache_json(path, known)
    return known[key]


def achieved(model: nn.Module | None, tokens_per_s: dict[str, float | None], device) -> dict | None:
    """Per decoder: GB/s of weights read at its tokens/s, and that share of the read bandwidth.

    For a speculative decoder it is the effective figure: it reads the weights
    once per verify step, not per token, so it can pass 100%. None without a
    model of ours (a serving engine's).
    """
    if model is None:
        return None
    nbytes, read = weight_bytes(model), read_bandwidth(device)
    per = {
        name: {"gb_per_s": rate * nbytes / 1e9, "share": rate * nbytes / read}
        for name, rate in tokens_per_s.items()
        if rate
    }
    return {"weight_bytes": nbytes, "read_gb_per_s": read / 1e9, "decoders": per}
