"""Helpers for the tests that launch two processes over gloo (and for their scripts)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_threads() -> list[str]:
    """This process's gloo threads (Linux): none may outlive a freed process group, since one
    that lives into interpreter exit can abort it when it needs the GIL."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return [n for n in names if "gloo" in n]
