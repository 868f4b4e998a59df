"""The non-blocking EOS check of the fast path's CUDA-graph loops (``_EosWatch``): its ring of host rows,
checked on CPU with stand-in events (the GPU tests in test_fast_generate_gpu.py count real steps)."""

import pytest
import torch

from hf_accel.engine import fast_generate as fg


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self):
        self.log.append("record")

    def synchronize(self):
        self.log.append("sync")


class _Step:
    """What _EosWatch uses of a DecodeStep: ``host_flags(ring)`` (here plain CPU rows)."""

    def __init__(self, batch, log):
        self.batch, self.log = batch, log

    def host_flags(self, ring):
        # all False ("finished"), as rows left by an earlier call may be: a watch that read a slot before this
        # call wrote it would stop early
        rows = torch.zeros(ring, self.batch, dtype=torch.bool)
        return rows, rows.numpy(), [_Event(self.log) for _ in range(ring)]


@pytest.mark.parametrize("lag", [1, 2, 3])
@pytest.mark.parametrize("rows,finish_at", [(1, [0]), (1, [5]), (3, [2, 9, 4]), (2, [7, 7])])
def test_reports_every_row_finished_exactly_lag_steps_late(lag, rows, finish_at):
    log = []
    watch = fg._EosWatch(_Step(4, log), lag)  # the step's batch bucket may be wider than the call's rows
    last = max(finish_at)
    for i in range(last + lag + 3):
        unfinished = torch.tensor([i < f for f in finish_at])
        done = watch.all_finished(unfinished)
        # step i's flags are read at step i + lag; every row has finished after step ``last``
        assert done == (i >= last + lag), (i, done)
        if done:
            break
    assert log.count("record") == i + 1 and log.count("sync") == max(0, i + 1 - lag)


def test_a_row_that_finishes_stays_finished_in_the_flags():
    """Flags only go from unfinished to finished; one unfinished row keeps the call going."""
    log = []
    watch = fg._EosWatch(_Step(2, log), 2)
    assert not any(watch.all_finished(torch.tensor([False, True])) for _ in range(20))


class _PublishingStep:
    """A DecodeStep whose greedy graph publishes its unfinished flags (``greedy_flags``): ``run`` stands for one
    replay of that graph (the number first, as ``run_greedy`` takes it, then the kernel's writes)."""

    def __init__(self, batch):
        from hf_accel.kernels.host_counters import HostCounters

        self.batch = batch
        self.greedy_flags = HostCounters(batch, "cpu")
        self.greedy_flags_number = 0

    def run(self, unfinished):
        from hf_accel.kernels.host_counters import publish_counters_ref

        self.greedy_flags_number = self.greedy_flags.expect(1)
        flags = torch.zeros(self.batch, dtype=torch.bool)  # the bucket's unused rows: finished
        flags[: unfinished.shape[0]] = unfinished
        publish_counters_ref(flags, self.greedy_flags.seq, self.greedy_flags.ring)

    def host_flags(self, ring):
        raise AssertionError("a step whose graph publishes its flags needs no copies")


@pytest.mark.parametrize("lag", [1, 2, 3])
@pytest.mark.parametrize("rows,finish_at", [(1, [0]), (1, [5]), (3, [2, 9, 4]), (2, [7, 7])])
def test_published_flags_report_every_row_finished_exactly_lag_steps_late(lag, rows, finish_at):
    """The same answers from the flags the step's graph wrote into the ring, also in a second call on the same
    step (whose ring holds the first call's rows: round numbers keep counting over the step's life)."""
    step = _PublishingStep(4)
    for _ in range(2):
        watch = fg._EosWatch(step, lag, published=True)
        last = max(finish_at)
        for i in range(last + lag + 3):
            unfinished = torch.tensor([i < f for f in finish_at])
            step.run(unfinished)
            done = watch.all_finished(unfinished)
            assert done == (i >= last + lag), (i, done)
            if done:
                break
