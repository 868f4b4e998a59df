"""CUDA-graph capture that Python's garbage collector cannot interrupt."""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, **kwargs):
    """``torch.cuda.graph(graph, **kwargs)`` with Python's automatic garbage collection paused.

    A captured graph kept alive only by a dead reference cycle (an accelerated model or engine the caller
    dropped) is freed whenever the collector next runs, which can be in the middle of another capture: an
    allocation during the captured code triggers a collection, the old graph is destroyed, and CUDA then
    invalidates the capture in progress ("operation not permitted when stream is capturing"; PyTorch no
    longer collects before capturing by default). With collection paused, such garbage is freed after the
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
