"""The per-model call lock of the fast path: concurrent ``generate`` calls on one accelerated model run one after
the other, and a nested call from the running one raises.
"""

from __future__ import annotations

import contextlib
import threading
import time

#: Seconds a ``generate`` call waits for the running call on the same model while that call runs no model step;
#: then it stops waiting and runs transformers' loop instead (:meth:`CallLock.unless_stalled`). A running call
#: that stops stepping may be waiting for the waiting one (a streamer or stopping criterion that hands a
#: ``generate`` on the same model to another thread and joins it), which would otherwise never return.
STALL_S = 2.0
#: Seconds between the waiting thread's looks at the running call's step count.
_POLL_S = 0.05


class CallLock:
    """One call at a time on an engine's state (its persistent cache, buffers and captured graphs).

    ``with lock:`` waits while another thread holds it, so concurrent ``generate`` calls on one model run
    one after the other. A nested call from the thread that holds it (a streamer calling ``generate`` on
    the same model) would overwrite the running call's cache: it raises RuntimeError instead. The holder counts
    its model steps (:meth:`step`), so that a waiter can tell a running call from a stalled one
    (:meth:`unless_stalled`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._steps = 0

    def _refuse_nested(self) -> None:
        if self._owner == threading.get_ident():
            raise RuntimeError("hf-accel: generate was called on a model whose generate is already running in "
                               "this thread (from a streamer or a callback?); the running call owns the model's "
                               "cache. Call it after the running generate returns, or on another model instance.")

    def __enter__(self):
        self._refuse_nested()
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc):
        self._owner = None
        self._lock.release()
        return False

    def step(self) -> None:
        """Count one model step (a decode step, a verification or a prefill) of the running call."""
        self._steps += 1

    @contextlib.contextmanager
    def unless_stalled(self, stall_s: float | None = None):
        """Hold the lock, waiting for the running call while it makes progress: yields True while held, or False
        (not held) once the running call has run no model step (:meth:`step`) for ``stall_s`` seconds (default
        :data:`STALL_S`) of this thread's wait. Raises RuntimeError for a nested call, as ``with lock:`` does."""
        self._refuse_nested()
        stall_s = STALL_S if stall_s is None else stall_s
        seen, since = self._steps, time.monotonic()
        while not self._lock.acquire(timeout=min(_POLL_S, stall_s)):
            if self._steps != seen:
                seen, since = self._steps, time.monotonic()
            elif time.monotonic() - since >= stall_s:
                yield False
                return
        self._owner = threading.get_ident()
        try:
            yield True
        finally:
            self._owner = None
            self._lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock (its ``generate`` call is running)."""
        return self._owner == threading.get_ident()
