"""Merging split-KV partial attention outputs (FlashDecoding) inside the kernel that consumes them.

FlashDecoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference") splits the keys
of one query into partitions; each yields an output normalised within its split, ``o_s``, and its log-sum-exp
``lse_s``, and the exact attention output is ``sum_s exp(lse_s - lse) * o_s`` with ``lse = log sum_s
exp(lse_s)``. :func:`~hf_accel.kernels.paged_attention.paged_attention` does that in a second kernel; here it
is a tile function for the prologue of the next matmul (the attention output projection,
:func:`~hf_accel.kernels.gemv.gemv_merge_splits`), which saves a kernel and its output round trip per layer.
The log-sum-exps are in base 2 (``log2 sum exp2``), as the attention kernel writes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merged_tile(X, Lse, k0, num_splits, stride_xs, stride_ls, num_heads, dt,
                 WIDTH: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Columns ``k0 .. k0 + WIDTH`` (``k0`` a multiple of ``HEAD_DIM``) of the merged attention output row, as
    float32 after rounding to ``dt``: ``X`` [num_splits, num_heads * HEAD_DIM] float32 partial outputs,
    ``Lse`` [num_splits, num_heads] float32 log2-sum-exp2 (-inf: the split saw no key). Splits are taken
    ``CHUNK_S`` at a time (all their loads in flight together), merged online across chunks."""
    HEADS: tl.constexpr = WIDTH // HEAD_DIM
    heads = k0 // HEAD_DIM + tl.arange(0, HEADS)
    h_ok = heads < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    cols = heads[:, None] * HEAD_DIM + offs_d[None, :]
    m = tl.full([HEADS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([HEADS], dtype=tl.float32)
    acc = tl.zeros([HEADS, HEAD_DIM], dtype=tl.float32)
    for c in tl.static_range(0, BLOCK_S, CHUNK_S):
        offs_s = c + tl.arange(0, CHUNK_S)
        s_ok = offs_s < num_splits
        lse = tl.load(Lse + offs_s[:, None] * stride_ls + heads[None, :], mask=s_ok[:, None] & h_ok[None, :],
                      other=float("-inf"))
        parts = tl.load(X + offs_s[:, None, None] * stride_xs + cols[None, :, :],
                        mask=s_ok[:, None, None] & h_ok[None, :, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe[None, :])
        acc = acc * scale[:, None] + tl.sum(parts * w[:, :, None], 0)
        total = total * scale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    return tl.reshape(out.to(dt).to(tl.float32), [WIDTH])


def merge_splits_ref(parts: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch reference of the merge: ``parts`` [num_splits, ..., num_heads, head_dim] float32 partial outputs,
    ``lse`` [num_splits, ..., num_heads] float32 log2-sum-exp2 (-inf: empty split); returns [..., num_heads,
    head_dim] in ``dtype`` (rows whose splits are all empty are 0)."""
    m = lse.amax(0)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp2(lse - m)
    total = w.sum(0)
    out = (parts * w[..., None]).sum(0) / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    return out.to(dtype)


def merge_chunk(num_splits: int, width: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_S, CHUNK_S)`` for :func:`_merged_tile`: splits padded to a power of two, taken at most 8192
    values (``CHUNK_S x width``) at a time."""
    block_s = triton.next_power_of_2(max(1, num_splits))
    chunk = max(1, min(block_s, 8192 // width))
    return block_s, chunk
