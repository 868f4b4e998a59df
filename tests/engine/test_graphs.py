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


def test_a_capture_that_raised_is_captured_again_not_replayed(monkeypatch, tiny):
    """A decode step's capture that raises (out of memory while the graph's pool allocates, say) leaves no graph
    behind: the next call captures again instead of replaying a graph that was never captured (CUDA: "replay
    without a preceding successful capture", on every later call of that shape). Stand-ins for the CUDA graph, its
    capture and the warm-up, so this runs on CPU."""
    import contextlib

    from hf_accel import accelerate_model
    from hf_accel.engine import decode_step

    model = accelerate_model(tiny.model("llama", seed=40))
    ids, mask = tiny.batch(seed=41)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    step = next(iter(model._hf_accel_engine.steps.values()))

    class FakeGraph:
        def __init__(self):
            self.captured = False

        def replay(self):
            assert self.captured, "replay without a preceding successful capture"

    failures = []

    @contextlib.contextmanager
    def capture(graph):
        yield
        if failures:
            raise failures.pop()
        graph.captured = True

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(decode_step, "capture_graph", capture)
    monkeypatch.setattr(step, "_warm_up", lambda fn=None: None)
    monkeypatch.setattr(step, "use_graph", True)
    for run in (step.run, step.run_greedy):
        failures.append(RuntimeError("CUDA out of memory (capture)"))
        with pytest.raises(RuntimeError, match="out of memory"):
            run()
        run()  # captured this time, then replayed
        run()
    assert step.graph.captured and step.graph_greedy.captured
