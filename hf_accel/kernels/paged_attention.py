"""Attention over a paged KV cache with split-KV (FlashDecoding) and GQA packing: kernel and launcher (the same op in
PyTorch, the CPU path and the reference: :mod:`~hf_accel.kernels.paged_attention_torch`).

Decode reads the whole KV cache for one query token, so it is bandwidth-bound and one program per
(sequence, head) leaves most of the GPU idle at small batch. FlashDecoding (Dao, Haziza, Massa,
Sizov 2023, "Flash-Decoding for long-context inference") splits the KV length into partitions processed
in parallel, each producing a partial output and its log-sum-exp, then merges them exactly:
``out = sum_s exp(lse_s - lse) * out_s`` with ``lse = log sum_s exp(lse_s)``.

K/V live in block pools [num_blocks, block_size, num_kv_heads, head_dim] addressed through a block
table (PagedAttention, Kwon et al. 2023, §4.1); a ``BLOCK_N`` tile may span several blocks (each key row
is gathered through its block's id), so the tile size does not depend on ``block_size``. Block ids are
either loaded by each tile, or once per chunk of ~2048 tokens and picked per tile from registers
(``tl.gather``): then no load in the tile loop feeds another load's address and Triton's software
pipeliner double-buffers K/V (``chunk_tokens`` of :func:`paged_attention` says when each is used).

GQA packing: one program owns one KV head and the ``q_len * group`` query rows of its group (row
``r`` -> query position ``r // group``, head ``kv_head * group + r % group``), so every K/V block is
read once per group, not once per query head. The same kernel serves decode (``q_len == 1``) and
chunked prefill / verification of several tokens (``q_len > 1``), causal bottom-right per sequence:
query ``i`` of sequence ``b`` sees logical key ``j`` iff ``j <= i + seq_lens[b] - q_len``.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import capturing, check_dense, check_launch_device, check_interpreter_dot

from hf_accel.kernels.attention import (
    _LOG2E, MAX_HEAD_DIM, SUPPORTED_DTYPES, _dot, _tile_probs,
)
from hf_accel.kernels.arrival import check_counters, last_to_arrive, reset_arrivals
from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl


@triton.jit
def _attend_tile(q, KCache, VCache, KeyMask, phys, offs_n, end, m_i, l_i, acc, offs_d, d_valid, row_valid, q_pos,
                 causal_shift, kh_off, vh_off, block_size, sm_scale_log2, b64,
                 stride_ks, stride_kb, stride_kd, stride_vb, stride_vs, stride_vd, stride_mb, stride_mn,
                 IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One ``BLOCK_N`` tile of keys ``offs_n`` (valid below ``end``; key row n in block ``phys[n]``, slot
    ``n % block_size``) folded into the online softmax (m_i, l_i, acc) of FlashAttention-2."""
    n_valid = offs_n < end
    slot = offs_n % block_size
    k = tl.load(KCache + phys[None, :] * stride_kb + slot[None, :] * stride_ks + kh_off
                + offs_d[:, None] * stride_kd, mask=n_valid[None, :] & d_valid[:, None], other=0.0)
    p, m_new, l_i, acc = _tile_probs(q, k, offs_n, n_valid, row_valid, q_pos, causal_shift, KeyMask, b64,
                                     stride_mb, stride_mn, m_i, l_i, acc, sm_scale_log2,
                                     IS_CAUSAL, HAS_KEY_MASK, IEEE_DOT)
    v = tl.load(VCache + phys[:, None] * stride_vb + slot[:, None] * stride_vs + vh_off
                + offs_d[None, :] * stride_vd, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
    acc += _dot(p.to(v.dtype), v, IEEE_DOT)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    Q, KCache, VCache, BlockTable, SeqLens, KeyMask, Out, PartOut, PartLse, Counters,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_mb, stride_mn,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_ps, stride_pb, stride_pm, stride_ph,
    stride_ls, stride_lb, stride_lm,
    q_len, head_dim, num_kv_heads, block_size, tokens_per_split, table_len,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    TRIGGER: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    PRELOAD_KV: tl.constexpr,
    TRIGGER_AFTER_KEYS: tl.constexpr,
):
    if not PRELOAD_KV:
        if PDL:
            gdc_wait()  # Q and the cache are written by the kernels before this one
        if TRIGGER:
            gdc_launch_dependents()  # the next kernel may launch (and wait, or load its weights) while this one runs
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads
    b64 = b.to(tl.int64)
    start = pid_s * tokens_per_split
    if CHUNK_BLOCKS > 0:
        # The first chunk's block ids, loaded before (not after) seq_len: they need only the split's start,
        # so the two loads are in flight together and K/V loads start one memory round trip earlier. Entries
        # past the sequence's last block are loaded but never used as addresses (their K/V loads are masked).
        offs_b = start // block_size + tl.arange(0, CHUNK_BLOCKS)
        first_ids = tl.load(BlockTable + b64 * stride_tb + offs_b * stride_tn,
                            mask=(offs_b < table_len) & (offs_b * block_size < start + tokens_per_split), other=0)
    seq_len = tl.load(SeqLens + b)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_valid = q_pos < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim

    causal_shift = seq_len - q_len
    # keys the grid and the block table cover; a longer seq_len is a caller error, answered with NaN below
    covered = tl.minimum(tl.num_programs(2) * tokens_per_split, table_len * block_size)
    end = tl.minimum(tl.minimum(seq_len, start + tokens_per_split), covered)
    if IS_CAUSAL:
        last_pos = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        end = tl.minimum(end, last_pos + causal_shift + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kh_off = kv_head.to(tl.int64) * stride_kh
    vh_off = kv_head.to(tl.int64) * stride_vh
    table = BlockTable + b64 * stride_tb
    first = start
    if PRELOAD_KV:
        # Before the PDL wait: the block ids and the K/V of the split's first tile that were cached before
        # this step's q_len new tokens (the kernel before this one writes only the new tokens' slots).
        offs_n0 = start + tl.arange(0, BLOCK_N)
        in0 = offs_n0 < end
        old0 = offs_n0 < tl.minimum(end, causal_shift)
        phys0 = tl.load(table + (offs_n0 // block_size) * stride_tn, mask=in0, other=0).to(tl.int64)
        slot0 = offs_n0 % block_size
        k_ptr0 = KCache + phys0[None, :] * stride_kb + slot0[None, :] * stride_ks + kh_off + offs_d[:, None] * stride_kd
        v_ptr0 = VCache + phys0[:, None] * stride_vb + slot0[:, None] * stride_vs + vh_off + offs_d[None, :] * stride_vd
        k0 = tl.load(k_ptr0, mask=old0[None, :] & d_valid[:, None], other=0.0)
        v0 = tl.load(v_ptr0, mask=old0[:, None] & d_valid[None, :], other=0.0)
        if PDL:
            gdc_wait()  # Q and the new tokens' K/V are written by the kernel before this one
        if TRIGGER:
            gdc_launch_dependents()
    q = tl.load(Q + b64 * stride_qb + q_head[:, None].to(tl.int64) * stride_qh
                + q_pos[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if PRELOAD_KV:
        if start < end:
            new0 = in0 & ~old0
            k0 = tl.where(old0[None, :], k0, tl.load(k_ptr0, mask=new0[None, :] & d_valid[:, None], other=0.0))
            v0 = tl.where(old0[:, None], v0, tl.load(v_ptr0, mask=new0[:, None] & d_valid[None, :], other=0.0))
            p, m_i, l_i, acc = _tile_probs(q, k0, offs_n0, in0, row_valid, q_pos, causal_shift, KeyMask, b64,
                                           stride_mb, stride_mn, m_i, l_i, acc, sm_scale_log2,
                                           IS_CAUSAL, HAS_KEY_MASK, IEEE_DOT)
            acc += _dot(p.to(v0.dtype), v0, IEEE_DOT)
        first = start + BLOCK_N
    if CHUNK_BLOCKS == 0:
        # each tile loads its own block ids: Triton's pipeliner then puts the id load one stage ahead of
        # K/V and keeps a single K/V buffer (small shared memory, more programs per SM)
        for start_n in range(first, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            phys = tl.load(table + (offs_n // block_size) * stride_tn, mask=offs_n < end, other=0)
            m_i, l_i, acc = _attend_tile(
                q, KCache, VCache, KeyMask, phys.to(tl.int64), offs_n, end, m_i, l_i, acc, offs_d, d_valid,
                row_valid, q_pos, causal_shift, kh_off, vh_off, block_size, sm_scale_log2, b64,
                stride_ks, stride_kb, stride_kd, stride_vb, stride_vs, stride_vd, stride_mb, stride_mn,
                IS_CAUSAL, HAS_KEY_MASK, IEEE_DOT)
    else:
        # chunks of CHUNK_BLOCKS cache blocks: a chunk's block ids are loaded once, before its tile loop,
        # and each tile picks its ids from registers (tl.gather); with no load feeding another load's
        # address in the tile loop, the pipeliner keeps num_stages - 1 K/V tiles in flight
        # (chunks are aligned to cache blocks: a split may start inside a block)
        # (the first chunk's ids were loaded before seq_len; each chunk loads the next one's after its tiles)
        ids = first_ids
        for first_block in range(start // block_size, tl.cdiv(end, block_size), CHUNK_BLOCKS):
            chunk_start = tl.maximum(start, first_block * block_size)
            chunk_end = tl.minimum(end, (first_block + CHUNK_BLOCKS) * block_size)
            for start_n in range(chunk_start, chunk_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                local = tl.minimum(offs_n // block_size - first_block, CHUNK_BLOCKS - 1)
                phys = tl.gather(ids, local, 0)
                m_i, l_i, acc = _attend_tile(
                    q, KCache, VCache, KeyMask, phys.to(tl.int64), offs_n, chunk_end, m_i, l_i, acc, offs_d,
                    d_valid, row_valid, q_pos, causal_shift, kh_off, vh_off, block_size, sm_scale_log2, b64,
                    stride_ks, stride_kb, stride_kd, stride_vb, stride_vs, stride_vd, stride_mb, stride_mn,
                    IS_CAUSAL, HAS_KEY_MASK, IEEE_DOT)
            offs_b = first_block + CHUNK_BLOCKS + tl.arange(0, CHUNK_BLOCKS)
            ids = tl.load(table + offs_b * stride_tn, mask=offs_b * block_size < end, other=0)

    if TRIGGER_AFTER_KEYS:
        gdc_launch_dependents()  # every K/V load of this program has returned: the next kernel may launch
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if seq_len > covered:  # NaN rather than attention over a prefix of the keys
        out = tl.full([BLOCK_M, BLOCK_D], float("nan"), dtype=tl.float32)
    io_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:
        # Partial output (normalised within the split) and its log2-sum-exp2; -inf where nothing was seen.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        p_ptrs = (PartOut + pid_s * stride_ps + b64 * stride_pb + q_pos[:, None].to(tl.int64) * stride_pm
                  + q_head[:, None].to(tl.int64) * stride_ph + offs_d[None, :])
        tl.store(p_ptrs, out, mask=io_mask)
        tl.store(PartLse + pid_s * stride_ls + b64 * stride_lb + q_pos.to(tl.int64) * stride_lm + q_head,
                 lse, mask=row_valid)
        if FUSED_MERGE:
            # The last split program of these rows to arrive merges all splits (no merge kernel): partials
            # stored by every thread, then an acquire/release arrival count at GPU scope.
            counter = Counters + pid_bh * tl.num_programs(0) + pid_m
            if last_to_arrive(counter, NUM_SPLITS):
                # All splits of MERGE_ROWS rows at a time in one [splits, rows, head_dim] load (every load in
                # flight at once; rows of the block past the last query row are skipped), merged as the
                # merge kernel does: weights exp2(lse_s - max_s lse_s), sum over splits in registers.
                offs_s = tl.arange(0, MERGE_SPLITS)
                s_valid = offs_s < NUM_SPLITS
                for r0 in tl.static_range(0, BLOCK_M, MERGE_ROWS):
                    if pid_m * BLOCK_M + r0 < q_len * GROUP:
                        mrows = pid_m * BLOCK_M + r0 + tl.arange(0, MERGE_ROWS)
                        mpos = (mrows // GROUP).to(tl.int64)
                        mhead = (kv_head * GROUP + mrows % GROUP).to(tl.int64)
                        mvalid = mrows < q_len * GROUP
                        lse_s = tl.load(PartLse + offs_s[:, None] * stride_ls + b64 * stride_lb
                                        + mpos[None, :] * stride_lm + mhead[None, :],
                                        mask=s_valid[:, None] & mvalid[None, :], other=float("-inf"),
                                        cache_modifier=".cg")
                        parts = tl.load(PartOut + offs_s[:, None, None] * stride_ps + b64 * stride_pb
                                        + mpos[None, :, None] * stride_pm + mhead[None, :, None] * stride_ph
                                        + offs_d[None, None, :],
                                        mask=(s_valid[:, None, None] & mvalid[None, :, None]
                                              & d_valid[None, None, :]), other=0.0, cache_modifier=".cg")
                        m_s = tl.max(lse_s, 0)
                        w_s = tl.exp2(lse_s - tl.where(m_s == float("-inf"), 0.0, m_s)[None, :])
                        total_s = tl.sum(w_s, 0)
                        merged = (tl.sum(parts * w_s[:, :, None], 0)
                                  / tl.where(total_s == 0.0, 1.0, total_s)[:, None])
                        tl.store(Out + b64 * stride_ob + mpos[:, None] * stride_om + mhead[:, None] * stride_oh
                                 + offs_d[None, :] * stride_od, merged.to(Out.dtype.element_ty),
                                 mask=mvalid[:, None] & d_valid[None, :])
                reset_arrivals(counter)
    else:
        o_ptrs = (Out + b64 * stride_ob + q_pos[:, None].to(tl.int64) * stride_om
                  + q_head[:, None].to(tl.int64) * stride_oh + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(
    PartOut, PartLse, Out,
    stride_ps, stride_pr,
    stride_ls,
    stride_or,
    num_splits, head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # tiny kernel: the next one (o_proj) may launch and start its weight loads
        gdc_wait()  # the partial outputs come from the attention kernel
    r = tl.program_id(0).to(tl.int64)  # flat (b, m, h) row
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < num_splits
    lse = tl.load(PartLse + offs_s * stride_ls + r, mask=s_valid, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    parts = tl.load(PartOut + offs_s[:, None] * stride_ps + r * stride_pr + offs_d[None, :],
                    mask=s_valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + r * stride_or + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)


def check_paged_args(query, key_cache, value_cache, block_table, seq_lens, key_mask):
    """Shape / dtype / device checks of :func:`paged_attention`'s arguments (shared with the PyTorch paths); returns
    ``(batch, num_heads, num_kv_heads, q_len, head_dim)``. Raises ValueError naming what is wrong."""
    if query.dim() != 4:
        raise ValueError(f"query must be [batch, num_heads, q_len, head_dim]; got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache/value_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and "
                         f"equal; got {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    empty = {name: size for name, size in (("num_heads", num_heads), ("head_dim", head_dim),
                                           ("block_size", key_cache.shape[1]), ("num_kv_heads", num_kv_heads))
             if size == 0}
    if empty:
        raise ValueError(f"{', '.join(empty)} must be >= 1 (query {tuple(query.shape)}, pools "
                         f"{tuple(key_cache.shape)} = [num_blocks, block_size, num_kv_heads, head_dim])")
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"dtypes differ: query {query.dtype}, cache {key_cache.dtype}/{value_cache.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be [batch={batch}, max_blocks_per_seq] int32; got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [batch={batch}] int32; got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if key_mask is not None and (key_mask.dim() != 2 or key_mask.shape[0] != batch):
        raise ValueError(f"key_mask must be [batch={batch}, >= max seq_len]; got {tuple(key_mask.shape)}")
    return batch, num_heads, num_kv_heads, q_len, head_dim


def _check_block_ids(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    """ValueError for a negative ``seq_lens`` entry, or a block id the kernel reads (the entries of each row that
    cover its ``seq_lens`` keys, within the table) outside ``[0, num_blocks)``: the kernel would read past the pools."""
    used = seq_lens.to(torch.int64).clamp(min=0).add(block_size - 1).div(block_size, rounding_mode="floor")
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    read = cols[None, :] < used[:, None].to(cols.device)
    bad = read & ((block_table < 0) | (block_table >= num_blocks))
    negative, out_of_range = torch.stack([(seq_lens < 0).any().to(bad.device), bad.any()]).tolist()
    if negative:
        raise ValueError(f"seq_lens must be >= 0; got {seq_lens.tolist()}")
    if out_of_range:
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is read (seq_lens[{b}] = "
                         f"{int(seq_lens[b])}, block_size {block_size}) but the pools have {num_blocks} blocks: "
                         f"every block id a sequence uses must be in [0, {num_blocks - 1}]")


#: Tokens per chunk of block ids (see ``chunk_tokens``); 2048 measured 1-2% above 1024 at B16 S8k.
CHUNK_TOKENS = 2048
#: The chunked kernel is used when the grid has at most this many programs per SM (the shared memory of
#: its double-buffered K/V lets 3 reside per H200 SM; with more programs the per-tile kernel's 4 win).
CHUNKED_MAX_PROGRAMS_PER_SM = 3
#: Most block ids held in registers per chunk (``chunk_tokens`` is capped to this many blocks).
MAX_CHUNK_BLOCKS = 4096
#: Most splits merged inside the attention kernel (``merge_counters``; the merge loads every split's partials
#: of a few query rows at once); more go through the merge kernel.
MAX_FUSED_MERGE_SPLITS = 32
#: Most partial-output values the fused merge loads at once (a [splits, rows, head_dim] tile: 128 fp32
#: registers per thread at 4 warps); it merges as many query rows at a time as fit.
MERGE_TILE_ELEMENTS = 16384
#: Elements of the merge kernel's [splits, head_dim] fp32 tile per warp (128 registers per thread): it runs
#: on as few warps as hold the tile, one for up to 32 splits at head_dim 128.
MERGE_WARP_ELEMENTS = 4096
#: Warps per program of the split-merge kernel; None: :func:`merge_warps` (the fewest that hold its tile: 1 for
#: up to 32 splits at head_dim 128). H100, bench_decode with and without (two runs): B1 S32k 2.56 vs 2.51 TB/s
#: on 1 warp vs 4, 2.59 with the PDL launch below too; B16 S8k equal (``bench_decode-h100-20261207-*.json``).
MERGE_WARPS = None
#: Whether launches without ``pdl`` still launch the split-merge kernel with PDL where available (Hopper and
#: newer), and where the attention kernel lets it launch: "after_wait" (as its programs start), "after_keys"
#: (once their K/V tiles are in); None: no PDL. The merge kernel's programs then wait (``griddepcontrol.wait``)
#: for the attention kernel to finish instead of being launched after it, hiding its launch latency. "after_wait"
#: with the 1-warp merge: H100, B1 S32k 2.59 vs 2.56 TB/s without PDL ("after_keys" 2.56), B16 S8k 2.99 vs 2.98
#: (``bench_decode-h100-20261207-*.json``); ``benchmarks/probe_decode_fixed_cost.py`` times the variants.
MERGE_PDL_TRIGGER = "after_wait"
#: KV splits target about this many programs per SM (see ``num_splits``).
SPLIT_PROGRAMS_PER_SM = 2


def merge_warps(num_splits: int, block_d: int) -> int:
    """Warps per program of the split-merge kernel: the fewest (1-8, a power of 2) that hold its
    [next_power_of_2(num_splits), block_d] fp32 tile at :data:`MERGE_WARP_ELEMENTS` per warp. One warp merges
    without a cross-warp reduction: H200, 32 splits x 32 heads x D128, the kernel alone in a CUDA graph took
    2.31 µs per call on 1 warp vs 3.23 on 4 (``probe_decode_fixed_cost-20261206-56bbd39.json``)."""
    elements = triton.next_power_of_2(num_splits) * block_d
    return min(8, triton.next_power_of_2(triton.cdiv(elements, MERGE_WARP_ELEMENTS)))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    key_mask: torch.Tensor | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    chunk_tokens: int | None = None,
    pdl: bool = False,
    merge_counters: torch.Tensor | None = None,
    trigger: bool | str = False,
    preload_kv: bool = False,
    split_multiple: int | None = None,
    check_blocks: bool = True,
) -> torch.Tensor:
    """Attention of ``q_len`` new query tokens per sequence over that sequence's paged KV cache.

    Args:
        query: [batch, num_heads, q_len, head_dim], fp16/bf16/fp32, any strides. The queries are the
            last ``q_len`` positions of each sequence (their K/V already written to the cache).
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype.
        value_cache: same shape/dtype as ``key_cache``.
        block_table: [batch, max_blocks_per_seq], int32 — physical block ids in logical order; entries
            past a sequence's last block are never used as addresses (they may be loaded, any value).
        seq_lens: [batch], int32 — tokens in each sequence's cache, the ``q_len`` new ones included.
        max_seq_len: host int >= max(seq_lens), sizes the split-KV grid without a device sync. Rows whose
            ``seq_lens`` exceeds what that grid or the block table covers come out NaN (never attention
            over a prefix, never a read past the table).
        key_mask: optional [batch, >= max_seq_len], bool/int — nonzero = logical key visible (padding).
        causal: bottom-right causal mask per sequence (see module docstring).
        sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
        num_splits: KV partitions (FlashDecoding); default: about :data:`SPLIT_PROGRAMS_PER_SM` programs per
            SM in all, each split holding >= 256 keys (1 on CPU).
        out: optional [batch, q_len, num_heads, head_dim] output buffer.
        block_n, block_m, num_warps, num_stages: kernel tiling overrides (benchmark sweeps); keys per tile
            (power of 2 >= 16), default 64 (32 for head_dim > 128); query rows per program (power of 2 >= 16;
            a row is one (position, query head) pair of a KV head's group), default the smallest of 16 / 32 /
            64 that holds them, at most 64; pipeline stages default 3.
        chunk_tokens: how the kernel finds each key's cache block. > 0: the split is walked in chunks of about this
            many tokens (at most :data:`MAX_CHUNK_BLOCKS` blocks) whose block ids are loaded once per chunk (K/V
            double-buffered with 3 stages: ~70 KB of shared memory at D128, 3 programs per H200 SM); 0: each tile
            loads its own ids (one K/V buffer, ~39 KB, 4 programs per SM). Default: :data:`CHUNK_TOKENS` when the
            grid fits :data:`CHUNKED_MAX_PROGRAMS_PER_SM` programs per SM, else 0. H200, GQA 32/8, D128, bf16, in
            CUDA graphs (``bench_decode-20261201-14a8eeb.json``): B1 S32k 3.35 vs 3.20 TB/s and B16 S8k 4.15 vs 3.78
            chunked; B64 S2k (512 programs, unsplit) 4.02 per tile vs 3.30 chunked.
        pdl: launch both kernels with programmatic dependent launch where available (:mod:`.pdl`;
            ignored elsewhere). Without it the merge kernel alone takes PDL when :data:`MERGE_PDL_TRIGGER` is
            set.
        merge_counters: with split-KV, merge the splits inside the attention kernel instead of a second kernel: the
            last split program of each row block to arrive (an atomic arrival counter) merges them (up to
            :data:`MAX_FUSED_MERGE_SPLITS` splits; more use the merge kernel). An int32 tensor of at least
            ``batch * num_kv_heads * ceil(q_len * group / block_m)`` zeros owned by the caller, used by one stream
            at a time; every launch leaves it at zero.
        trigger: with ``pdl``, when to let the next kernel launch: False (as the programs exit), True or
            ``"after_wait"`` (as soon as they pass their wait: the next projection's weight loads then
            overlap the attention's), ``"after_keys"`` (once every K/V tile of the program is in: they
            overlap only the split merge).
        preload_kv: with ``pdl``, each program loads the block ids and the K/V of its first tile that
            precede the ``q_len`` new tokens (and ``seq_lens``) before waiting for the previous kernel. Only
            valid when that kernel writes no block table, ``seq_lens`` or cached K/V other than the new
            tokens' (a decode step's Q/K/V + cache-write kernel), and when no kernel still running writes
            them: if the previous kernel itself triggers early, this one can start while the kernel before
            that runs (in the decode step those buffers come from kernels launched without PDL, which finish
            before the first layer's Q/K/V kernel starts). Uses the per-tile block-id loads (``chunk_tokens=0``).
        split_multiple: keys per split are rounded up to a multiple of this (default ``block_n``: whole
            tiles); 1 gives every split the same share to within one key (any count of splits).
        check_blocks: check on the host that ``seq_lens`` holds no negative length and that every block id the
            kernel will read (the first ``ceil(seq_lens[b] / block_size)`` entries of each row, within the table)
            names a block of the pools (one device-to-host read; skipped while a CUDA graph is captured). The
            decode step passes False: its tables come from the block manager.

    Returns:
        [batch, q_len, num_heads, head_dim], query's dtype; rows that see no key are 0.

    Raises:
        ValueError: shape/dtype mismatches (``out`` included), head_dim > 256, a ``key_mask`` narrower than
            ``max_seq_len``, ``num_splits`` < 1, ``block_n`` or ``block_m`` not a power of 2 >= 16, ``chunk_tokens``
            not an int >= 0, ``merge_counters`` not a contiguous int32 tensor of enough elements on the query's
            device; with ``check_blocks``, a negative ``seq_lens`` entry or a block id read outside
            ``[0, num_blocks)``; bfloat16 CPU tensors under Triton's interpreter
            (:func:`~hf_accel.kernels.device.check_interpreter_dot`).
    """
    batch, num_heads, num_kv_heads, q_len, head_dim = check_paged_args(query, key_cache, value_cache, block_table,
                                                             seq_lens, key_mask)
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {query.dtype}; supported: {SUPPORTED_DTYPES}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    group = num_heads // num_kv_heads
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a host int >= 0 (>= every seq_lens entry); got {max_seq_len!r}")
    max_seq_len = int(max_seq_len)
    if key_mask is not None and key_mask.shape[1] < max_seq_len:
        raise ValueError(f"key_mask has {key_mask.shape[1]} columns, fewer than max_seq_len={max_seq_len}")
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if block_n is not None and (not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of 2 >= 16, got {block_n!r}")
    if block_m is not None and (not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of 2 >= 16, got {block_m!r}")
    if out is None:
        out = torch.empty(batch, q_len, num_heads, head_dim, dtype=query.dtype, device=query.device)
    elif (out.shape != (batch, q_len, num_heads, head_dim) or out.dtype != query.dtype
          or out.device != query.device):
        raise ValueError(f"out must be [batch={batch}, q_len={q_len}, num_heads={num_heads}, head_dim={head_dim}] "
                         f"{query.dtype} on {query.device}; got {tuple(out.shape)} {out.dtype} on {out.device}")
    if batch == 0 or q_len == 0:
        return out
    block_size = key_cache.shape[1]
    if check_blocks and not capturing(block_table):
        _check_block_ids(block_table, seq_lens, block_size, key_cache.shape[0])
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = q_len * group
    if block_m is None:
        block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    m_blocks = triton.cdiv(rows, block_m)
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else None
    if num_splits is None:
        if query.is_cuda:
            programs = batch * num_kv_heads * m_blocks
            # ~2 programs per SM (rounded), H200 sweeps bench_decode-20261201-08e2e12 / -14a8eeb.json with
            # the chunked kernel: B1 S32k 3.35 TB/s with 32 splits (2.80 / 3.18 / 3.26 / 2.74 with
            # 24 / 40 / 48 / 64); B16 S8k 4.15 with 2 splits (4.12 with 3, 3.30 with 4)
            want = max(1, (SPLIT_PROGRAMS_PER_SM * sms + programs // 2) // programs)
        else:
            want = 1
        num_splits = max(1, min(want, triton.cdiv(max(max_seq_len, 1), 256)))
    if split_multiple is None:
        split_multiple = block_n
    elif not isinstance(split_multiple, int) or isinstance(split_multiple, bool) or split_multiple < 1:
        raise ValueError(f"split_multiple must be an int >= 1, got {split_multiple!r}")
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), split_multiple) * split_multiple
    num_splits = triton.cdiv(max(max_seq_len, 1), tokens_per_split)
    split = num_splits > 1
    if key_mask is not None and key_mask.dtype == torch.bool:
        key_mask = key_mask.to(torch.uint8)
    mask_arg = key_mask if key_mask is not None else seq_lens
    stride_m = key_mask.stride() if key_mask is not None else (0, 0)
    if split:
        part_out = torch.empty(num_splits, batch, q_len, num_heads, head_dim, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_splits, batch, q_len, num_heads, dtype=torch.float32, device=query.device)
        p_strides = part_out.stride()[:4]
        l_strides = part_lse.stride()[:3]
    else:
        part_out, part_lse = out, seq_lens  # unused
        p_strides, l_strides = (0, 0, 0, 0), (0, 0, 0)
    if num_stages is None:
        num_stages = 3
    if chunk_tokens is None:
        chunk_tokens = CHUNK_TOKENS
        if query.is_cuda:
            if m_blocks * batch * num_kv_heads * num_splits > CHUNKED_MAX_PROGRAMS_PER_SM * sms:
                chunk_tokens = 0
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be an int >= 0, got {chunk_tokens!r}")
    # cache blocks per chunk whose ids are loaded at once (power of 2; 0 = ids loaded by each tile)
    chunk_blocks = (min(MAX_CHUNK_BLOCKS, triton.next_power_of_2(triton.cdiv(chunk_tokens, block_size)))
                    if chunk_tokens else 0)
    if preload_kv:
        chunk_blocks = 0
    grid = (m_blocks, batch * num_kv_heads, num_splits)
    fused_merge = split and merge_counters is not None and num_splits <= MAX_FUSED_MERGE_SPLITS
    # query rows merged at once by the fused merge: at most MERGE_TILE_ELEMENTS partial values in flight
    # (1 without it, so that launches without a fused merge share one compiled kernel)
    merge_rows = 1
    if fused_merge:
        merge_rows = max(1, min(block_m, triton.next_power_of_2(rows),
                                MERGE_TILE_ELEMENTS // (triton.next_power_of_2(num_splits) * block_d)))
    if not (isinstance(trigger, bool) or trigger in ("after_wait", "after_keys")):
        raise ValueError(f"trigger must be False, True, 'after_wait' or 'after_keys', got {trigger!r}")
    if merge_counters is not None:
        check_counters(merge_counters, m_blocks * batch * num_kv_heads, query.device, "merge_counters")
    pdl = use_pdl(pdl, query)
    pdl_launch = {"launch_pdl": True} if pdl else {}
    trigger_start = pdl and (trigger is True or trigger == "after_wait")
    trigger_keys = pdl and trigger == "after_keys"
    merge_pdl = pdl
    if (not pdl and split and not fused_merge and MERGE_PDL_TRIGGER is not None
            and use_pdl(True, query)):
        # only the merge kernel takes PDL: it launches while the attention kernel runs and waits for it
        merge_pdl = True
        trigger_start = MERGE_PDL_TRIGGER == "after_wait"
        trigger_keys = MERGE_PDL_TRIGGER == "after_keys"
    check_dense("paged_attention", seq_lens=seq_lens)
    check_launch_device(query, "paged_attention", "hf_accel.kernels.paged_attention_torch.paged_attention_ref")
    check_interpreter_dot(query, "paged_attention")
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, block_table, seq_lens, mask_arg, out, part_out, part_lse,
        merge_counters if fused_merge else seq_lens,
        sm_scale * _LOG2E,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_table.stride(), *stride_m,
        *out.stride(), *p_strides, *l_strides,
        q_len, head_dim, num_kv_heads, block_size, tokens_per_split, block_table.shape[1],
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IS_CAUSAL=bool(causal), HAS_KEY_MASK=key_mask is not None, SPLIT=split,
        IEEE_DOT=query.dtype == torch.float32, CHUNK_BLOCKS=chunk_blocks, PDL=pdl,
        FUSED_MERGE=fused_merge, TRIGGER=trigger_start,
        TRIGGER_AFTER_KEYS=trigger_keys, NUM_SPLITS=num_splits if fused_merge else 1,
        MERGE_SPLITS=triton.next_power_of_2(num_splits) if fused_merge else 1,
        MERGE_ROWS=merge_rows,
        PRELOAD_KV=bool(preload_kv),
        num_warps=num_warps, num_stages=num_stages, **pdl_launch,
    )
    if split and not fused_merge:
        out_rows = out.view(batch * q_len * num_heads, head_dim) if out.is_contiguous() else None
        target = out_rows if out_rows is not None else torch.empty(batch * q_len * num_heads, head_dim,
                                                                   dtype=out.dtype, device=out.device)
        _merge_splits_kernel[(batch * q_len * num_heads,)](
            part_out, part_lse, target,
            part_out.stride(0), head_dim, part_lse.stride(0), target.stride(0),
            num_splits, head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, PDL=merge_pdl,
            num_warps=MERGE_WARPS or merge_warps(num_splits, block_d), **({"launch_pdl": True} if merge_pdl else {}),
        )
        if out_rows is None:
            out.copy_(target.view(batch, q_len, num_heads, head_dim))
    return out
