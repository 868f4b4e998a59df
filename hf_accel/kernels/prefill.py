"""Prefill (prompt) attention: a FlashAttention-2 forward kernel tuned for Hopper and its launchers (launch
configurations and the tuner: :mod:`~hf_accel.kernels.prefill_tuning`; the PyTorch reference:
:mod:`~hf_accel.kernels.prefill_reference`, both re-exported here).

Algorithm (Dao 2023, "FlashAttention-2", Algorithm 1 and sections 3.1-3.2): one program owns a tile of
``BLOCK_M`` query rows of one (sequence, query head) and streams the keys/values in ``BLOCK_N`` blocks.
The softmax is computed online (Milakov & Gimelshein 2018) with a running row max ``m`` and sum ``l``
in fp32; the scale is folded with log2(e) so that one FMA and one ``exp2`` give each probability, and
the accumulator is divided by ``l`` once at the end (FA2 section 3.1, "fewer non-matmul FLOPs").
The key range of a tile is split in three loops (FA2 section 3.1.1, "causal masking"):

* A: at most one block holding the first visible key when start offsets (left padding) are given,
  masked;
* B: the blocks every row of the tile sees completely: no mask is built or applied;
* C: the blocks on the causal diagonal and the ragged tail (``kv_len % BLOCK_N``), masked.

Blocks entirely above the causal diagonal, or entirely before a row's start offset, are never loaded.
Causality is bottom-right aligned: query ``i`` of a sequence sees key ``j`` iff
``j <= i + kv_len - q_len`` (chunked prefill, and prefill after a cached prefix). A query row that
sees no key returns 0 and log-sum-exp ``-inf`` (never NaN).

GQA/MQA (Ainslie et al. 2023) reads K/V through ``kv_head = head // group``: no copy. The programs of
one head (and of the heads of one group) are launched next to each other, so a head's K/V is read
from HBM about once and re-served from L2 to its other row tiles.

Layouts: dense ``query`` [batch, heads, q_len, head_dim] with any strides (transformers passes the
transposed view of a [batch, q_len, heads, head_dim] buffer) and ``key``/``value``
[batch, kv_heads, kv_len, head_dim]; or packed variable-length sequences ("varlen", as in
flash-attn) ``query`` [total_q, heads, head_dim], ``key``/``value`` [total_k, kv_heads, head_dim] with
``cu_seqlens_q/k`` [batch + 1] int32 prefix sums.

On sm_90 the K/V tiles (optionally Q/O too) are moved by the tensor-memory accelerator (TMA) through
2-D tensor descriptors over each tensor's storage (row = the token axis, column offset = the head),
and the loop over K/V blocks is software-pipelined ``num_stages`` deep. See :func:`prefill_attention`
for the tuning choices and what each bought on an H200.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import capturing, check_launch_device
from hf_accel.kernels.prefill_reference import (
    prefill_attention_ref,
    prefill_attention_varlen_ref,
)
from hf_accel.kernels.prefill_tuning import (
    TUNED,
    PrefillConfig,
    bucket,
    cdiv,
    default_interpret_config,
    interpreting,
    next_pow2,
    tune,
    tuned_configs,
)

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 160, 192, 256)
MAX_HEAD_DIM = 256

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _kv_step(
    acc, l_i, m_i, q, start_n,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    desc_k, desc_v, k_row, k_col, v_row, v_col,
    km_ptrs, stride_mn,
    q_last, kv_first, kv_len_b, offs_n, d_valid, sm_scale_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    USE_TMA: tl.constexpr,
    PAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    ABLATE: tl.constexpr,
):
    """One key block [start_n, start_n + BLOCK_N) of the online softmax (see :func:`_kv_blocks`)."""
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs = start_n + offs_n
    # -- S = Q K^T -----------------------------------------------------------------------------
    if USE_TMA:
        k = desc_k.load([k_row + start_n, k_col])
    else:
        if MASKED:
            k = tl.load(k_ptrs + start_n.to(tl.int64) * stride_kn,
                        mask=(offs < kv_len_b)[:, None] & d_valid[None, :], other=0.0)
        elif PAD_D:
            k = tl.load(k_ptrs + start_n.to(tl.int64) * stride_kn, mask=d_valid[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs + start_n.to(tl.int64) * stride_kn)
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    # -- online softmax (log2 domain, scale folded) ------------------------------------------------
    if ABLATE == 1:
        p = s
        alpha = tl.full(m_i.shape, 1.0, tl.float32)
        m_new = m_i
    elif (MASKED or HAS_KEY_MASK) and ABLATE != 3:
        allowed = offs[None, :] < kv_len_b
        if MASKED:
            if IS_CAUSAL:
                allowed = allowed & (offs[None, :] <= q_last[:, None])
            if HAS_KV_START:
                allowed = allowed & (offs[None, :] >= kv_first)
        if HAS_KEY_MASK:
            km = tl.load(km_ptrs + offs * stride_mn, mask=offs < kv_len_b, other=0)
            allowed = allowed & (km[None, :] != 0)
        s = tl.where(allowed, s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * sm_scale_log2)
        p = tl.math.exp2(s * sm_scale_log2 - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # -- O += P V ------------------------------------------------------------------------------------
    if ABLATE != 2:
        if USE_TMA:
            v = desc_v.load([v_row + start_n, v_col])
        else:
            if MASKED:
                v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_vn,
                            mask=(offs < kv_len_b)[:, None] & d_valid[None, :], other=0.0)
            elif PAD_D:
                v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_vn, mask=d_valid[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_vn)
        if IEEE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _kv_blocks(
    acc, l_i, m_i, q, lo, hi,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    desc_k, desc_v, k_row, k_col, v_row, v_col,
    km_ptrs, stride_mn,
    q_last, kv_first, kv_len_b, offs_n, d_valid, sm_scale_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    USE_TMA: tl.constexpr,
    PAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    ABLATE: tl.constexpr,
):
    """Online-softmax update of one tile over the key blocks [lo, hi) (lo, hi multiples of BLOCK_N).

    MASKED: apply the length, causal and start-offset masks (loops A and C). HAS_KEY_MASK: apply the
    per-key mask (any loop). ABLATE (benchmark-only stage removal, wrong results): 1 = no softmax
    (P = S), 2 = no P@V product, 3 = no masks.
    """
    if WARP_SPEC:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            acc, l_i, m_i = _kv_step(
                acc, l_i, m_i, q, start_n, k_ptrs, v_ptrs, stride_kn, stride_vn,
                desc_k, desc_v, k_row, k_col, v_row, v_col, km_ptrs, stride_mn,
                q_last, kv_first, kv_len_b, offs_n, d_valid, sm_scale_log2,
                MASKED, IS_CAUSAL, HAS_KEY_MASK, HAS_KV_START, USE_TMA, PAD_D, BLOCK_N, IEEE_DOT, ABLATE)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _kv_step(
                acc, l_i, m_i, q, start_n, k_ptrs, v_ptrs, stride_kn, stride_vn,
                desc_k, desc_v, k_row, k_col, v_row, v_col, km_ptrs, stride_mn,
                q_last, kv_first, kv_len_b, offs_n, d_valid, sm_scale_log2,
                MASKED, IS_CAUSAL, HAS_KEY_MASK, HAS_KV_START, USE_TMA, PAD_D, BLOCK_N, IEEE_DOT, ABLATE)
    return acc, l_i, m_i


@triton.jit
def _attend_tile(
    Q, K, V, Out, Lse, KeyMask, KvStart, CuSeqlensQ, CuSeqlensK,
    desc_q, desc_k, desc_v, desc_o,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mn,
    b, h, m_blk, q_len, kv_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_KV_START: tl.constexpr,
    IS_VARLEN: tl.constexpr, STORE_LSE: tl.constexpr, USE_TMA: tl.constexpr, TMA_QO: tl.constexpr,
    WARP_SPEC: tl.constexpr, IEEE_DOT: tl.constexpr, ABLATE: tl.constexpr,
):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    kvh = h // GROUP
    if IS_VARLEN:
        qs = tl.load(CuSeqlensQ + b)
        q_len_b = tl.load(CuSeqlensQ + b + 1) - qs
        ks = tl.load(CuSeqlensK + b)
        kv_len_b = tl.load(CuSeqlensK + b + 1) - ks
    else:
        qs = b * 0
        ks = b * 0
        q_len_b = q_len
        kv_len_b = kv_len
    m0 = m_blk * BLOCK_M
    if m0 < q_len_b:
        b64 = b.to(tl.int64)  # batch strides are 0 for varlen
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        rows = m0 + offs_m
        row_valid = rows < q_len_b

        # Element offsets of this (sequence, head)'s first token, int64.
        q_off = b64 * stride_qb + h.to(tl.int64) * stride_qh + qs.to(tl.int64) * stride_qm
        k_off = b64 * stride_kb + kvh.to(tl.int64) * stride_kh + ks.to(tl.int64) * stride_kn
        v_off = b64 * stride_vb + kvh.to(tl.int64) * stride_vh + ks.to(tl.int64) * stride_vn
        o_off = b64 * stride_ob + h.to(tl.int64) * stride_oh + qs.to(tl.int64) * stride_om

        # -- Q tile (stays in registers / shared memory for the whole tile) --------------------------
        if TMA_QO:
            # 2-D descriptors over the storage: [rows, row stride]; (row, column) of this head's token 0.
            q_row = (q_off // stride_qm).to(tl.int32)
            q_col = (q_off % stride_qm).to(tl.int32)
            q = desc_q.load([q_row + m0, q_col])
        else:
            q = tl.load(Q + q_off + rows[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd,
                        mask=row_valid[:, None] & d_valid[None, :], other=0.0)
        if USE_TMA:
            k_row = (k_off // stride_kn).to(tl.int32)
            k_col = (k_off % stride_kn).to(tl.int32)
            v_row = (v_off // stride_vn).to(tl.int32)
            v_col = (v_off % stride_vn).to(tl.int32)
        else:
            k_row = 0
            k_col = 0
            v_row = 0
            v_col = 0
        k_ptrs = K + k_off + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = V + v_off + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        km_ptrs = KeyMask
        if HAS_KEY_MASK:
            km_ptrs = KeyMask + b64 * stride_mb

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # -- key ranges --------------------------------------------------------------------------------
        shift = kv_len_b - q_len_b
        q_last = rows + shift  # last key each row may see (causal)
        if HAS_KV_START:
            kv_first = tl.load(KvStart + b)
            lo = (kv_first // BLOCK_N) * BLOCK_N
        else:
            kv_first = 0
            lo = 0
        tail_start = (kv_len_b // BLOCK_N) * BLOCK_N
        if IS_CAUSAL:
            last_row = tl.minimum(m0 + BLOCK_M, q_len_b) - 1
            kv_end = tl.minimum(kv_len_b, tl.maximum(last_row + shift + 1, 0))
            # every row of the tile sees all keys < m0 + shift + 1
            full_end = tl.minimum((tl.maximum(m0 + shift + 1, 0) // BLOCK_N) * BLOCK_N, tail_start)
        else:
            kv_end = kv_len_b
            full_end = tail_start
        full_end = tl.maximum(full_end, lo)
        if HAS_KV_START and not HAS_KEY_MASK:
            a_end = tl.minimum(((kv_first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, full_end)
        else:
            a_end = lo

        if HAS_KV_START and not HAS_KEY_MASK:  # A: the block holding the first visible key
            acc, l_i, m_i = _kv_blocks(
                acc, l_i, m_i, q, lo, a_end, k_ptrs, v_ptrs, stride_kn, stride_vn,
                desc_k, desc_v, k_row, k_col, v_row, v_col, km_ptrs, stride_mn,
                q_last, kv_first, kv_len_b, offs_n, d_valid, sm_scale_log2,
                True, IS_CAUSAL, HAS_KEY_MASK, HAS_KV_START, USE_TMA, PAD_D, BLOCK_N, IEEE_DOT, False, ABLATE)
        # B: blocks fully visible to every row: no mask
        acc, l_i, m_i = _kv_blocks(
            acc, l_i, m_i, q, a_end, full_end, k_ptrs, v_ptrs, stride_kn, stride_vn,
            desc_k, desc_v, k_row, k_col, v_row, v_col, km_ptrs, stride_mn,
            q_last, kv_first, kv_len_b, offs_n, d_valid, sm_scale_log2,
            False, IS_CAUSAL, HAS_KEY_MASK, HAS_KV_START, USE_TMA, PAD_D, BLOCK_N, IEEE_DOT, WARP_SPEC, ABLATE)
        # C: the causal diagonal and the ragged tail, masked
        acc, l_i, m_i = _kv_blocks(
            acc, l_i, m_i, q, full_end, kv_end, k_ptrs, v_ptrs, stride_kn, stride_vn,
            desc_k, desc_v, k_row, k_col, v_row, v_col, km_ptrs, stride_mn,
            q_last, kv_first, kv_len_b, offs_n, d_valid, sm_scale_log2,
            True, IS_CAUSAL, HAS_KEY_MASK, HAS_KV_START, USE_TMA, PAD_D, BLOCK_N, IEEE_DOT, False, ABLATE)

        # -- epilogue: one normalisation; rows that saw no key -> 0 -----------------------------------
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = (acc * (1.0 / l_safe)[:, None]).to(Out.dtype.element_ty)
        if STORE_LSE:
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
            l_ptrs = (Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh
                      + (qs + rows).to(tl.int64) * stride_lm)
            tl.store(l_ptrs, lse, mask=row_valid)
        o_ptrs = Out + o_off + rows[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od
        if TMA_QO:
            # a full tile goes out through TMA; a partial one must not spill into the next sequence
            if m0 + BLOCK_M <= q_len_b:
                o_row = (o_off // stride_om).to(tl.int32)
                o_col = (o_off % stride_om).to(tl.int32)
                desc_o.store([o_row + m0, o_col], out)
            else:
                tl.store(o_ptrs, out, mask=row_valid[:, None] & d_valid[None, :])
        else:
            tl.store(o_ptrs, out, mask=row_valid[:, None] & d_valid[None, :])


@triton.jit
def _prefill_fwd_kernel(
    Q, K, V, Out, Lse, KeyMask, KvStart, CuSeqlensQ, CuSeqlensK,
    desc_q, desc_k, desc_v, desc_o,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mn,
    batch, num_heads, q_len, kv_len, num_m_blocks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_KV_START: tl.constexpr,
    IS_VARLEN: tl.constexpr, STORE_LSE: tl.constexpr, USE_TMA: tl.constexpr, TMA_QO: tl.constexpr,
    PERSISTENT: tl.constexpr, REVERSE_M: tl.constexpr, WARP_SPEC: tl.constexpr,
    IEEE_DOT: tl.constexpr, ABLATE: tl.constexpr,
):
    """Grid: (num_m_blocks, batch * num_heads), or (programs,) looping over the same tiles when
    PERSISTENT. Row tiles of one head are consecutive (L2 reuse of its K/V); REVERSE_M starts each head
    with its longest (last) causal row tile so the short ones fill the tail."""
    if PERSISTENT:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        num_tiles = num_m_blocks * batch * num_heads
        for tile in range(pid, num_tiles, nprog):
            bh = tile // num_m_blocks
            r = tile % num_m_blocks
            if REVERSE_M:
                m_blk = num_m_blocks - 1 - r
            else:
                m_blk = r
            _attend_tile(
                Q, K, V, Out, Lse, KeyMask, KvStart, CuSeqlensQ, CuSeqlensK,
                desc_q, desc_k, desc_v, desc_o, sm_scale_log2,
                stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                stride_lb, stride_lh, stride_lm, stride_mb, stride_mn,
                bh // num_heads, bh % num_heads, m_blk, q_len, kv_len,
                GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_KEY_MASK, HAS_KV_START,
                IS_VARLEN, STORE_LSE, USE_TMA, TMA_QO, WARP_SPEC, IEEE_DOT, ABLATE)
    else:
        r = tl.program_id(0)
        bh = tl.program_id(1)
        if REVERSE_M:
            m_blk = num_m_blocks - 1 - r
        else:
            m_blk = r
        _attend_tile(
            Q, K, V, Out, Lse, KeyMask, KvStart, CuSeqlensQ, CuSeqlensK,
            desc_q, desc_k, desc_v, desc_o, sm_scale_log2,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
            stride_lb, stride_lh, stride_lm, stride_mb, stride_mn,
            bh // num_heads, bh % num_heads, m_blk, q_len, kv_len,
            GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_KEY_MASK, HAS_KV_START,
            IS_VARLEN, STORE_LSE, USE_TMA, TMA_QO, WARP_SPEC, IEEE_DOT, ABLATE)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------


def _tma_layout_ok(t: torch.Tensor, head_stride: int, batch_stride: int, n_heads: int, head_dim: int) -> bool:
    """A 2-D descriptor [rows, row_stride] covers the tensor iff every head starts at a fixed column."""
    sm = t.stride(-2) if t.dim() == 4 else t.stride(0)
    esz = t.element_size()
    if t.stride(-1) != 1 or (sm * esz) % 16 or t.data_ptr() % 16:
        return False
    if batch_stride % sm:
        return False
    return head_stride % sm == 0 or (n_heads - 1) * head_stride + head_dim <= sm


def _descriptor(t: torch.Tensor, row_stride: int, block_rows: int, block_d: int):
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    rows = cdiv(span, row_stride)
    return TensorDescriptor(t, [rows, row_stride], [row_stride, 1], [block_rows, block_d])


_DEVICE_INFO: dict = {}


def _device_info(device) -> tuple[int, int]:
    """(compute capability major, multiprocessor count), cached per device (host time matters)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    info = _DEVICE_INFO.get(idx)
    if info is None:
        props = torch.cuda.get_device_properties(idx)
        info = _DEVICE_INFO[idx] = (props.major, props.multi_processor_count)
    return info


