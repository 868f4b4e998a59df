"""The per-model call lock of the fast path: concurrent ``generate`` calls on one accelerated model run one after
the other, and a nested call from the running one raises.
"""

from __future__ import annotations

import threading


class CallLock:
    """One call at a time on an engine's state (its persistent cache, buffers and captured graphs).

    ``with lock:`` waits while another thread holds it, so concurrent ``generate`` calls on one model run
    one after the other. A nested call from the thread that holds it (a streamer calling ``generate`` on
    the same model) would overwrite the running call's cache: it raises RuntimeError instead."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self):
        if self._owner == threading.get_ident():
            raise RuntimeError("hf-accel: generate was called on a model whose generate is already running in "
                               "this thread (from a streamer or a callback?); the running call owns the model's "
                               "cache. Call it after the running generate returns, or on another model instance.")
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc):
        self._owner = None
        self._lock.release()
        return False

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock (its ``generate`` call is running)."""
        return self._owner == threading.get_ident()
