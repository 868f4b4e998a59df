"""SwiGLU gate (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up`` in one kernel,
rounded like transformers' ``act_fn(gate_proj(x)) * up_proj(x)`` (silu result rounded to the dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_launch_device


@triton.jit
def _swiglu_kernel(G, U, Out, stride_g, stride_u, stride_o, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = offs < n_cols
    g = tl.load(G + row * stride_g + offs, mask=m, other=0.0)
    u = tl.load(U + row * stride_u + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(Out + row * stride_o + offs, (s.to(tl.float32) * u.to(tl.float32)).to(Out.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``.

    Args:
        gate, up: [rows, intermediate], same dtype, contiguous rows.

    Returns:
        [rows, intermediate] in that dtype.

    Raises:
        ValueError: shape mismatch, non-contiguous rows, or dtypes that are not one floating-point type.
    """
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must be equal 2-D with contiguous rows")
    if not gate.is_floating_point() or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must have one floating-point dtype, got {gate.dtype} and {up.dtype}")
    rows, n = gate.shape
    out = torch.empty_like(gate)
    block = 1024
    check_launch_device(gate, "swiglu")
    _swiglu_kernel[(rows, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n,
                                                  BLOCK_N=block)
    return out


def swiglu_ref(gate, up):
    """PyTorch reference of :func:`swiglu`."""
    return torch.nn.functional.silu(gate) * up
