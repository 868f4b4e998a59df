"""Programmatic dependent launch (PDL) for the decode step's kernels (Hopper and newer).

A kernel launched with PDL may start while the kernel before it in the stream is still running: its
programs call :func:`gdc_wait` (PTX ``griddepcontrol.wait``) before they read anything the previous kernel
may write or write anything at all, and :func:`gdc_launch_dependents` (``griddepcontrol.launch_dependents``)
to let the next kernel launch early. Both are no-ops in a launch without PDL.

Where the trigger goes matters: a kernel that calls :func:`gdc_launch_dependents` as it starts lets the
next one launch while it runs, and if that one triggers at its start too, the one after it, and so on.
The GEMV / fused-linear kernels and the split merge trigger at their start (the next projection's first
weight loads then overlap them); the RoPE and attention kernels only wait (their dependents launch as
their programs exit).
H200, Llama-3-8B shape, bs1 (``bench_generate-pdl-ab-20261201-435ee97.json``): with every kernel of the
step triggering at its start, 197.0 tok/s against 212.8 without PDL. Inside a CUDA graph the
launches become programmatic dependency edges, so the saving (launch latency, and for
:mod:`.gemv` the first weight loads) holds on every replay. NVIDIA, CUDA C++ Programming Guide,
"Programmatic Dependent Launch and Synchronization".
"""

from __future__ import annotations

import functools

import torch

try:  # triton >= 3.3 exposes grid dependency control; without it kernels run without PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed triton
    gdc_launch_dependents = gdc_wait = None

#: Whether this triton can launch kernels with programmatic dependent launch at all.
PDL_AVAILABLE = gdc_wait is not None


@functools.lru_cache(maxsize=None)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(requested: bool, tensor: torch.Tensor) -> bool:
    """Whether a launch on ``tensor``'s device can take PDL: requested, a triton with grid dependency
    control, and a CUDA device of compute capability >= 9.0 (elsewhere the flag is ignored)."""
    if not (requested and PDL_AVAILABLE and tensor.is_cuda):
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return _device_has_pdl(index)
