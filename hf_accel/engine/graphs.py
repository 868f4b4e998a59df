"""CUDA-graph capture that Python's garbage collector cannot interrupt."""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, **kwargs):
    """``torch.cuda.graph(graph, **kwargs)`` with Python's automatic garbage collection paused.

    A captured graph kept alive only by a dead reference cycle (an accelerated model or engine the caller
    dropped) is freed whenever the collector next runs, which can be in the middle of another capture, when
    an allocation in the captured code triggers a collection; PyTorch no longer collects before capturing by
    default. A GPU test run of the speculative draft-model path failed that way now and then: its capture
    was invalidated, and CUDA warned "operation not permitted when stream is capturing" from a graph's
    ``reset`` (a graph being freed) during it. With collection paused, such garbage is freed after the
    capture. Explicit ``gc.collect()`` calls still run.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    finally:
        if enabled:
            gc.enable()
