"""Arrival counters: the last program of a group to finish does the group's final step (a serial
split-K reduction, a split-KV merge) inside the same kernel, instead of a second kernel.

Each program stores its partial result, then :func:`last_to_arrive` makes those stores visible (a CTA
barrier, then an acquire/release atomic increment at GPU scope) and tells whether every other program of
the group has already arrived. That program reads the partials (loads with ``cache_modifier=".cg"``, past
the SM's L1), resets the counter to zero with :func:`reset_arrivals` for the next launch, and finishes.
The scheme is CUTLASS's "serial split-K" semaphore. Counters are int32 zeros owned by the caller and used
by one stream at a time (:func:`check_counters`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter, group_size):
    """Whether this program is the last of ``group_size`` to arrive at ``counter`` (after its stores)."""
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    return arrived == group_size - 1


@triton.jit
def reset_arrivals(counter):
    """Zero ``counter`` again for the next launch (by the last program, after it read the partials)."""
    tl.atomic_xchg(counter, 0)


def check_counters(counters: torch.Tensor, need: int, device, name: str = "counters") -> None:
    """Raise ValueError unless ``counters`` is a contiguous int32 tensor of >= ``need`` elements on ``device``."""
    if (counters.dtype != torch.int32 or counters.device != device or not counters.is_contiguous()
            or counters.numel() < need):
        raise ValueError(f"{name} must be a contiguous int32 tensor of >= {need} zeros on {device}, got "
                         f"{counters.dtype} {tuple(counters.shape)} on {counters.device}")