def _launch(q4, k4, v4, o4, lse, key_mask, kv_start, cu_q, cu_k, *, batch, num_heads, num_kv_heads,
            q_len, kv_len, max_q, head_dim, causal, varlen, sm_scale, cfg: PrefillConfig):
    """q4/k4/v4/o4: [B', H, L', D] views (varlen: B' = 1, L' = total tokens)."""
    block_d = max(16, next_pow2(head_dim))
    use_tma = (cfg.use_tma and TensorDescriptor is not None and block_d == head_dim
               and q4.is_cuda and not interpreting() and _device_info(q4.device)[0] >= 9
               and all(_tma_layout_ok(t, t.stride(1), t.stride(0) if not varlen else 0, t.shape[1], head_dim)
                       for t in (q4, k4, v4, o4)))
    desc_q = desc_k = desc_v = desc_o = None
    if use_tma:
        desc_k = _descriptor(k4, k4.stride(2), cfg.block_n, block_d)
        desc_v = _descriptor(v4, v4.stride(2), cfg.block_n, block_d)
        if cfg.tma_qo:
            desc_q = _descriptor(q4, q4.stride(2), cfg.block_m, block_d)
            desc_o = _descriptor(o4, o4.stride(2), cfg.block_m, block_d)
    num_m = cdiv(max_q, cfg.block_m)
    if cfg.persistent and q4.is_cuda and not interpreting():
        per_sm = cfg.programs_per_sm or (2 if cfg.num_warps <= 4 else 1)
        grid = (min(num_m * batch * num_heads, per_sm * _device_info(q4.device)[1]),)
    elif cfg.persistent:
        grid = (min(num_m * batch * num_heads, 4),)
    else:
        grid = (num_m, batch * num_heads)
    sq, sk, sv, so = q4.stride(), k4.stride(), v4.stride(), o4.stride()
    if varlen:
        sq, sk, sv, so = ((0,) + t[1:] for t in (sq, sk, sv, so))
    if lse is not None:
        if varlen:  # [H, total_q]
            lse_strides = (0, lse.stride(0), lse.stride(1))
        else:  # [B, H, q_len]
            lse_strides = (lse.stride(0), lse.stride(1), lse.stride(2))
    else:
        lse_strides = (0, 0, 0)
    mask_strides = (key_mask.stride(0), key_mask.stride(1)) if key_mask is not None else (0, 0)
    check_launch_device(q4, "prefill_attention")
    _prefill_fwd_kernel[grid](
        q4, k4, v4, o4, lse, key_mask, kv_start, cu_q, cu_k,
        desc_q, desc_k, desc_v, desc_o,
        sm_scale * _LOG2E,
        *sq, *sk, *sv, *so,
        *lse_strides, *mask_strides,
        batch, num_heads, q_len, kv_len, num_m,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_CAUSAL=bool(causal), HAS_KEY_MASK=key_mask is not None, HAS_KV_START=kv_start is not None,
        IS_VARLEN=varlen, STORE_LSE=lse is not None, USE_TMA=use_tma, TMA_QO=use_tma and cfg.tma_qo,
        PERSISTENT=cfg.persistent, REVERSE_M=cfg.reverse_m and bool(causal),
        WARP_SPEC=cfg.warp_specialize, IEEE_DOT=q4.dtype == torch.float32, ABLATE=cfg.ablate,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _run(args: dict, key: tuple, head_dim: int, max_q: int, config: PrefillConfig | None):
    if config is not None:
        _launch(**args, cfg=config)
        return
    if interpreting() or not args["q4"].is_cuda:
        _launch(**args, cfg=default_interpret_config(head_dim, max_q))
        return
    cfg = TUNED.get(key)
    if cfg is None:
        cfg = tune(_launch, args, key, head_dim, max_q)
    _launch(**args, cfg=cfg)


def _check_common(dtype, head_dim, num_heads, num_kv_heads):
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head_dim {head_dim} is not supported (1..{MAX_HEAD_DIM})")
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    kv_start: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
):
    """Prefill attention (FlashAttention-2 forward) with GQA, bottom-right causal mask, key padding.

    Args:
        query: [batch, num_heads, q_len, head_dim], fp16/bf16/fp32 (fp32 for tests), any strides with a
            unit stride on head_dim for the TMA path (others fall back to pointer loads).
        key: [batch, num_kv_heads, kv_len, head_dim], same dtype; ``num_heads % num_kv_heads == 0``.
        value: [batch, num_kv_heads, kv_len, head_dim], same dtype.
        key_mask: optional [batch, kv_len], bool or integer, nonzero = key visible (e.g. the 2-D
            attention mask of left-padded prompts; any pattern). Key blocks before each row's first
            visible key are skipped.
        causal: query ``i`` sees key ``j`` iff ``j <= i + kv_len - q_len`` (bottom-right aligned).
        sm_scale: softmax scale, float, 1/sqrt(logit unit); default ``1/sqrt(head_dim)``.
        kv_start: optional [batch], int32, key index: keys before it are invisible (left padding given
            as start offsets: only the one block holding the start is masked). With ``key_mask`` too, the mask
            must hide the keys before ``kv_start`` as well: blocks after the start are read through the mask only.
        return_lse: also return the log-sum-exp [batch, num_heads, q_len], fp32, natural log of the
            scaled logits (``-inf`` for rows that see no key).
        out: optional [batch, q_len, num_heads, head_dim] output buffer of the query's dtype.
        config: a fixed :class:`PrefillConfig` (benchmarks); default: tuned per key.

    Returns:
        out [batch, q_len, num_heads, head_dim], query's dtype (the layout transformers expects after
        attention), or ``(out, lse)`` with ``return_lse``. Rows that see no key are 0.

    Raises:
        ValueError: mismatched shapes/dtypes/devices, unsupported dtype, head_dim > 256, num_heads not
            a multiple of num_kv_heads, a mask or offsets of the wrong shape, ``sm_scale`` <= 0.

    Algorithm: FlashAttention-2 forward (Dao 2023, Algorithm 1; causal block skipping and
    diagonal-only masking, section 3.1.1), see the module docstring.

    Tuning (H200, Triton 3.6, bf16, B4 H32 L4096 D128 causal unless said; TFLOP/s from the sweep of
    ``benchmarks/bench_prefill.py``, ``benchmarks/results/bench_prefill-20261130.json``; more in
    ``docs/prefill.md``):

    * ``BLOCK_M=64, BLOCK_N=64``, 4 warps (one warpgroup), 3 stages: two CTAs fit on an SM, so one
      CTA's softmax runs while the other's wgmma does (a stand-in for FA3's ping-pong, which Triton
      3.6 does not generate on sm_90): 492 vs 453 TFLOP/s for 128x128 with 8 warps (+9%); D64: 394 vs
      313 (+26%); 128x64/8 warps 428, 64x32 448.
    * ``num_stages=3``: 2 stages 398 (-19%); 4 stages did not pay in an earlier run (350, -29%).
    * K/V through TMA descriptors: 492 vs 460 with pointer loads (+7%); 502 vs 470 at B1 H32 KV8
      L16k. Q/O through descriptors as well bought nothing (492.5) and costs host time per launch
      (101 vs 87 us on that host), so Q is loaded and O stored through pointers.
    * Longest row tile first within each head (``reverse_m``): 492 vs 472 (+4%). Heads of a group are
      adjacent in the grid so each K/V is read from HBM about once.
    * Persistent grid (2 programs per SM, same tile order): 434 at this shape (-12%), 518 vs 502 at
      B1 H32 KV8 L16k (+3%); not among the tuner's candidates.
    * ``tl.range(warp_specialize=True)``: Triton 3.6 either compiled it to the same speed (459 vs 457
      in an earlier run, Q/K/V/O through TMA) or failed to compile it (K/V-only TMA); left off.
    * The tuner times each candidate as back-to-back calls (wall time), so where the host bounds a
      launch the cheaper launch wins; the candidates are the two or four configs that won some shape
      in the sweep (64x64/4w with and without TMA, 128x128/8w for the longest D128 sequences).
    * Masking only the diagonal/tail blocks: removing the masks entirely saves 0.6% (1.246 vs
      1.238 ms), so the three-loop split leaves nothing to gain there.
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"expected 4-D query/key/value; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    batch, num_heads, q_len, head_dim = query.shape
    kb, num_kv_heads, kv_len, kd = key.shape
    if key.shape != value.shape or kb != batch or kd != head_dim:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match query "
                         f"{tuple(query.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError("query/key/value must be on one device")
    _check_common(query.dtype, head_dim, num_heads, num_kv_heads)
    if key_mask is not None and (key_mask.dim() != 2 or tuple(key_mask.shape) != (batch, kv_len)):
        raise ValueError(f"key_mask must be [batch, kv_len] = {(batch, kv_len)}; got {tuple(key_mask.shape)}")
    if kv_start is not None and (kv_start.dim() != 1 or kv_start.shape[0] != batch):
        raise ValueError(f"kv_start must be [batch] = [{batch}]; got {tuple(kv_start.shape)}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    elif not sm_scale > 0:  # the online softmax takes the running maximum of the scaled logits as max(s) * scale
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    if out is None:
        out = torch.empty(batch, q_len, num_heads, head_dim, dtype=query.dtype, device=query.device)
    elif tuple(out.shape) != (batch, q_len, num_heads, head_dim) or out.dtype != query.dtype:
        raise ValueError(f"out must be [batch, q_len, num_heads, head_dim] {query.dtype}; got {tuple(out.shape)}")
    lse = (torch.empty(batch, num_heads, q_len, dtype=torch.float32, device=query.device)
           if return_lse else None)
    if batch == 0 or q_len == 0 or num_heads == 0:
        return (out, lse) if return_lse else out
    if kv_len == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out

    if key_mask is not None:
        if key_mask.dtype == torch.bool:
            key_mask = key_mask.view(torch.uint8) if key_mask.is_contiguous() else key_mask.to(torch.uint8)
        if kv_start is None:  # first visible key of each row: blocks before it are skipped
            kv_start = (key_mask != 0).to(torch.int32).argmax(dim=1).to(torch.int32)
    if kv_start is not None:
        kv_start = kv_start.to(device=query.device, dtype=torch.int32).contiguous()

    args = dict(q4=query, k4=key, v4=value, o4=out.transpose(1, 2), lse=lse, key_mask=key_mask,
                kv_start=kv_start, cu_q=None, cu_k=None, batch=batch, num_heads=num_heads,
                num_kv_heads=num_kv_heads, q_len=q_len, kv_len=kv_len, max_q=q_len, head_dim=head_dim,
                causal=causal, varlen=False, sm_scale=float(sm_scale))
    tkey = (head_dim, query.dtype, bool(causal), False, key_mask is not None, bucket(q_len), bucket(kv_len))
    _run(args, tkey, head_dim, q_len, config)
    return (out, lse) if return_lse else out


def prefill_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
):
    """Prefill attention over packed variable-length sequences (no padding anywhere).

    Args:
        query: [total_q, num_heads, head_dim], fp16/bf16/fp32; sequence ``b`` is rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        key: [total_k, num_kv_heads, head_dim], same dtype; value: same shape as key.
        cu_seqlens_q: [batch + 1], int32, token offsets (prefix sums of the query lengths, starts at 0).
        cu_seqlens_k: [batch + 1], int32, token offsets of the keys; per sequence ``kv_len >= 0`` may
            differ from ``q_len`` (chunked prefill: bottom-right causal per sequence).
        max_seqlen_q: int, tokens, the longest query sequence (sizes the grid; host int, no sync).
        max_seqlen_k: int, tokens, the longest key sequence (selects the tuning bucket).
        causal, sm_scale, config: as in :func:`prefill_attention`.
        return_lse: also return the log-sum-exp [num_heads, total_q], fp32, natural log.
        out: optional [total_q, num_heads, head_dim] output buffer.

    Returns:
        out [total_q, num_heads, head_dim], query's dtype, or ``(out, lse)``.

    Raises:
        ValueError: mismatched shapes/dtypes, unsupported dtype/head_dim, bad cu_seqlens shapes; offsets
            that do not start at 0, decrease, or end elsewhere than at total_q / total_k; a query sequence
            longer than ``max_seqlen_q``; ``sm_scale`` <= 0. (The offsets are read on the host, one small copy, except while a
            CUDA graph is being captured: there they are the caller's to get right.)
    """
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("varlen expects query [total_q, H, D] and key/value [total_k, H_kv, D]")
    total_q, num_heads, head_dim = query.shape
    total_k, num_kv_heads, kd = key.shape
    if key.shape != value.shape or kd != head_dim:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match query {tuple(query.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    _check_common(query.dtype, head_dim, num_heads, num_kv_heads)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_k.shape != cu_seqlens_q.shape or cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q/k must be 1-D [batch + 1] of equal length")
    batch = cu_seqlens_q.shape[0] - 1
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given < 0:
            raise ValueError(f"{name} must be a host int >= 0; got {given!r}")
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    if not capturing(query):  # values: one small copy to the host
        _check_cu_seqlens(cu_seqlens_q, total_q, "q", max_seqlen_q)
        _check_cu_seqlens(cu_seqlens_k, total_k, "k", None)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    elif not sm_scale > 0:  # the online softmax takes the running maximum of the scaled logits as max(s) * scale
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    if out is None:
        out = torch.empty(total_q, num_heads, head_dim, dtype=query.dtype, device=query.device)
    elif tuple(out.shape) != (total_q, num_heads, head_dim) or out.dtype != query.dtype:
        raise ValueError(f"out must be [total_q, num_heads, head_dim] {query.dtype}; got {tuple(out.shape)}")
    lse = torch.empty(num_heads, total_q, dtype=torch.float32, device=query.device) if return_lse else None
    if batch == 0 or total_q == 0 or max_seqlen_q == 0:
        return (out, lse) if return_lse else out
    cu_q = cu_seqlens_q.to(device=query.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=query.device, dtype=torch.int32).contiguous()

    def as4(t):  # [T, H, D] -> [1, H, T, D] view
        return t.permute(1, 0, 2).unsqueeze(0)

    args = dict(q4=as4(query), k4=as4(key), v4=as4(value), o4=as4(out), lse=lse, key_mask=None,
                kv_start=None, cu_q=cu_q, cu_k=cu_k, batch=batch, num_heads=num_heads,
                num_kv_heads=num_kv_heads, q_len=0, kv_len=0, max_q=int(max_seqlen_q), head_dim=head_dim,
                causal=causal, varlen=True, sm_scale=float(sm_scale))
    tkey = (head_dim, query.dtype, bool(causal), True, False, bucket(max_seqlen_q), bucket(max_seqlen_k))
    _run(args, tkey, head_dim, int(max_seqlen_q), config)
    return (out, lse) if return_lse else out


def _check_cu_seqlens(cu: torch.Tensor, total: int, which: str, max_seqlen: int | None) -> None:
    """ValueError unless ``cu`` are offsets 0 <= ... <= total ending at ``total`` (each length <= max_seqlen)."""
    if cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"cu_seqlens_{which} must be an integer tensor; got {cu.dtype}")
    offsets = cu.tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != total or any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens_{which} must rise from 0 to the {total} rows of the packed "
                         f"{'query' if which == 'q' else 'key/value'} tensor; got {offsets}")
    if max_seqlen is not None and lengths and max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen_{which}={max_seqlen} is shorter than a sequence of cu_seqlens_{which} "
                         f"({max(lengths)} tokens)")



__all__ = [
    "PrefillConfig",
    "prefill_attention",
    "prefill_attention_ref",
    "prefill_attention_varlen",
    "prefill_attention_varlen_ref",
    "tuned_configs",
]
