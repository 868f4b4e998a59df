"""Write new keys/values into a paged KV cache through a slot mapping (vLLM's ``reshape_and_cache``).

Slot ``s`` is token slot ``s % block_size`` of physical block ``s // block_size``; ``-1`` means skip
(the token is not stored, e.g. padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    K, V, KCache, VCache, SlotMapping,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        m = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
        t64 = t.to(tl.int64)
        k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=m)
        v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=m)
        dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
        tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=m)
        tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=m)


def _check(key, value, key_cache, value_cache, slot_mapping):
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be [num_tokens, num_kv_heads, head_dim] and equal; got "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache/value_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and "
                         f"equal; got {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}]; got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into the block pools, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim], any float dtype, any strides.
        value: [num_tokens, num_kv_heads, head_dim], same.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], the pool (written in its dtype).
        value_cache: same shape as ``key_cache``.
        slot_mapping: [num_tokens], int32/int64 — ``block_id * block_size + offset``; -1 = skip.

    Raises:
        ValueError: on shape/dtype mismatches.
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(),
        num_kv_heads, head_dim, key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping) -> None:
    """PyTorch reference of :func:`reshape_and_cache` (same arguments, in place)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = key[keep].to(key_cache.dtype)
    value_cache[slots // block_size, slots % block_size] = value[keep].to(value_cache.dtype)
