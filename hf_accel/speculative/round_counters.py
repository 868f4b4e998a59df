"""The host's side of a speculative round: its counters (written into page-locked memory by the round's last kernel,
:mod:`hf_accel.kernels.host_counters`, or copied there after the round; see
:class:`~hf_accel.speculative.state.RoundState` and :mod:`hf_accel.kernels.commit_tokens` for the layout) and its
time, fed to the draft-length choosers of :mod:`.draft_length`."""

from __future__ import annotations

import time

from hf_accel.kernels.commit_tokens import INFO_CLASS_HIST, MAX_DRAFT, NUM_CLASSES


def round_seconds(event, last_done, captured: bool, rounds: int) -> float | None:
    """Seconds per round from the last round's completion to this one's (``event``; ``last_done`` = (the last
    round's event, whether it captured a graph)): None where either captured a graph or no round came before."""
    if captured or last_done is None or last_done[1]:
        return None
    event.synchronize()  # counters polled from host memory can arrive just before the event that follows them
    return last_done[0].elapsed_time(event) / 1e3 / rounds


def read_ungated_round(chooser, event, row, k: int, rounds: int, captured: bool, t0: float,
                       last_done) -> tuple[bool, int]:
    """Ungated rounds: wait for a queued round (its CUDA event; None for eager rounds, timed by the wall clock
    since ``t0``), update the ``_KChooser`` with its accepted-count histogram (``row``, the round's page-locked
    counters) and its time; returns (any row still active, the largest token budget left in a row)."""
    if event is not None:
        event.synchronize()
        seconds = round_seconds(event, last_done, captured, rounds)
    else:
        seconds = None if captured else (time.perf_counter() - t0) / rounds
    chooser.update(k, row[5: 6 + k].tolist(), seconds)
    return bool(row[0]), int(row[4])


def update_gated(chooser, row, k: int, rounds: int, captured: bool, timing) -> None:
    """``_GatedChooser.update`` from a round's counters (``row``: a numpy int64 array of the ``info`` layout, with
    its per-class histograms), run after the next round's launch. ``timing``: (this round's CUDA event, the last
    round's (event, captured)), see :func:`round_seconds`; else seconds per round already measured, or None."""
    seconds = round_seconds(timing[0], timing[1], captured, rounds) if isinstance(timing, tuple) else timing
    stride = MAX_DRAFT + 1
    hists = row[INFO_CLASS_HIST: INFO_CLASS_HIST + NUM_CLASSES * stride].reshape(NUM_CLASSES, stride)[:, : k + 1]
    chooser.update(k, hists.tolist(), seconds)
