"""Write new keys/values into a paged KV cache through a slot mapping (vLLM's ``reshape_and_cache``; the paged
KV cache of Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention",
§4).

Slot ``s`` is token slot ``s % block_size`` of physical block ``s // block_size``; ``-1`` means skip
(the token is not stored, e.g. padding).
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import capturing, check_dense, check_launch_device


@triton.jit
def _reshape_and_cache_kernel(
    K, V, KCache, VCache, SlotMapping,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads, head_dim, block_size, num_slots,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):  # past the pools: not written (the launcher refuses such slots)
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        m = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
        t64 = t.to(tl.int64)
        k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=m)
        v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=m)
        k_dst = blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
        v_dst = blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
        tl.store(KCache + k_dst, k.to(KCache.dtype.element_ty), mask=m)
        tl.store(VCache + v_dst, v.to(VCache.dtype.element_ty), mask=m)


def _check(key, value, key_cache, value_cache, slot_mapping, check_slots: bool = True):
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
    if check_slots:
        check_slot_range(slot_mapping, key_cache)


def check_slot_range(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    """ValueError unless every slot of ``slot_mapping`` lies in the pools of ``key_cache`` ([num_blocks,
    block_size, ...]) or is -1 (skip): one device-to-host read of the slots' range, not done while a CUDA graph
    is being captured (there the caller's slots are trusted). A slot past the pools would be written past them."""
    if slot_mapping.numel() and not capturing(slot_mapping):
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        low, high = (int(x) for x in torch.aminmax(slot_mapping))
        if low < -1 or high >= num_slots:
            raise ValueError(f"slot_mapping holds slots in [{low}, {high}]; the pools have {num_slots} slots "
                             f"({key_cache.shape[0]} blocks of {key_cache.shape[1]}), so each slot must be in "
                             f"[0, {num_slots - 1}], or -1 to skip the token")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Scatter ``key``/``value`` rows into the block pools, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim], any float dtype, any strides.
        value: [num_tokens, num_kv_heads, head_dim], same.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], the pool (written in its dtype).
        value_cache: same shape as ``key_cache``.
        slot_mapping: [num_tokens], int32/int64 — ``block_id * block_size + offset``; -1 = skip.
        check_slots: check that every slot lies in the pools (one device-to-host read of the slots' range; not
            done while a CUDA graph is being captured). Pass False for slots made from block tables the caller
            manages; either way a slot past the pools is not written.

    Raises:
        ValueError: on shape/dtype mismatches, and (``check_slots``) on a slot below -1 or past the pools.
    """
    _check(key, value, key_cache, value_cache, slot_mapping, check_slots)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_dense("reshape_and_cache", slot_mapping=slot_mapping)
    check_launch_device(key, "reshape_and_cache")
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        num_kv_heads, head_dim, key_cache.shape[1], key_cache.shape[0] * key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping, *, check_slots: bool = True) -> None:
    """PyTorch reference of :func:`reshape_and_cache` (same arguments, in place; as there, a slot outside the
    pools is not written when ``check_slots`` is False)."""
    _check(key, value, key_cache, value_cache, slot_mapping, check_slots)
    keep = (slot_mapping >= 0) & (slot_mapping < key_cache.shape[0] * key_cache.shape[1])
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = key[keep].to(key_cache.dtype)
    value_cache[slots // block_size, slots % block_size] = value[keep].to(value_cache.dtype)


@triton.jit
def _slot_mapping_kernel(CacheLens, BlockTable, Slots, SeqLens, q_len, block_size, stride_tb, table_len,
                         BLOCK_T: tl.constexpr):
    b = tl.program_id(0)
    cached = tl.load(CacheLens + b)
    offs = tl.arange(0, BLOCK_T)
    ok = offs < q_len
    pos = cached + offs
    listed = (pos >= 0) & (pos // block_size < table_len)  # a negative cache_lens reads no table entry
    blk = tl.load(BlockTable + b.to(tl.int64) * stride_tb + pos // block_size, mask=ok & listed, other=0)
    tl.store(Slots + b * q_len + offs, tl.where(listed, blk * block_size + pos % block_size, -1), mask=ok)
    tl.store(SeqLens + b, cached + q_len)


def slot_mapping(cache_lens: torch.Tensor, block_table: torch.Tensor, q_len: int, block_size: int):
    """Cache slots of ``q_len`` new tokens per row appended after ``cache_lens`` cached ones, and the rows'
    new lengths, in one kernel (a decode step's metadata, computed on the device).

    Args:
        cache_lens: [batch] int32 — tokens already cached per row.
        block_table: [batch, max_blocks] int32, contiguous last dimension — physical block ids. A token
            past the table gets slot -1 (not written; the paged kernels answer such a row with NaN), and so
            does a token at a negative position (a negative ``cache_lens``, a caller error that a kernel cannot
            raise: the table is never read outside its row).
        q_len: new tokens per row (>= 1); block_size: tokens per cache block.

    Returns:
        ``(slots [batch * q_len] int32, seq_lens [batch] int32)``: token ``t`` of row ``b`` goes to slot
        ``block_table[b, p // block_size] * block_size + p % block_size`` with ``p = cache_lens[b] + t``;
        ``seq_lens = cache_lens + q_len``.

    Raises:
        ValueError: dtypes other than int32, shapes that do not match, ``q_len`` or ``block_size`` not a host int
            >= 1.
    """
    _check_slot_args(cache_lens, block_table, q_len, block_size)
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must have a contiguous last dimension; got strides {block_table.stride()}")
    batch = cache_lens.shape[0]
    slots = torch.empty(batch * q_len, dtype=torch.int32, device=cache_lens.device)
    seq_lens = torch.empty_like(cache_lens)
    if batch:
        check_dense("slot_mapping", cache_lens=cache_lens)
        check_launch_device(cache_lens, "slot_mapping")
        _slot_mapping_kernel[(batch,)](cache_lens, block_table, slots, seq_lens, q_len, block_size,
                                       block_table.stride(0), block_table.shape[1],
                                       BLOCK_T=triton.next_power_of_2(q_len), num_warps=1)
    return slots, seq_lens


def _check_slot_args(cache_lens, block_table, q_len, block_size) -> None:
    """The checks :func:`slot_mapping` and :func:`slot_mapping_ref` share (host-side only: no device read)."""
    if cache_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise ValueError(f"cache_lens and block_table must be int32, got {cache_lens.dtype}, {block_table.dtype}")
    if cache_lens.dim() != 1 or block_table.dim() != 2 or block_table.shape[0] != cache_lens.shape[0]:
        raise ValueError(f"cache_lens must be [batch] and block_table [batch, max_blocks] of the same batch; got "
                         f"{tuple(cache_lens.shape)}, {tuple(block_table.shape)}")
    for name, value in (("q_len", q_len), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be a host int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def slot_mapping_ref(cache_lens, block_table, q_len, block_size):
    """PyTorch reference of :func:`slot_mapping` (the same arguments and checks; any strides)."""
    _check_slot_args(cache_lens, block_table, q_len, block_size)
    pos = cache_lens.long()[:, None] + torch.arange(q_len, device=cache_lens.device)
    idx = pos // block_size
    listed = (pos >= 0) & (idx < block_table.shape[1])
    if block_table.shape[1] == 0:  # no entry to read: every token past the table
        return torch.full((pos.numel(),), -1, dtype=torch.int32, device=pos.device), cache_lens + q_len
    blk = block_table.gather(1, idx.clamp(0, block_table.shape[1] - 1)).long()
    slots = torch.where(listed, blk * block_size + pos % block_size, -1).to(torch.int32).reshape(-1)
    return slots, cache_lens + q_len
