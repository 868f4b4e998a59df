"""publish_counters / HostCounters: counters a kernel writes into (page-locked) host memory for the host to poll."""

from __future__ import annotations

import pytest
import torch

from hf_accel.kernels import host_counters as hc
from hf_accel.kernels.host_counters import RING, HostCounters, publish_counters, publish_counters_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # Triton's interpreter on CPU


@pytest.mark.parametrize("n", [1, 5, 38, 310])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_kernel_matches_reference_over_the_ring(n, dtype):
    """Rounds 1..RING+3 (the ring wraps): each publish writes its counters and its number into row number % RING,
    the kernel (into page-locked memory from CUDA; CPU: Triton's interpreter) as the PyTorch reference."""
    g = torch.Generator().manual_seed(n)
    rings = [torch.zeros(RING, n + 1, dtype=torch.long, pin_memory=CUDA), torch.zeros(RING, n + 1, dtype=torch.long)]
    seqs = [torch.zeros(1, dtype=torch.long, device=DEV), torch.zeros(1, dtype=torch.long)]
    for r in range(1, RING + 4):
        src = torch.randint(0, 2 if dtype == torch.bool else 1000, (n,), generator=g).to(dtype)
        publish_counters(src.to(DEV), seqs[0], rings[0])
        publish_counters_ref(src, seqs[1], rings[1])
        if CUDA:
            torch.cuda.synchronize()
        for ring, seq in zip(rings, seqs):
            assert int(seq) == r
            assert int(ring[r % RING, 0]) == r
            assert torch.equal(ring[r % RING, 1:], src.long())
    assert torch.equal(rings[0], rings[1])


def test_expect_marks_the_row_and_wait_returns_a_copy():
    counters = HostCounters(3, "cpu")
    counters.ring[2, 0] = 2  # left by an earlier call, whose numbers started at 1 too
    assert counters.expect(2) == 2 and int(counters.ring[2, 0]) == -1  # never taken for this call's round 2
    publish_counters_ref(torch.tensor([7, 8, 9]), counters.seq, counters.ring)
    publish_counters_ref(torch.tensor([4, 5, 6]), counters.seq, counters.ring)
    row = counters.wait(2)
    assert row.tolist() == [4, 5, 6]
    counters.ring[2, 1] = 0
    assert row.tolist() == [4, 5, 6]  # a copy: later rounds rewrite the ring
    counters.reset()
    assert int(counters.seq) == 0 and counters.launched == 0


def test_wait_raises_when_nothing_arrives(monkeypatch):
    monkeypatch.setattr(hc, "WAIT_TIMEOUT_S", 0.05)
    counters = HostCounters(2, "cpu")
    number = counters.expect(1)
    with pytest.raises(RuntimeError, match="round 1's counters did not reach"):
        counters.wait(number)


@pytest.mark.parametrize("rounds", [0, RING, -1])
def test_expect_refuses_more_rounds_than_the_ring_holds(rounds):
    with pytest.raises(ValueError, match="rounds must be in"):
        HostCounters(2, "cpu").expect(rounds)


def test_bad_arguments_name_what_is_wrong():
    src, seq = torch.zeros(4, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="ring must be int64"):
        publish_counters(src, seq, torch.zeros(RING, 4, dtype=torch.long))  # no room for the number
    with pytest.raises(ValueError, match="ring must be int64"):
        publish_counters(src, seq, torch.zeros(RING, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="seq must be one int64"):
        publish_counters(src, torch.zeros(2, dtype=torch.long), torch.zeros(RING, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        publish_counters(torch.zeros(8, dtype=torch.long)[::2], seq, torch.zeros(RING, 5, dtype=torch.long))


def test_a_cpu_device_needs_no_probe():
    assert hc.host_counters_available("cpu")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_graph_rounds_publish_into_page_locked_memory():
    """Replays of a captured graph write each round's counters into the page-locked ring, which the host polls
    while a later round is still queued; a pageable ring is refused."""
    assert hc.host_counters_available("cuda")
    counters = HostCounters(5, "cuda")
    info = torch.zeros(5, dtype=torch.long, device="cuda")

    def round_():
        info.add_(torch.arange(1, 6, device="cuda"))
        publish_counters(info, counters.seq, counters.ring)

    scratch = HostCounters(5, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture, into another ring
        publish_counters(info, scratch.seq, scratch.ring)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_()
    numbers = []
    for _ in range(3 * RING):
        numbers.append(counters.expect(1))
        graph.replay()
        if len(numbers) > 2:  # two rounds queued behind the one read
            n = numbers.pop(0)
            assert counters.wait(n).tolist() == [n * j for j in range(1, 6)]
    for n in numbers:
        assert counters.wait(n).tolist() == [n * j for j in range(1, 6)]
    with pytest.raises(ValueError, match="page-locked"):
        publish_counters(info, counters.seq, torch.zeros(RING, 6, dtype=torch.long))


def test_wait_lets_other_python_threads_run():
    """A poll that held the GIL would keep a thread that writes the counters (standing in for any other Python thread:
    a server's, a streamer's consumer) waiting for the interpreter's switch interval, here 2 s; the wait releases it
    between reads, so the round arrives in about the writer's own 50 ms."""
    import sys
    import threading
    import time

    counters = HostCounters(2, "cpu")
    number = counters.expect(1)

    def writer():
        time.sleep(0.05)
        publish_counters_ref(torch.tensor([5, 6]), counters.seq, counters.ring)

    old = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        thread = threading.Thread(target=writer)
        t0 = time.perf_counter()
        thread.start()
        row = counters.wait(number)
        elapsed = time.perf_counter() - t0
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert row.tolist() == [5, 6]
    assert elapsed < 1.0, elapsed
