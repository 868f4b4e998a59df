"""Small-batch linear layers with the decode step's neighbours fused in: RMSNorm (+ residual add) as a
prologue, SwiGLU or a float32 cast as an epilogue.

At decode time a layer's matmuls see 1-16 token rows, so each one is a matrix-vector product whose time is
the weight read plus a few microseconds of launch and ramp-up; the RMSNorm and SwiGLU kernels between
them cost as much again in launches while moving almost no bytes. Here every program of the matmul
recomputes the norm of its (few, short) input rows on the fly, so a llama layer runs

    qkv = norm_linear(x, input_norm, W_qkv)               # residual add + RMSNorm + Q/K/V projection
    ... RoPE + cache write, paged attention ...
    d = linear(o, W_o)
    a = norm_linear(d, post_norm, W_gate_up, swiglu)       # residual add + RMSNorm + gate/up + SiLU*up
    d = linear(a, W_down)

four matmul kernels and no separate norm or activation kernel. Rounding follows transformers' modules
step by step (residual sum, normalised value, norm-weight product, projection output and SiLU are each
rounded to the model dtype as ``LlamaRMSNorm`` / ``LlamaMLP`` round them); only the order of the float32
accumulation differs from cuBLAS.

RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization". SwiGLU: Shazeer 2020, "GLU
Variants Improve Transformer". The matmul is a Triton tile loop (``tl.dot`` over a 16- or 32-row tile, float32
accumulation); where it pays is measured in ``benchmarks/bench_fused_linear.py`` and decided in
:data:`hf_accel.engine.step_switches.FUSED_LINEAR_MAX_ROWS` / ``FUSED_LINEAR_MAX_HIDDEN``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.arrival import check_counters, last_to_arrive, reset_arrivals
from hf_accel.kernels.device import check_launch_device, check_interpreter_dot
from hf_accel.kernels.fused_linear_tiles import _tiles, _whole_k_tiles, max_rows
from hf_accel.kernels.linear_args import check_linear_args, check_rope_args, check_tiling, norm_prologue_step
from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from hf_accel.kernels.rms_norm import rms_norm_ref
from hf_accel.kernels.swiglu import swiglu_ref


@triton.jit
def _x_tile2d(x_rows, r_rows, NormW, offs_k, xm, k_ok, rstd, dt, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """Input rows' columns ``offs_k`` after the residual add and RMSNorm, rounded as transformers rounds."""
    x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
    if NORM:
        if RESIDUAL:
            r = tl.load(r_rows + offs_k[None, :], mask=xm, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        nw = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = (nw[None, :] * (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)).to(dt)
    return x


@triton.jit
def _dot_t(x, w, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


@triton.jit
def _epilogue(acc, acc_up, Bias, Y, rows, row_ok, offs_n, n_ok, stride_ym, dt, SWIGLU: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """Bias, rounding to the model dtype, SwiGLU; stores the output tile."""
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dt)
    if SWIGLU:
        g = out.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt)
        out = (s.to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    y_ptrs = Y + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _rope_epilogue2d(lo, hi, Bias, Y, Cos, Sin, KCache, VCache, SlotMapping, rows, row_ok, head, lane, dt,
                     stride_ym, stride_cm, num_heads, num_kv_heads, head_dim, block_size, stride_kcb, stride_kcs,
                     stride_kch, HAS_BIAS: tl.constexpr):
    """Q/K/V outputs ``lane`` and ``lane + head_dim / 2`` of flat head ``head`` (q heads, then k, then v) for
    every row: RoPE on q and k rounded as :mod:`.rope_cache` rounds it, q to ``Y``, k and v to each row's
    cache slot ``SlotMapping[row]`` (-1: not written)."""
    half = head_dim // 2
    if HAS_BIAS:
        lo += tl.load(Bias + head * head_dim + lane).to(tl.float32)[None, :]
        hi += tl.load(Bias + head * head_dim + lane + half).to(tl.float32)[None, :]
    lo = lo.to(dt)
    hi = hi.to(dt)
    m = row_ok[:, None] & (lane[None, :] < half)
    is_v = head >= num_heads + num_kv_heads
    if not is_v:
        c_rows = rows[:, None].to(tl.int64) * stride_cm
        cos_lo = tl.load(Cos + c_rows + lane[None, :], mask=m, other=0.0).to(tl.float32)
        sin_lo = tl.load(Sin + c_rows + lane[None, :], mask=m, other=0.0).to(tl.float32)
        cos_hi = tl.load(Cos + c_rows + lane[None, :] + half, mask=m, other=0.0).to(tl.float32)
        sin_hi = tl.load(Sin + c_rows + lane[None, :] + half, mask=m, other=0.0).to(tl.float32)
        lo_f, hi_f = lo.to(tl.float32), hi.to(tl.float32)
        new_lo = ((lo_f * cos_lo).to(dt).to(tl.float32) + ((-hi_f) * sin_lo).to(dt).to(tl.float32)).to(dt)
        new_hi = ((hi_f * cos_hi).to(dt).to(tl.float32) + (lo_f * sin_hi).to(dt).to(tl.float32)).to(dt)
        lo, hi = new_lo, new_hi
    if head < num_heads:
        y = Y + rows[:, None].to(tl.int64) * stride_ym + head * head_dim + lane[None, :]
        tl.store(y, lo.to(Y.dtype.element_ty), mask=m)
        tl.store(y + half, hi.to(Y.dtype.element_ty), mask=m)
    else:
        slot = tl.load(SlotMapping + rows, mask=row_ok, other=-1).to(tl.int64)
        kv_head = (head - num_heads) % num_kv_heads
        dst = ((slot // block_size) * stride_kcb + (slot % block_size) * stride_kcs + kv_head * stride_kch)[:, None] \
            + lane[None, :]
        sm = m & (slot >= 0)[:, None]
        if is_v:
            tl.store(VCache + dst, lo.to(VCache.dtype.element_ty), mask=sm)
            tl.store(VCache + dst + half, hi.to(VCache.dtype.element_ty), mask=sm)
        else:
            tl.store(KCache + dst, lo.to(KCache.dtype.element_ty), mask=sm)
            tl.store(KCache + dst + half, hi.to(KCache.dtype.element_ty), mask=sm)


@triton.jit
def _load_row_chunk(x_rows, r_rows, offs_k, xm, dt, RESIDUAL: tl.constexpr):
    """Input rows' columns ``offs_k`` (after the residual add, rounded to the model dtype)."""
    x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
    if RESIDUAL:
        r = tl.load(r_rows + offs_k[None, :], mask=xm, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
    return x


@triton.jit
def _normed(x, NormW, offs_k, k_ok, rstd, dt):
    """transformers' RMSNorm rounding of summed input columns ``offs_k``: weight * (x * rstd)."""
    nw = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    return (nw[None, :] * (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _whole_k_products(x_rows, r_rows, NormW, w_rows, ROut, rows, row_ok, n_ok, K, up_offset, stride_wn, stride_rom,
                      eps, store_sum, dt, NORM: tl.constexpr, RESIDUAL: tl.constexpr, TWO: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K2: tl.constexpr,
                      IEEE_DOT: tl.constexpr, PDL: tl.constexpr):
    """The whole-K path of :func:`_fused_linear_kernel`: the program's weights, all of K as two power-of-two
    column chunks ``[0, BLOCK_K)`` (full) and ``[BLOCK_K, BLOCK_K + BLOCK_K2)`` (masked past K; none when
    BLOCK_K2 is 0), are loaded before the PDL wait; after it one load of the input rows feeds the norm and
    both products. No loop: one memory round trip after the wait. Returns the float32 products with the
    weight rows and (``TWO``) with the rows ``up_offset`` further on."""
    offs_a = tl.arange(0, BLOCK_K)
    wa = tl.load(w_rows + offs_a[None, :], mask=n_ok[:, None], other=0.0)
    if TWO:
        wua = tl.load(w_rows + up_offset * stride_wn + offs_a[None, :], mask=n_ok[:, None], other=0.0)
    if BLOCK_K2 > 0:
        offs_b = BLOCK_K + tl.arange(0, BLOCK_K2)
        kb_ok = offs_b < K
        wmb = n_ok[:, None] & kb_ok[None, :]
        wb = tl.load(w_rows + offs_b[None, :], mask=wmb, other=0.0)
        if TWO:
            wub = tl.load(w_rows + up_offset * stride_wn + offs_b[None, :], mask=wmb, other=0.0)
    if PDL:
        gdc_wait()  # x, the residual and the outputs may belong to the previous kernel
    xa = _load_row_chunk(x_rows, r_rows, offs_a, row_ok[:, None], dt, RESIDUAL)
    if BLOCK_K2 > 0:
        xmb = row_ok[:, None] & kb_ok[None, :]
        xb = _load_row_chunk(x_rows, r_rows, offs_b, xmb, dt, RESIDUAL)
    if RESIDUAL:
        if store_sum:
            r_out = ROut + rows[:, None].to(tl.int64) * stride_rom
            tl.store(r_out + offs_a[None, :], xa, mask=row_ok[:, None])
            if BLOCK_K2 > 0:
                tl.store(r_out + offs_b[None, :], xb, mask=xmb)
    if NORM:
        xf = xa.to(tl.float32)
        ss = tl.sum(xf * xf, 1)
        if BLOCK_K2 > 0:
            xbf = xb.to(tl.float32)
            ss += tl.sum(xbf * xbf, 1)
        rstd = tl.rsqrt(ss / K + eps)
        xa = _normed(xa, NormW, offs_a, offs_a < K, rstd, dt)
        if BLOCK_K2 > 0:
            xb = _normed(xb, NormW, offs_b, kb_ok, rstd, dt)
    acc = _dot_t(xa, wa, IEEE_DOT)
    acc_up = tl.zeros_like(acc)
    if TWO:
        acc_up = _dot_t(xa, wua, IEEE_DOT)
    if BLOCK_K2 > 0:
        acc += _dot_t(xb, wb, IEEE_DOT)
        if TWO:
            acc_up += _dot_t(xb, wub, IEEE_DOT)
    return acc, acc_up


@triton.jit
def _fused_linear_kernel(
    X, R, NormW, W, Bias, Y, ROut, Part, Counters,
    Cos, Sin, KCache, VCache, SlotMapping,
    M, N, K, up_offset, k_per_split,
    stride_xm, stride_rm, stride_wn, stride_ym, stride_rom, stride_cm,
    eps,
    num_heads, num_kv_heads, head_dim, block_size, stride_kcb, stride_kcs, stride_kch,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    PDL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRELOAD: tl.constexpr,
    NORM_K: tl.constexpr,
    ROPE: tl.constexpr,
    WHOLE_K: tl.constexpr = False,
    BLOCK_K2: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dt = X.dtype.element_ty
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # row blocks: the whole-K path only
    row_ok = rows < M
    if ROPE:
        # BLOCK_N lanes of one head's first half; their partners up_offset (= head_dim / 2) rows on are the
        # "up" weights: the pairs RoPE rotates together
        lanes_per_head = up_offset // BLOCK_N
        head = pid_n // lanes_per_head
        lane = (pid_n % lanes_per_head) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = head * head_dim + lane
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm
    r_rows = R + rows[:, None].to(tl.int64) * stride_rm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PDL:
        gdc_launch_dependents()
    if WHOLE_K:
        acc, acc_up = _whole_k_products(x_rows, r_rows, NormW, w_rows, ROut, rows, row_ok, n_ok, K, up_offset,
                                        stride_wn, stride_rom, eps, pid_n == 0, dt, NORM, RESIDUAL,
                                        SWIGLU or ROPE, BLOCK_M, BLOCK_K, BLOCK_K2, IEEE_DOT, PDL)
        if ROPE:
            _rope_epilogue2d(acc, acc_up, Bias, Y, Cos, Sin, KCache, VCache, SlotMapping, rows, row_ok, head, lane,
                             dt, stride_ym, stride_cm, num_heads, num_kv_heads, head_dim, block_size, stride_kcb,
                             stride_kcs, stride_kch, HAS_BIAS)
        else:
            _epilogue(acc, acc_up, Bias, Y, rows, row_ok, offs_n, n_ok, stride_ym, dt, SWIGLU, HAS_BIAS)
    else:
        if PRELOAD:
            # The first weight tile(s) of this program's K range before waiting: no kernel writes weights.
            offs_k0 = k_lo + tl.arange(0, BLOCK_K)
            wm0 = n_ok[:, None] & (offs_k0[None, :] < k_hi)
            w0 = tl.load(w_rows + offs_k0[None, :], mask=wm0, other=0.0)
            if SWIGLU or ROPE:
                wu0 = tl.load(w_rows + up_offset * stride_wn + offs_k0[None, :], mask=wm0, other=0.0)
        if PDL:
            gdc_wait()  # x, the residual and the outputs may belong to the previous kernel

        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:
            # Pass 1: mean square of each row over the whole K (of x + residual when given, rounded first).
            # NORM_K columns per step: the steps' loads wait on one another (an L2 round trip each)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, NORM_K):
                offs_k = k0 + tl.arange(0, NORM_K)
                xm = row_ok[:, None] & (offs_k[None, :] < K)
                x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
                if RESIDUAL:
                    r = tl.load(r_rows + offs_k[None, :], mask=xm, other=0.0)
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
                    if (pid_n == 0) & (pid_k == 0):
                        tl.store(ROut + rows[:, None].to(tl.int64) * stride_rom + offs_k[None, :], x, mask=xm)
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, 1)
            rstd = tl.rsqrt(ss / K + eps)

        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        first = k_lo
        if PRELOAD:
            offs_k = k_lo + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_hi
            x = _x_tile2d(x_rows, r_rows, NormW, offs_k, row_ok[:, None] & k_ok[None, :], k_ok, rstd, dt, NORM, RESIDUAL)
            acc += _dot_t(x, w0, IEEE_DOT)
            if SWIGLU or ROPE:
                acc_up += _dot_t(x, wu0, IEEE_DOT)
            first = k_lo + BLOCK_K
        for k0 in range(first, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_hi
            if EVEN_K:
                xm = row_ok[:, None]
                wm = n_ok[:, None]
            else:
                xm = row_ok[:, None] & k_ok[None, :]
                wm = n_ok[:, None] & k_ok[None, :]
            x = _x_tile2d(x_rows, r_rows, NormW, offs_k, xm, k_ok, rstd, dt, NORM, RESIDUAL)
            w = tl.load(w_rows + offs_k[None, :], mask=wm, other=0.0)
            acc += _dot_t(x, w, IEEE_DOT)
            if SWIGLU or ROPE:
                wu = tl.load(w_rows + up_offset * stride_wn + offs_k[None, :], mask=wm, other=0.0)
                acc_up += _dot_t(x, wu, IEEE_DOT)

        if SPLIT_K > 1:
            # Split-K: each program stores its float32 partial sums; the last program of this output tile to
            # arrive (atomic counter, acquire/release at GPU scope) adds them in split order (deterministic),
            # resets the counter for the next launch and runs the epilogue.
            tile = rows[:, None] * N + offs_n[None, :]
            tmask = row_ok[:, None] & n_ok[None, :]
            tl.store(Part + pid_k * (BLOCK_M * N) + tile, acc, mask=tmask)
            if SWIGLU:
                tl.store(Part + (SPLIT_K + pid_k) * (BLOCK_M * N) + tile, acc_up, mask=tmask)
            if last_to_arrive(Counters + pid_n, SPLIT_K):
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # unrolled: every split's loads in flight at once
                    acc += tl.load(Part + s * (BLOCK_M * N) + tile, mask=tmask, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(Part + (SPLIT_K + s) * (BLOCK_M * N) + tile, mask=tmask, other=0.0,
                                          cache_modifier=".cg")
                reset_arrivals(Counters + pid_n)
                _epilogue(acc, acc_up, Bias, Y, rows, row_ok, offs_n, n_ok, stride_ym, dt, SWIGLU, HAS_BIAS)
        elif ROPE:
            _rope_epilogue2d(acc, acc_up, Bias, Y, Cos, Sin, KCache, VCache, SlotMapping, rows, row_ok, head, lane, dt,
                             stride_ym, stride_cm, num_heads, num_kv_heads, head_dim, block_size, stride_kcb, stride_kcs,
                             stride_kch, HAS_BIAS)
        else:
            _epilogue(acc, acc_up, Bias, Y, rows, row_ok, offs_n, n_ok, stride_ym, dt, SWIGLU, HAS_BIAS)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    out_dtype: torch.dtype | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    split_k: int = 1,
    counters: torch.Tensor | None = None,
    preload: bool | None = None,
    norm_k: int | None = None,
    small_tiles: bool = False,
    whole_k: bool = False,
):
    """``y = f(g(x) @ weight.T + bias)`` for at most :data:`MAX_ROWS` rows (:data:`WHOLE_K_MAX_ROWS` with
    ``whole_k``), in one kernel.

    ``g`` is the identity, or with ``norm_weight`` transformers' RMSNorm of ``x`` (of ``x + residual``
    when ``residual`` is given, that sum being returned too); ``f`` is the identity, or with ``swiglu``
    ``silu(gate) * up`` where ``weight`` stacks the gate rows over the up rows.

    Args:
        x: [rows, hidden], fp16/bf16/fp32, rows <= :data:`MAX_ROWS` (:data:`WHOLE_K_MAX_ROWS` with ``whole_k``),
            contiguous last dimension.
        weight: [out_features, hidden] (``[2 * intermediate, hidden]`` with ``swiglu``), x's dtype,
            contiguous last dimension.
        bias: optional [out_features] (not with ``swiglu``).
        norm_weight: optional [hidden] RMSNorm weight, x's dtype.
        eps: the norm's variance epsilon.
        residual: optional [rows, hidden] added to ``x`` before the norm (needs ``norm_weight``).
        swiglu: gate/up epilogue; the output has ``out_features // 2`` columns.
        out_dtype: output dtype (default x's); the value is rounded to x's dtype first either way, so
            ``torch.float32`` gives the same numbers as ``F.linear(...).float()``.
        block_n, block_k, num_warps, num_stages: tiling overrides (benchmark sweeps); None = :func:`_tiles`.
        pdl: launch with programmatic dependent launch where available (:mod:`.pdl`; ignored elsewhere).
        split_k: programs per output tile, each taking a contiguous share of the ``hidden`` columns (rounded
            up to ``block_k``); their float32 partial sums go to a workspace and the last program to arrive
            adds them in split order and runs the epilogue (serial split-K reduction, as in CUTLASS's
            "serial split-K"). More programs in flight for matmuls of few output tiles; 1 = no split.
        counters: with ``split_k`` > 1, an int32 tensor of at least ``ceil(out_features / block_n)`` zeros
            (one arrival counter per output tile, left at zero again by every launch). Pass a buffer owned by
            the caller and used by one stream at a time; without it a zeroed one is allocated per call.
        preload: load the first weight tile of each program before the PDL wait (default: with ``split_k``
            > 1 and PDL, where it is the whole weight share of the program).
        norm_k: input columns per step of the RMSNorm prologue, a power of two >= 16; None or 0 = ``block_k``
            (default: wider steps, 512 columns at 16 rows, slowed SmolLM2's 16-row matmuls on the H200, see
            :data:`hf_accel.engine.step_switches.FUSED_LINEAR_NORM_K`).
        small_tiles: True = the small-layer tiles of :func:`_tiles` (faster alone, slower inside the decode
            step: see there).
        whole_k: no K loop: each program loads its weight rows over all of ``hidden`` (two power-of-two
            column chunks, :func:`whole_k_chunks`) before the PDL wait and the input rows once after it, so
            only one memory round trip follows the wait (the one-row :func:`~.gemv.gemv` works the same way).
            ``hidden`` <= :data:`WHOLE_K_MAX` and what :func:`whole_k_fits` allows on a GPU (fp16/bf16; float32
            while its tiles fit shared memory); ``block_n`` default 32; rows in blocks of :data:`WHOLE_K_BLOCK_M`
            (one program per block and output tile); not with ``split_k`` > 1; ``block_k``, ``num_stages``,
            ``preload``, ``norm_k`` and ``small_tiles`` do not apply.

    Returns:
        ``y`` [rows, out_features (// 2 with swiglu)], or ``(y, x + residual)`` when ``residual`` is given.

    Raises:
        ValueError: more rows than :func:`max_rows` allows, shape/dtype mismatches, a combination the kernel does
            not take (``residual`` without ``norm_weight``, ``bias`` with ``swiglu``), ``split_k`` not an int
            >= 1, ``num_warps`` not a power of two <= 16, ``counters`` that are not a contiguous int32 tensor of
            enough elements on x's device, or ``whole_k`` where :func:`whole_k_fits` is False; bfloat16 CPU
            tensors under Triton's interpreter (:func:`~hf_accel.kernels.device.check_interpreter_dot`).
    """
    rows, k, out_features = check_linear_args(x, weight, bias, norm_weight, residual, swiglu)
    if rows > max_rows(whole_k):
        raise ValueError(f"fused_linear takes at most {max_rows(whole_k)} rows{' with whole_k' if whole_k else ''}, "
                         f"got {rows}")
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1:
        raise ValueError(f"split_k must be an int >= 1, got {split_k!r}")
    check_tiling(num_warps, block_n, block_k, eps)
    y = torch.empty(rows, out_features, dtype=out_dtype or x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else y
    if rows == 0:
        return (y, r_out) if residual is not None else y
    given_n, given_warps = block_n, num_warps
    block_m, block_n, block_k, num_warps, num_stages = _tiles(rows, out_features, k, norm_weight is not None, swiglu,
                                                              block_n, block_k, num_warps, num_stages, small_tiles)
    block_k2 = 0
    m_blocks = 1
    if whole_k:
        if split_k != 1:
            raise ValueError("whole_k does not take split_k > 1")
        block_m, m_blocks, block_n, block_k, block_k2, num_warps, num_stages = _whole_k_tiles(rows, k, given_n,
                                                                                              given_warps, x,
                                                                                              2 if swiglu else 1)
    r_in = residual if residual is not None else x
    norm_k = norm_prologue_step(norm_k, block_k)
    pdl = use_pdl(pdl, x)
    n_tiles = triton.cdiv(out_features, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty splits
    part = y
    if split_k > 1:
        if counters is None:
            counters = torch.zeros(n_tiles, dtype=torch.int32, device=x.device)
        else:
            check_counters(counters, n_tiles, x.device)
        part = torch.empty((2 if swiglu else 1) * split_k * block_m * out_features, dtype=torch.float32,
                           device=x.device)
    else:
        counters = y
    if preload is None:
        preload = split_k > 1 and pdl
    grid = (n_tiles, split_k, m_blocks)
    check_launch_device(x, "fused_linear")
    check_interpreter_dot(x, "fused_linear")
    _fused_linear_kernel[grid](
        x, r_in, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x, y, r_out,
        part, counters,
        x, x, x, x, x,
        rows, out_features, k, out_features if swiglu else 0, k_per_split,
        x.stride(0), r_in.stride(0), weight.stride(0), y.stride(0), r_out.stride(0), 0,
        eps,
        0, 0, 1, 1, 0, 0, 0,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=swiglu, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0 and k_per_split % block_k == 0,
        IEEE_DOT=x.dtype == torch.float32, PDL=pdl, SPLIT_K=split_k, PRELOAD=bool(preload), NORM_K=norm_k, ROPE=False,
        WHOLE_K=bool(whole_k), BLOCK_K2=block_k2,
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return (y, r_out) if residual is not None else y


def fused_linear_ref(x, weight, *, bias=None, norm_weight=None, eps=1e-6, residual=None, swiglu=False,
                     out_dtype=None):
    """PyTorch reference of :func:`fused_linear`: transformers' RMSNorm (:func:`~.rms_norm.rms_norm_ref`),
    ``F.linear`` and SiLU * up (:func:`~.swiglu.swiglu_ref`)."""
    r_out = None
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps, residual)
        if residual is not None:
            x, r_out = x
    y = torch.nn.functional.linear(x, weight, bias)
    if swiglu:
        y = swiglu_ref(*y.chunk(2, dim=-1))
    if out_dtype is not None:
        y = y.to(out_dtype)
    return (y, r_out) if residual is not None else y


def fused_linear_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    pdl: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    norm_k: int | None = None,
    small_tiles: bool = False,
    preload: bool = False,
    whole_k: bool = False,
    check_slots: bool = True,
):
    """The merged Q/K/V projection of a few token rows with RoPE and the cache write as its epilogue:
    :func:`fused_linear` followed by :func:`~.rope_cache.rope_and_cache` (no per-head q/k norm) in one
    kernel, the same roundings (one kernel less per layer in verify passes and small-batch steps).

    Each program takes ``block_n`` lanes of one head's first half and their partners ``head_dim / 2`` rows
    on, for every row: the pairs RoPE rotates together ("rotate_half" layout; RoFormer, Su et al. 2021,
    §3.4.2), as two products of the same input tile (the SwiGLU layout of gate and up).

    Args:
        x: [rows, hidden], rows <= :func:`max_rows` (``whole_k``); weight: [(num_heads + 2 * num_kv_heads) * head_dim,
            hidden], q rows, then k, then v; bias: optional [same rows]; norm_weight, eps, residual: as
            :func:`fused_linear`.
        cos, sin: [rows, head_dim], the rotary tables at each row's position (transformers' layout), x's
            dtype, contiguous last dimension.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], x's dtype, same strides,
            contiguous last dimension.
        slot_mapping: [rows] int32 — ``block * block_size + offset`` of each row's token; -1 = not written.
        num_heads: query heads.
        pdl, block_n, block_k, num_warps, num_stages, norm_k, small_tiles, preload, whole_k: as
            :func:`fused_linear` (``preload`` default False); ``block_n`` (default the largest of 32 and 16 that
            divides it) must divide ``head_dim / 2``.
        check_slots: check that every slot lies in the pools or is -1
            (:func:`~.reshape_and_cache.check_slot_range`: one device-to-host read, skipped while a CUDA graph is
            captured); the decode step passes False for the slots it made from its own block tables.

    Returns:
        rotated q [rows, num_heads * head_dim], or ``(q, x + residual)`` when ``residual`` is given.

    Raises:
        ValueError: as :func:`fused_linear`, and for weight rows that are not (num_heads + 2 * num_kv_heads) x
            head_dim, a ``head_dim / 2`` that no ``block_n`` >= 16 divides, or cos/sin/cache/slot shapes,
            dtypes or strides that differ; (``check_slots``) a slot below -1 or past the pools.
    """
    rows, k, out_features = check_linear_args(x, weight, bias, norm_weight, residual, False)
    if rows > max_rows(whole_k):
        raise ValueError(f"fused_linear_rope takes at most {max_rows(whole_k)} rows"
                         f"{' with whole_k' if whole_k else ''}, got {rows}")
    if block_n is None:
        half = key_cache.shape[3] // 2 if key_cache.dim() == 4 else 0
        block_n = 32 if half % 32 == 0 else 16
    check_tiling(num_warps, block_n, block_k, eps)
    num_kv_heads, head_dim = check_rope_args(x, weight, key_cache, value_cache, cos, sin, slot_mapping, num_heads,
                                             block_n, check_slots)
    half = head_dim // 2
    given_warps = num_warps
    # two products per program, as gate/up: the gate/up tiles (block_n given here)
    block_m, _, block_k, num_warps, num_stages = _tiles(rows, out_features, k, norm_weight is not None, True,
                                                        block_n, block_k, num_warps, num_stages, small_tiles)
    block_k2, m_blocks = 0, 1
    if whole_k:
        block_m, m_blocks, _, block_k, block_k2, num_warps, num_stages = _whole_k_tiles(rows, k, block_n,
                                                                                        given_warps, x, 2)
    norm_k = norm_prologue_step(norm_k, block_k)
    q = torch.empty(rows, num_heads * head_dim, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else q
    if rows == 0:
        return (q, r_out) if residual is not None else q
    r_in = residual if residual is not None else x
    pdl = use_pdl(pdl, x)
    grid = ((num_heads + 2 * num_kv_heads) * (half // block_n), 1, m_blocks)
    check_launch_device(x, "fused_linear_rope", "fused_linear_ref (then RoPE and the cache write)")
    check_interpreter_dot(x, "fused_linear_rope", "fused_linear_ref (then RoPE and the cache write)")
    _fused_linear_kernel[grid](
        x, r_in, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x, q, r_out,
        q, q,
        cos, sin, key_cache, value_cache, slot_mapping,
        rows, out_features, k, half, k,
        x.stride(0), r_in.stride(0), weight.stride(0), q.stride(0), r_out.stride(0), cos.stride(0),
        eps,
        num_heads, num_kv_heads, head_dim, key_cache.shape[1], key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2),
        NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=False, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        IEEE_DOT=x.dtype == torch.float32, PDL=pdl, SPLIT_K=1, PRELOAD=bool(preload), NORM_K=norm_k, ROPE=True,
        WHOLE_K=bool(whole_k), BLOCK_K2=block_k2,
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return (q, r_out) if residual is not None else q
