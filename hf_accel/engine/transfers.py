"""Host-to-device copies that do not wait for the GPU.

``cuda_tensor.copy_(cpu_tensor)`` from ordinary (pageable) host memory, and ``cuda_tensor[...] = cpu_tensor``
or ``torch.tensor(values, device="cuda")``, make PyTorch synchronise the stream after the copy: the host
waits until every kernel queued before it has finished. Inside a ``generate`` call that is issued right after
the prefill is queued, that wait serialises the host's set-up work behind the prefill (about 1.2-1.4 ms of
SmolLM2 prefill on the H200 in ``profile_call_overhead``) instead of overlapping it. These helpers stage the
values in page-locked memory (PyTorch's caching host allocator keeps the staging buffer alive until the copy
has run) and copy without blocking, so the copy is ordered on the stream like a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_from_host(dst: torch.Tensor, src) -> torch.Tensor:
    """Copy ``src`` (a CPU tensor, or a sequence of numbers) into ``dst`` without a host sync when ``dst`` is
    on a CUDA device (a plain ``copy_`` elsewhere). Returns ``dst``.

    Raises:
        ValueError: ``src`` does not have ``dst``'s number of elements (shapes are otherwise broadcast as by
            ``copy_``).
        RuntimeError: called while the current CUDA stream is capturing a graph.
    """
    if not isinstance(src, torch.Tensor):
        src = torch.tensor(list(src) if not isinstance(src, Sequence) else src, dtype=dst.dtype)
    if src.numel() != dst.numel():
        raise ValueError(f"copy_from_host: {src.numel()} values for a destination of {dst.numel()} elements")
    if dst.numel() == 0:
        return dst
    if dst.is_cuda and src.device.type == "cpu":
        if torch.cuda.is_current_stream_capturing():
            # a captured copy would read the staging buffer again at every replay, after it was reused
            raise RuntimeError("copy_from_host inside a CUDA-graph capture: copy into a static buffer before capturing")
        dst.copy_(src.to(dst.dtype).pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
    return dst
