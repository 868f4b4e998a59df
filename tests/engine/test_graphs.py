"""hf_accel.engine.graphs.capture: CUDA-graph capture with Python's automatic garbage collection paused."""

import gc

import pytest
import torch

from hf_accel.engine import graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_collection_is_paused_during_the_capture_and_restored(monkeypatch):
    """The collector is off inside (checked through a stand-in for torch.cuda.graph, so this runs on CPU),
    back on after, also when the captured code raises; left off if it was off."""
    seen = []

    class FakeGraph:
        def __init__(self, graph, **kwargs):
            seen.append(kwargs)

        def __enter__(self):
            seen.append(gc.isenabled())

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "graph", FakeGraph)
    assert gc.isenabled()
    with graphs.capture(None, capture_error_mode="thread_local"):
        assert not gc.isenabled()
    assert gc.isenabled() and seen == [{"capture_error_mode": "thread_local"}, False]
    with pytest.raises(ValueError):
        with graphs.capture(None):
            raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with graphs.capture(None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _dead_graph_in_a_cycle(x):
    """A captured graph that only a reference cycle keeps alive (as a dropped accelerated model does)."""

    class Holder:
        pass

    h = Holder()
    h.me = h
    h.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(h.graph):
        x.add_(1)


def _capture_with_allocations(ctx, x):
    """Capture ``x *= 2`` while allocating enough Python containers to trigger an automatic collection."""
    g = torch.cuda.CUDAGraph()
    with ctx(g):
        junk = [[i] for i in range(20000)]
        x.mul_(2)
    del junk
    return g


@cuda
def test_a_dead_graph_collected_meanwhile_does_not_break_a_capture():
    """A dead graph in a reference cycle, and allocations during the next capture that would trigger a
    collection (which would free that graph mid-capture): with the pause the capture succeeds and replays
    correctly."""
    x = torch.zeros(4, device="cuda")
    gc.collect()
    _dead_graph_in_a_cycle(x)
    g = _capture_with_allocations(graphs.capture, x)
    x.fill_(3.0)
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [6.0] * 4
    gc.collect()  # the dead graph goes now, outside any capture
