"""Rotary embedding of Q and K fused with writing K/V into the paged cache (decode step).

RoPE (Su et al. 2021, "RoFormer", §3.4.2) in transformers' "rotate_half" layout: for the first half of
the head ``x*cos - x[d+D/2]*sin``, for the second ``x*cos + x[d-D/2]*sin``, rounded like
``q * cos + rotate_half(q) * sin`` in the model dtype. An optional per-head RMSNorm of Q and K before the
rotation (Qwen3's ``q_norm``/``k_norm``) is applied in the same kernel. K (rotated) and V go straight to
slot ``slot_mapping[b]`` of the pools, so the step runs one kernel instead of ~20.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_dense, check_launch_device, kernels_interpreted
from hf_accel.kernels.reshape_and_cache import check_slot_range

from hf_accel.kernels.pdl import gdc_wait, use_pdl


@triton.jit
def _rope_cache_kernel(
    Q, K, V, Cos, Sin, QNormW, KNormW, QOut, KCache, VCache, SlotMapping, KOut,
    stride_qb, stride_kb, stride_vb, stride_cb, stride_ob, stride_kob,
    stride_kcb, stride_kcs, stride_kch,
    num_heads, num_kv_heads, head_dim, block_size, eps,
    HAS_QK_NORM: tl.constexpr,
    HAS_K_OUT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token ``program_id(0)``, heads ``program_id(1) * BLOCK_H + [0, BLOCK_H)`` of the flat list (q heads, then
    k heads): a ``[BLOCK_H, BLOCK_D]`` tile, one head per row."""
    if PDL:
        gdc_wait()  # everything this kernel reads or writes may belong to the previous kernel
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    half = head_dim // 2
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < head_dim
    partner = tl.where(offs < half, offs + half, offs - half)
    sign = tl.where(offs < half, -1.0, 1.0)
    cos = tl.load(Cos + b * stride_cb + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + b * stride_cb + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    is_q = (heads < num_heads)[:, None]
    is_k = ((heads >= num_heads) & (heads < num_heads + num_kv_heads))[:, None]
    kv_head = (heads - num_heads)[:, None]
    mq = is_q & d_ok[None, :]
    mk = is_k & d_ok[None, :]
    q_row = Q + b * stride_qb + heads[:, None] * head_dim
    k_row = K + b * stride_kb + kv_head * head_dim
    x = tl.where(is_q, tl.load(q_row + offs[None, :], mask=mq, other=0.0),
                 tl.load(k_row + offs[None, :], mask=mk, other=0.0))
    xp = tl.where(is_q, tl.load(q_row + partner[None, :], mask=mq, other=0.0),
                  tl.load(k_row + partner[None, :], mask=mk, other=0.0))
    dt = x.dtype
    if HAS_QK_NORM:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 1) / head_dim + eps)[:, None]
        w = tl.where(is_q, tl.load(QNormW + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :],
                     tl.load(KNormW + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :])
        wp = tl.where(is_q, tl.load(QNormW + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :],
                      tl.load(KNormW + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :])
        x = (w * (xf * rstd).to(dt).to(tl.float32)).to(dt)
        xp = (wp * (xp.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
    t1 = (x.to(tl.float32) * cos).to(dt).to(tl.float32)
    t2 = ((sign[None, :] * xp.to(tl.float32)) * sin).to(dt).to(tl.float32)
    out = (t1 + t2).to(dt)
    tl.store(QOut + b * stride_ob + heads[:, None] * head_dim + offs[None, :], out, mask=mq)
    if HAS_K_OUT:
        tl.store(KOut + b * stride_kob + kv_head * head_dim + offs[None, :], out, mask=mk)
    slot = tl.load(SlotMapping + b).to(tl.int64)
    if slot >= 0:
        dst = (slot // block_size) * stride_kcb + (slot % block_size) * stride_kcs + kv_head * stride_kch
        tl.store(KCache + dst + offs[None, :], out.to(KCache.dtype.element_ty), mask=mk)
        v = tl.load(V + b * stride_vb + kv_head * head_dim + offs[None, :], mask=mk, other=0.0)
        tl.store(VCache + dst + offs[None, :], v.to(VCache.dtype.element_ty), mask=mk)


#: Most heads one program takes under Triton's interpreter (:func:`heads_per_program`).
INTERPRETER_MAX_HEADS = 64


def heads_per_program(heads: int) -> int:
    """Heads (q, then k) per program of :func:`rope_and_cache`: 1 on the GPU (a program per token and head);
    under Triton's interpreter, which runs the programs one after another at a Python cost per operation
    whatever the tile's size, all of them (padded to a power of two, at most :data:`INTERPRETER_MAX_HEADS`)."""
    return min(INTERPRETER_MAX_HEADS, triton.next_power_of_2(heads)) if kernels_interpreted() else 1


def rope_and_cache(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, q_norm_weight=None,
                   k_norm_weight=None, eps: float = 1e-6, pdl: bool = False,
                   k_out: torch.Tensor | None = None, check_slots: bool = True) -> torch.Tensor:
    """Rotate Q/K of one decode token per row, write K/V to the cache; returns rotated Q.

    Args:
        q: [batch, num_heads * head_dim]; k, v: [batch, num_kv_heads * head_dim] (projection outputs,
            rows contiguous), fp16/bf16/fp32.
        cos, sin: [batch, head_dim], the rotary tables at each row's position (transformers' layout).
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], one layout (equal strides),
            contiguous last dims.
        slot_mapping: [batch] int32 — ``block * block_size + offset``; -1 = do not write.
        q_norm_weight, k_norm_weight: optional [head_dim] per-head RMSNorm weights applied before RoPE.
        eps: the RMSNorm epsilon of those norms (Qwen3's ``rms_norm_eps``).
        pdl: launch with programmatic dependent launch where available (:mod:`.pdl`; ignored elsewhere).
        k_out: optional [batch, num_kv_heads, head_dim] buffer of q's dtype, contiguous, that also receives the
            rotated K of every row (rows with slot -1 included): a prompt prefill's attention then reads K
            from it instead of the paged cache.
        check_slots: check that every slot lies in the pools or is -1
            (:func:`~.reshape_and_cache.check_slot_range`: one device-to-host read, skipped while a CUDA graph is
            captured); the decode step passes False for the slots it made from its own block tables.

    Returns:
        [batch, num_heads, head_dim] rotated queries.

    Raises:
        ValueError: shape mismatches, caches of different layouts, a ``k_out`` of another shape, dtype or device,
            or not contiguous; q/k/v/cos/sin or the caches not floating point; norm weights not [head_dim];
            (``check_slots``) a slot below -1 or past the pools.
    """
    batch = q.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = q.shape[1] // head_dim
    if (q.shape[1] % head_dim or k.shape != (batch, num_kv_heads * head_dim) or v.shape != k.shape
            or cos.shape != (batch, head_dim) or sin.shape != cos.shape or slot_mapping.shape != (batch,)):
        raise ValueError(f"rope_and_cache shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos {tuple(cos.shape)}, cache {tuple(key_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride() \
            or key_cache.stride(3) != 1:
        raise ValueError(f"key_cache and value_cache must have one shape and one layout with contiguous rows; got "
                         f"{tuple(key_cache.shape)} strides {key_cache.stride()} and {tuple(value_cache.shape)} "
                         f"strides {value_cache.stride()}")
    for t in (q, k, v, cos, sin):
        if t.stride(1) != 1:
            raise ValueError("q, k, v, cos, sin need contiguous rows")
    if k_out is not None and (tuple(k_out.shape) != (batch, num_kv_heads, head_dim) or k_out.dtype != q.dtype
                              or k_out.device != q.device or not k_out.is_contiguous()):
        raise ValueError(f"k_out must be a contiguous [{batch}, {num_kv_heads}, {head_dim}] {q.dtype} tensor on "
                         f"{q.device}; got {tuple(k_out.shape)} {k_out.dtype} on {k_out.device}")
    q_out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    has_norm = q_norm_weight is not None
    pdl = use_pdl(pdl, q)
    if sin.stride(0) != cos.stride(0):
        raise ValueError(f"rope_and_cache: cos and sin must have one row stride; got {cos.stride(0)} and "
                         f"{sin.stride(0)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope_and_cache: give both q_norm_weight and k_norm_weight, or neither")
    for name, t in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if t is not None and tuple(t.shape) != (head_dim,):
            raise ValueError(f"rope_and_cache: {name} must be [head_dim={head_dim}], got {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("key_cache", key_cache)):
        if not t.is_floating_point():
            raise ValueError(f"rope_and_cache: {name} must be floating point, got {t.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_and_cache: slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if check_slots:
        check_slot_range(slot_mapping, key_cache)
    check_dense("rope_and_cache", q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, slot_mapping=slot_mapping)
    check_launch_device(q, "rope_and_cache")
    block_h = heads_per_program(num_heads + num_kv_heads)
    _rope_cache_kernel[(batch, triton.cdiv(num_heads + num_kv_heads, block_h))](
        q, k, v, cos, sin, q_norm_weight if has_norm else q, k_norm_weight if has_norm else q,
        q_out, key_cache, value_cache, slot_mapping, k_out if k_out is not None else q_out,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), q_out.stride(0),
        k_out.stride(0) if k_out is not None else 0,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_heads, num_kv_heads, head_dim, key_cache.shape[1], eps,
        HAS_QK_NORM=has_norm, HAS_K_OUT=k_out is not None, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=pdl, num_warps=1,
        **({"launch_pdl": True} if pdl else {}),
    )
    return q_out


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_and_cache_ref(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, q_norm_weight=None,
                       k_norm_weight=None, eps: float = 1e-6, pdl: bool = False,
                       k_out: torch.Tensor | None = None, check_slots: bool = True) -> torch.Tensor:
    """PyTorch reference of :func:`rope_and_cache` (transformers' ops), same arguments and result."""
    from hf_accel.kernels.reshape_and_cache import reshape_and_cache_ref
    from hf_accel.kernels.rms_norm import rms_norm_ref

    batch = q.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    qh = q.view(batch, -1, head_dim)
    kh = k.view(batch, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        qh = rms_norm_ref(qh.reshape(-1, head_dim), q_norm_weight, eps).view(qh.shape)
        kh = rms_norm_ref(kh.reshape(-1, head_dim), k_norm_weight, eps).view(kh.shape)
    c, s = cos[:, None, :], sin[:, None, :]
    q_rot = qh * c + _rotate_half(qh) * s
    k_rot = kh * c + _rotate_half(kh) * s
    reshape_and_cache_ref(k_rot, v.view(batch, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping,
                          check_slots=check_slots)
    if k_out is not None:
        k_out.copy_(k_rot)
    return q_rot
