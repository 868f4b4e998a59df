"""RMSNorm with an optional fused residual add (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization"), rounding like transformers' ``LlamaRMSNorm`` so decode matches the stock model.

transformers computes ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)`` and, before it, the
residual sum ``residual + x`` in the model dtype; the kernel rounds at the same points (fp32 inside),
replacing ~8 kernels per norm with one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_dense, check_launch_device


@triton.jit
def _rms_norm_kernel(
    X, R, W, Y, ROut,
    stride_x, stride_r, stride_y, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    m = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ROut + row * stride_ro + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=m, other=0.0)
    tl.store(Y + row * stride_y + offs, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``y = weight * rmsnorm(x + residual)``; returns ``y`` (and ``x + residual`` when given).

    Args:
        x: [rows, hidden], fp16/bf16/fp32, last dim contiguous.
        weight: [hidden], the norm's weight (its dtype is the output's, as in transformers).
        eps: variance epsilon.
        residual: optional [rows, hidden], same dtype as ``x``.

    Returns:
        ``y`` [rows, hidden] in ``weight``'s dtype, or ``(y, x + residual)``.

    Raises:
        ValueError: shape mismatches, a non-contiguous last dimension, non-floating-point tensors, a residual of
            another dtype than ``x``, or an ``eps`` that is not a Python number.
    """
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise ValueError(f"eps must be a Python float, got {type(eps).__name__}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"rms_norm: {name} must be floating point, got {t.dtype}")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"rms_norm: residual dtype {residual.dtype} differs from x's {x.dtype}")
    if x.dim() != 2 or weight.shape != (x.shape[1],) or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, hidden] with contiguous rows and weight [hidden]; got "
                         f"{tuple(x.shape)} (strides {x.stride()}), {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    rows, hidden = x.shape
    y = torch.empty(rows, hidden, dtype=weight.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else y
    r_in = residual if residual is not None else x
    check_dense("rms_norm", weight=weight)
    check_launch_device(x, "rms_norm")
    _rms_norm_kernel[(rows,)](
        x, r_in, weight, y, r_out, x.stride(0), r_in.stride(0), y.stride(0), r_out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_N=triton.next_power_of_2(hidden),
        num_warps=4 if hidden <= 2048 else 8,
    )
    return (y, r_out) if residual is not None else y


def rms_norm_ref(x, weight, eps, residual=None):
    """PyTorch reference of :func:`rms_norm` (the ops of transformers' ``LlamaRMSNorm``)."""
    if residual is not None:
        x = residual + x
    xf = x.to(torch.float32)
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y, x) if residual is not None else y
