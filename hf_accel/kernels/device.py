"""Where the Triton kernels can run: CUDA tensors, or CPU tensors under Triton's interpreter."""

from __future__ import annotations

import contextlib

import torch
import triton
from triton.runtime.jit import JITFunction


@triton.jit
def _probe():
    pass


# Triton picks the interpreter when ``@triton.jit`` runs (TRITON_INTERPRET=1 set before the kernels' modules
# are imported), so what the probe became is what the kernels of this package became.
_INTERPRETED = not isinstance(_probe, JITFunction)


def kernels_interpreted() -> bool:
    """Whether this package's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` was set before
    they were imported), and so take CPU tensors; otherwise they are compiled for a GPU and take CUDA tensors."""
    return _INTERPRETED


def on_device(device: torch.device):
    """A context in which ``device`` is PyTorch's current CUDA device, for work on a model placed on ``cuda:N``
    that is not the current device: Triton launches its kernels on the current device and that device's current
    stream (not on the tensors' device), as CUDA graph capture, side streams and events do. A null context where
    ``device`` is the current device already, or not a CUDA device."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor and a CUDA graph is being captured on the current stream (no host reads of
    device values then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_dense(op: str, **tensors) -> None:
    """ValueError naming the first of ``tensors`` (None entries skipped) that is not contiguous: ``op``'s kernel
    indexes these arguments densely (``ptr + i``), so a strided view of the right shape (``t[::2]``) would be read
    or written in the wrong places."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (the kernel indexes it densely); got shape "
                             f"{tuple(t.shape)} strides {t.stride()}: pass {name}.contiguous()")


def check_interpreter_dot(t: torch.Tensor, op: str, reference: str | None = None) -> None:
    """ValueError for bfloat16 CPU tensors under Triton's interpreter, for the ops whose kernels use ``tl.dot``:
    the interpreter keeps bfloat16 values as 16-bit integers and multiplies their bit patterns in ``tl.dot``
    (values ~1e10; triton-lang/triton#11584, not supported upstream), so the result would be silently wrong. The
    message names ``reference`` (default ``<op>_ref``) and the dtypes that work there (float16, float32)."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu" and kernels_interpreted():
        raise ValueError(f"{op}: Triton's interpreter computes tl.dot of bfloat16 operands on their bit patterns "
                         f"(triton-lang/triton#11584), so this kernel would return wrong values for bfloat16 CPU "
                         f"tensors; use float16 or float32 there, or {reference or op + '_ref'}.")


def check_launch_device(t: torch.Tensor, op: str, reference: str | None = None) -> None:
    """ValueError when ``op``'s Triton kernel would be launched on a tensor it cannot run on: a CPU tensor
    while the kernels were compiled for a GPU (Triton itself would fail with "0 active drivers"). The message
    names ``reference`` (default ``<op>_ref``), the PyTorch equivalent for any device."""
    if t.device.type == "cpu" and not kernels_interpreted():
        raise ValueError(f"{op} runs its Triton kernel on CUDA tensors, or on CPU only under Triton's interpreter "
                         f"(TRITON_INTERPRET=1 set before hf_accel is imported); got a CPU tensor. "
                         f"{reference or op + '_ref'} is the PyTorch version for any device.")
