"""Argument checks of the small-batch linear kernels (:func:`~hf_accel.kernels.fused_linear.fused_linear`,
``fused_linear_rope``, :func:`~hf_accel.kernels.gemv.gemv`, ``gemv_rope``): shapes, dtypes and strides of the
inputs, the RoPE + cache-write epilogue's operands, and tiling overrides. Each raises ValueError naming what is
wrong; nothing here launches a kernel.
"""

from __future__ import annotations

import torch

from hf_accel.kernels.reshape_and_cache import check_slot_range


def check_linear_args(x, weight, bias, norm_weight, residual, swiglu) -> tuple[int, int, int]:
    """Shape / dtype / stride checks shared by :func:`fused_linear` and :func:`~.gemv.gemv`; returns
    ``(rows, hidden, out_features)`` (``out_features`` halved with ``swiglu``). Raises ValueError."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [rows, hidden] and weight [out, hidden]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    rows, k = x.shape
    if k == 0:
        raise ValueError("x and weight have 0 input features")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}; supported: float16, bfloat16, float32")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dimension")
    if weight.dtype != x.dtype or (norm_weight is not None and norm_weight.dtype != x.dtype):
        raise ValueError(f"dtypes differ: x {x.dtype}, weight {weight.dtype}, "
                         f"norm_weight {None if norm_weight is None else norm_weight.dtype}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride(0) != 1):
        raise ValueError(f"norm_weight must be a contiguous [{k}], got {tuple(norm_weight.shape)} "
                         f"(strides {norm_weight.stride()})")
    if residual is not None:
        if norm_weight is None:
            raise ValueError("residual needs norm_weight (the sum feeds the norm)")
        if residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    out_features = weight.shape[0]
    if swiglu:
        if bias is not None:
            raise ValueError("bias is not supported with swiglu")
        if out_features % 2:
            raise ValueError(f"swiglu needs an even number of weight rows, got {out_features}")
        out_features //= 2
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"dtypes differ: x {x.dtype}, bias {bias.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}], got {tuple(bias.shape)} "
                         f"(strides {bias.stride()})")
    return rows, k, out_features


def is_int(v) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def norm_prologue_step(norm_k: int | None, block_k: int) -> int:
    """The norm prologue's step: ``block_k`` for None / 0, else a power of two in [16, 8192] (ValueError)."""
    if norm_k is None or (is_int(norm_k) and norm_k == 0):
        return block_k
    if not is_int(norm_k) or norm_k < 16 or norm_k > 8192 or norm_k & (norm_k - 1):
        raise ValueError(f"norm_k must be 0 or a power of two in [16, 8192], got {norm_k!r}")
    return norm_k


def check_tiling(num_warps, block_n, block_k, eps) -> None:
    """ValueError for tiling overrides the kernel cannot take (tl.dot needs tiles of at least 16) and a
    non-float ``eps``."""
    if num_warps is not None and (not is_int(num_warps) or num_warps not in (1, 2, 4, 8, 16)):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps!r}")
    for name, v, most in (("block_n", block_n, 256), ("block_k", block_k, 4096)):
        if v is not None and (not is_int(v) or v < 16 or v > most or v & (v - 1)):
            raise ValueError(f"{name} must be a power of two in [16, {most}], got {v!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise ValueError(f"eps must be a Python float, got {type(eps).__name__}")


def check_rope_args(x, weight, key_cache, value_cache, cos, sin, slot_mapping, num_heads: int,
                    lanes: int, check_slots: bool = True) -> tuple[int, int]:
    """Checks shared by the Q/K/V projections with a RoPE + cache-write epilogue (:func:`fused_linear_rope`,
    :func:`~.gemv.gemv_rope`); ``lanes`` (rows per program) must divide ``head_dim / 2``. Returns
    ``(num_kv_heads, head_dim)``; raises ValueError naming what is wrong."""
    rows, out_features = x.shape[0], weight.shape[0]
    if not is_int(num_heads) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(f"key_cache/value_cache must be equal-strided [num_blocks, block_size, num_kv_heads, "
                         f"head_dim]; got {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if head_dim % 2 or (head_dim // 2) % lanes:
        raise ValueError(f"head_dim {head_dim} (from the cache) is not supported here: head_dim / 2 must be a "
                         f"multiple of {lanes} (the output lanes of one program)")
    if out_features != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"weight rows {out_features} must be (num_heads {num_heads} + 2 x num_kv_heads "
                         f"{num_kv_heads}) x head_dim {head_dim} = {(num_heads + 2 * num_kv_heads) * head_dim}")
    if (cos.shape != (rows, head_dim) or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride(1) != 1
            or (rows > 1 and sin.stride(0) != cos.stride(0))):
        raise ValueError(f"cos/sin must be equal-strided [{rows}, {head_dim}] with a contiguous last dimension, "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if key_cache.stride(3) != 1:
        raise ValueError("key_cache/value_cache need a contiguous last dimension")
    if slot_mapping.shape != (rows,) or slot_mapping.dtype != torch.int32:
        raise ValueError(f"slot_mapping must be [{rows}] int32, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if len({x.dtype, cos.dtype, sin.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise ValueError(f"dtypes differ: x {x.dtype}, cos {cos.dtype}, sin {sin.dtype}, key_cache {key_cache.dtype}, "
                         f"value_cache {value_cache.dtype}")
    if check_slots:  # a slot past the pools would be written past them
        check_slot_range(slot_mapping, key_cache)
    return num_kv_heads, head_dim
