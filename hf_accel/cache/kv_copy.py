"""Copying K/V between paged caches: the positions of some sequences of one :class:`PagedCache` into the same
positions of sequences of another (a prefix passed in by the caller into the fast path's own cache, and the
kept tokens back out to the caller's cache).
"""

from __future__ import annotations

import torch

from hf_accel.cache.paged_cache import PagedCache
from hf_accel.kernels.reshape_and_cache import slot_mapping_ref


def _cache_slots(cache: PagedCache, seqs: list[int], start: int, end: int) -> torch.Tensor:
    """Pool slots (int32, CPU) of token positions ``start .. end - 1`` of each sequence in ``seqs``, row after row."""
    tables = [cache.manager.block_table(s) for s in seqs]
    table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = torch.full((len(tables),), start, dtype=torch.int32)
    return slot_mapping_ref(starts, table, end - start, cache.block_size)[0]


def copy_kv(src: PagedCache, src_seqs: list[int], dst: PagedCache, dst_seqs: list[int], start: int, end: int) -> None:
    """Copy the K/V of token positions ``start .. end - 1`` of sequence ``src_seqs[r]`` of ``src`` into the same
    positions of ``dst_seqs[r]`` of ``dst``, in every layer. Both caches' blocks must be allocated for those positions,
    with the same layer count, K/V head count, head dim and dtype, ``len(src_seqs) == len(dst_seqs)`` and both pools on
    one device; their block sizes may differ. One gather and one scatter per pool."""
    if end <= start:
        return
    device = src.layers[0].keys.device
    src_slots = _cache_slots(src, src_seqs, start, end).to(device, torch.long)
    dst_slots = _cache_slots(dst, dst_seqs, start, end).to(device, torch.long)
    for a, b in zip(src.layers, dst.layers):
        for name in ("keys", "values"):
            pool_a, pool_b = getattr(a, name), getattr(b, name)
            pool_b.view(-1, *pool_b.shape[2:])[dst_slots] = pool_a.view(-1, *pool_a.shape[2:])[src_slots]
