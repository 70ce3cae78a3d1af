"""Helpers for the tests that launch two processes over gloo (and for their scripts)."""

from __future__ import annotations

import os
import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_threads(grace_s: float = 5.0) -> list[str]:
    """This process's gloo threads (Linux) still there after up to `grace_s` seconds: none
    may outlive a freed process group, since one that lives into interpreter exit can abort
    it when it needs the GIL.

    The grace is for threads already joined: `pthread_join` returns once the kernel clears
    the exiting thread's id, before the kernel drops its /proc entry, and on a loaded
    machine that entry lingered past the join (1 fresh-clone CI run in many). A thread
    that outlives its group stays for the interpreter's life; this one goes in moments.
    """
    deadline = time.monotonic() + grace_s
    while (names := _gloo_thread_names()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return names


def _gloo_thread_names() -> list[str]:
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
