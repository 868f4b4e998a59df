"""The paged attention op of :func:`hf_accel.kernels.paged_attention.paged_attention` in PyTorch: the runtime path on
machines without a GPU (:func:`paged_attention_sdpa`, one ``scaled_dot_product_attention`` per call), the float
reference the kernel is tested against (:func:`paged_attention_ref`), and :func:`gather_kv`, one sequence's K or V
read out of a block pool (PagedAttention, Kwon et al. 2023, section 4.1).
"""

from __future__ import annotations

import torch

from hf_accel.kernels.attention import attention_ref, attention_sdpa, sdpa_allowed
from hf_accel.kernels.paged_attention import _check_block_ids, check_paged_args


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, row: int) -> torch.Tensor:
    """Contiguous [num_kv_heads, seq_len, head_dim] copy of one sequence's keys or values (reference/tests).

    Args:
        cache: a K or V pool [num_blocks, block_size, num_kv_heads, head_dim] (any dtype; the copy keeps it).
        block_table: [batch, max_blocks] int32 / int64 block ids per sequence.
        seq_len: tokens to gather from position 0.
        row: the sequence's row of ``block_table``.

    Raises:
        IndexError: the row's table has fewer than ``ceil(seq_len / block_size)`` entries."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table[row, pos // block_size].long()
    return cache[blocks, pos % block_size].transpose(0, 1)


def _gather_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[batch, num_kv_heads, length, head_dim] of every row's first ``length`` slots: a view of the pool when
    the batch is one row whose blocks are consecutive ids (the block manager hands out low ids first), else
    a gathered copy."""
    block_size = cache.shape[1]
    blocks = -(-length // block_size)
    table = block_table[:, :blocks].long()
    if table.shape[0] == 1 and blocks > 0:
        first = int(table[0, 0])
        if first + blocks <= cache.shape[0] and torch.equal(
                table[0], torch.arange(first, first + blocks, device=table.device)):
            return cache[first: first + blocks].flatten(0, 1)[:length].transpose(0, 1)[None]
    pos = torch.arange(length, device=cache.device)
    return cache[table[:, pos // block_size], pos % block_size].transpose(1, 2)


def _checked(query, key_cache, value_cache, block_table, seq_lens, key_mask, check_blocks: bool = True):
    """:func:`check_paged_args`, plus the host checks of :func:`paged_attention`: with ``check_blocks``, ``seq_lens``
    >= 0 and every block id read within the pools (a -1 would read the last block); a ``key_mask`` as wide as the
    longest row."""
    dims = check_paged_args(query, key_cache, value_cache, block_table, seq_lens, key_mask)
    if check_blocks:
        _check_block_ids(block_table, seq_lens, key_cache.shape[1], key_cache.shape[0])
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    if key_mask is not None and key_mask.shape[1] < longest:
        raise ValueError(f"key_mask has {key_mask.shape[1]} columns, fewer than the longest row's {longest} keys")
    return dims


def paged_attention_sdpa(query, key_cache, value_cache, block_table, seq_lens, max_seq_len=None, key_mask=None,
                         *, causal=True, sm_scale=None, check_blocks: bool = True) -> torch.Tensor:
    """The same op as :func:`paged_attention` computed with PyTorch: each row's K/V read from the pools up to
    the longest row (a view for one row in consecutive blocks, else a gathered copy), then
    :func:`hf_accel.kernels.attention.attention_sdpa` with the rows' lengths as a key mask. The runtime path
    on machines without a GPU (CPU tensors): one ``scaled_dot_product_attention`` per call instead of
    :func:`paged_attention_ref`'s per-row float32 score tensors. Same arguments and output as
    :func:`paged_attention`, except that ``max_seq_len`` is not read (each row's ``seq_lens`` entry is) and a
    block table too short for ``seq_lens`` raises IndexError; rows with no visible key are 0. Raises ValueError as
    :func:`paged_attention` does for a negative ``seq_lens`` entry or a block id read outside the pools (both
    checked only with ``check_blocks``, as there), or a ``key_mask`` narrower than the longest row."""
    batch, num_heads, _, q_len, head_dim = _checked(query, key_cache, value_cache, block_table, seq_lens, key_mask,
                                                    check_blocks)
    lengths = seq_lens.long()
    length = int(lengths.max()) if batch else 0
    if length == 0:  # no keys anywhere: every row is 0, as in the kernel
        return query.new_zeros(batch, q_len, num_heads, head_dim)
    k = _gather_rows(key_cache, block_table, length)
    v = _gather_rows(value_cache, block_table, length)
    mask = None if key_mask is None else key_mask[:, :length].bool()
    if not bool((lengths != length).any()):
        return attention_sdpa(query, k, v, mask, causal=causal, sm_scale=sm_scale)
    # shorter rows: their slots past seq_len are not theirs, and may hold anything (NaN included: a zero
    # probability times NaN is NaN)
    within = torch.arange(length, device=query.device)[None, :] < lengths[:, None]
    mask = within if mask is None else mask & within
    k = k.masked_fill(~within[:, None, :, None], 0.0)
    v = v.masked_fill(~within[:, None, :, None], 0.0)
    if not (causal and q_len > 1):
        return attention_sdpa(query, k, v, mask, causal=causal, sm_scale=sm_scale)
    # bottom-right causal per row: query i of a row of length n sees keys j <= i + n - q_len
    i = torch.arange(q_len, device=query.device)[None, :, None]
    j = torch.arange(length, device=query.device)[None, None, :]
    allowed = (j <= i + (lengths[:, None, None] - q_len)) & mask[:, None, :]
    return sdpa_allowed(query, k, v, allowed[:, None], sm_scale)


def paged_attention_ref(query, key_cache, value_cache, block_table, seq_lens, max_seq_len=None, key_mask=None,
                        *, causal=True, sm_scale=None, compute_dtype=None) -> torch.Tensor:
    """PyTorch reference of :func:`paged_attention`: gathers each sequence's K/V and calls
    :func:`hf_accel.kernels.attention.attention_ref` per sequence. Same arguments and output, except that
    ``max_seq_len`` is not read (the kernel's rows longer than it are NaN; here they are computed in full) and a
    block table too short for ``seq_lens`` raises IndexError (the kernel's rows are NaN). Raises ValueError as
    :func:`paged_attention_sdpa` does."""
    batch, num_heads, _, q_len, head_dim = _checked(query, key_cache, value_cache, block_table, seq_lens, key_mask)
    if batch == 0:
        return query.new_zeros(0, q_len, num_heads, head_dim)
    outs = []
    for b in range(batch):
        n = int(seq_lens[b])
        k = gather_kv(key_cache, block_table, n, b)[None]
        v = gather_kv(value_cache, block_table, n, b)[None]
        km = None if key_mask is None else key_mask[b : b + 1, :n]
        outs.append(attention_ref(query[b : b + 1], k, v, km, causal=causal, sm_scale=sm_scale,
                                  compute_dtype=compute_dtype))
    return torch.cat(outs, 0)
