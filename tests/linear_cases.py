"""Inputs and option sets shared by the fused_linear and gemv tests (same op, same reference)."""

from __future__ import annotations

import torch

#: The option combinations both kernels are checked in.
MODES = ["plain", "bias", "norm", "norm_residual", "norm_residual_swiglu", "norm_f32"]


def linear_inputs(rows, hidden, out, dtype, seed=0):
    """x, residual [rows, hidden], weight [out, hidden] (~unit outputs), norm weight [hidden], bias [out]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    r = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(out, hidden, generator=g) / hidden**0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    b = torch.randn(out, generator=g).to(dtype)
    return x, r, w, nw, b


def linear_kwargs(mode, r, nw, b):
    """The keyword arguments of ``mode`` (one of :data:`MODES`)."""
    kw = {}
    if mode == "bias":
        kw["bias"] = b
    if mode.startswith("norm"):
        kw.update(norm_weight=nw, eps=1e-5)
    if "residual" in mode:
        kw["residual"] = r
    if "swiglu" in mode:
        kw["swiglu"] = True
    if mode == "norm_f32":
        kw["out_dtype"] = torch.float32
    return kw
