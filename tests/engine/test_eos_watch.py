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
