"""The prefill attention kernel (FlashAttention-2 forward, Dao 2023, Algorithm 1): the Triton code behind
:func:`hf_accel.kernels.prefill.prefill_attention` and :func:`~hf_accel.kernels.prefill.prefill_attention_varlen`,
whose module docstring describes the algorithm, the three key loops (A: start-offset block, B: unmasked blocks,
C: diagonal and ragged tail), the layouts and the TMA path. ``_prefill_fwd_kernel`` is launched only by
``hf_accel.kernels.prefill._launch``.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
