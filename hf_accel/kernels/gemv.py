"""Matrix-vector product for one decode token (``y = W x``), with RMSNorm (+ residual add) as a prologue
and SwiGLU as an epilogue, built to overlap with the kernels around it.

At batch 1 a decoder layer's projections are weight streams: the time of each is its weight bytes over
the memory bandwidth plus a fixed cost (launch, ramp-up until enough loads are in flight, the tail of the
last programs). On a Llama-3-8B-shaped layer the fixed cost is as large as the stream itself for the
small projections (cuBLAS: q/k/v 2.26 TB/s, o 1.77 TB/s of the 4.27 TB/s copy ceiling). This kernel
removes what it can of it:

* many small programs (``BLOCK_N`` rows of ``W`` each, the whole ``K``), so every SM gets the same share
  of rows in one wave;
* no tensor cores: one row of ``x``, multiplied element-wise into a ``[BLOCK_N, BLOCK_K]`` float32
  accumulator that is reduced once at the end;
* *programmatic dependent launch* (Hopper, ``pdl=True``): the kernel asks the next kernel in the stream
  to be launched at its start (``griddepcontrol.launch_dependents``), then loads its first weight tile
  (weights are never written by the kernel before it) and only then waits for the previous kernel to
  finish (``griddepcontrol.wait``) before it reads ``x`` or writes anything. The next projection's
  launch and first loads thus overlap this one's tail (:mod:`.pdl`);
* the RMSNorm prologue reads the whole input row in one step (``norm_k``): walking it in K tiles cost one L2
  round trip per tile before the first weight tile could be used (~2 µs per normed projection of the
  Llama-3-8B shape, ``benchmarks/results/bench_gemv-norm-cost-20261201-4ca6f2d.json``). With ``single_pass``
  (the decode step's default, ``GEMV_SINGLE_PASS``; off for a direct call) rows up to 2048 wide are one weight
  tile, and where the preloaded weight columns cover the whole row, that one read also gives the normalised
  values, and weights of up to 1024 columns are converted to float32 before the PDL wait. SmolLM2's captured
  one-row step took 0.437-0.441 against 0.488-0.496 ms without it on an H100
  (``benchmarks/results/profile_step_splits-single-pass-ab-*-h100-20261206-9002324.json``).

Rounding follows transformers' modules step by step (residual sum, normalised value, norm-weight product,
projection output and SiLU rounded to the model dtype), as :mod:`.fused_linear` does; only the order of the
float32 accumulation differs from cuBLAS.

RMSNorm: Zhang & Sennrich 2019. SwiGLU: Shazeer 2020, "GLU Variants Improve Transformer".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_launch_device, kernels_interpreted

from hf_accel.kernels.linear_args import check_linear_args, check_rope_args
from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl


@triton.jit
def _summed_input(X, R, ROut, offs, ok, store, dt, RESIDUAL: tl.constexpr):
    """The input row's columns ``offs`` after the residual add (rounded to the input dtype), written to ``ROut``
    where ``store`` (one program does)."""
    x = tl.load(X + offs, mask=ok, other=0.0)
    if RESIDUAL:
        r = tl.load(R + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        if store:
            tl.store(ROut + offs, x, mask=ok)
    return x


@triton.jit
def _x_tile(X, R, NormW, offs_k, k_ok, rstd, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """The input row's elements ``offs_k`` as float32, after the residual add and RMSNorm (each rounded to
    the input dtype as transformers rounds them)."""
    dt = X.dtype.element_ty
    x = tl.load(X + offs_k, mask=k_ok, other=0.0)
    if RESIDUAL:
        r = tl.load(R + offs_k, mask=k_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
    if NORM:
        nw = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = (nw * (x.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
    return x.to(tl.float32)


@triton.jit
def _rope_epilogue(y_lo, y_hi, Y, Cos, Sin, KCache, VCache, SlotMapping, head, lane, dt,
                   num_heads, num_kv_heads, head_dim, block_size, stride_kcb, stride_kcs, stride_kch,
                   BLOCK_N: tl.constexpr):
    """Q/K/V projection rows ``lane`` and ``lane + head_dim / 2`` of flat head ``head`` (q heads, then k,
    then v): RoPE on q and k rounded as :mod:`.rope_cache` rounds it, q to ``Y``, k and v to the cache
    slot ``SlotMapping[0]`` (-1: not written)."""
    half = head_dim // 2
    lo = y_lo.to(dt)
    hi = y_hi.to(dt)
    is_v = head >= num_heads + num_kv_heads
    if not is_v:
        cos_lo = tl.load(Cos + lane).to(tl.float32)
        sin_lo = tl.load(Sin + lane).to(tl.float32)
        cos_hi = tl.load(Cos + lane + half).to(tl.float32)
        sin_hi = tl.load(Sin + lane + half).to(tl.float32)
        lo_f, hi_f = lo.to(tl.float32), hi.to(tl.float32)
        new_lo = ((lo_f * cos_lo).to(dt).to(tl.float32) + ((-hi_f) * sin_lo).to(dt).to(tl.float32)).to(dt)
        new_hi = ((hi_f * cos_hi).to(dt).to(tl.float32) + (lo_f * sin_hi).to(dt).to(tl.float32)).to(dt)
        lo, hi = new_lo, new_hi
    if head < num_heads:
        tl.store(Y + head * head_dim + lane, lo.to(Y.dtype.element_ty))
        tl.store(Y + head * head_dim + lane + half, hi.to(Y.dtype.element_ty))
    else:
        slot = tl.load(SlotMapping).to(tl.int64)
        if slot >= 0:
            kv_head = (head - num_heads) % num_kv_heads
            dst = (slot // block_size) * stride_kcb + (slot % block_size) * stride_kcs + kv_head * stride_kch
            if is_v:
                tl.store(VCache + dst + lane, lo.to(VCache.dtype.element_ty))
                tl.store(VCache + dst + lane + half, hi.to(VCache.dtype.element_ty))
            else:
                tl.store(KCache + dst + lane, lo.to(KCache.dtype.element_ty))
                tl.store(KCache + dst + lane + half, hi.to(KCache.dtype.element_ty))


@triton.jit
def _gemv_kernel(
    X, R, NormW, W, Bias, Y, ROut,
    Cos, Sin, KCache, VCache, SlotMapping,
    N, K, up_offset, stride_wn,
    eps,
    num_heads, num_kv_heads, head_dim, block_size, stride_kcb, stride_kcs, stride_kch,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROPE: tl.constexpr,
    PRELOAD: tl.constexpr,
    NORM_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    pid = tl.program_id(0)
    dt = X.dtype.element_ty
    if ROPE:
        # BLOCK_N lanes of one head's first half and their partners ``up_offset`` (= head_dim / 2) rows on
        lanes_per_head = up_offset // BLOCK_N
        head = pid // lanes_per_head
        lane = (pid % lanes_per_head) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = head * head_dim + lane
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
    # The first PRELOAD weight tiles (one [BLOCK_N, PRELOAD * BLOCK_K] tile) before waiting: the previous
    # kernel does not write weights.
    offs_pre = tl.arange(0, PRELOAD * BLOCK_K)
    pre_ok = offs_pre < K
    w = tl.load(w_rows + offs_pre[None, :], mask=n_ok[:, None] & pre_ok[None, :], other=0.0)
    if SWIGLU or ROPE:
        wu = tl.load(w_rows + up_offset * stride_wn + offs_pre[None, :], mask=n_ok[:, None] & pre_ok[None, :],
                     other=0.0)
    if SINGLE_PASS:
        if PRELOAD * BLOCK_K <= 1024:
            # the whole row of weights is loaded: convert it while the previous kernel still runs (wider rows
            # stay in the input dtype until used: 64+ float32 registers per thread per weight tile)
            w = w.to(tl.float32)
            if SWIGLU or ROPE:
                wu = wu.to(tl.float32)
        nw = tl.load(NormW + offs_pre, mask=pre_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()  # x, the residual and every output may belong to the previous kernel

    rstd = 0.0
    if SINGLE_PASS:
        # the preloaded columns cover the whole row: one read of x (and the residual) gives the sum of squares
        # and the normalised values (else the row is read for the norm, then again tile by tile)
        xsf = _summed_input(X, R, ROut, offs_pre, pre_ok, pid == 0, dt, RESIDUAL).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xsf * xsf, 0) / K + eps)
        x = (nw * (xsf * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    elif NORM:
        # NORM_K columns per step (the whole row where it fits): the steps' loads wait on one another, so
        # each step costs an L2 round trip before the first weight tile can be used
        offs_nk = tl.arange(0, NORM_K)
        ss = tl.zeros([NORM_K], dtype=tl.float32)
        for k0 in range(0, K, NORM_K):
            o = k0 + offs_nk
            om = o < K
            xf = _summed_input(X, R, ROut, o, om, pid == 0, dt, RESIDUAL).to(tl.float32)
            ss += xf * xf
        rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)

    if not SINGLE_PASS:
        x = _x_tile(X, R, NormW, offs_pre, pre_ok, rstd, NORM, RESIDUAL)
    if PRELOAD == 1:
        acc = w.to(tl.float32) * x[None, :]
        if SWIGLU or ROPE:
            acc_up = wu.to(tl.float32) * x[None, :]
    else:
        # the preloaded columns are reduced on their own; the loop accumulates the rest tile by tile
        y_pre = tl.sum(w.to(tl.float32) * x[None, :], 1)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if SWIGLU or ROPE:
            y_pre_up = tl.sum(wu.to(tl.float32) * x[None, :], 1)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(PRELOAD * BLOCK_K, K, BLOCK_K):
        o = k0 + offs_k
        om = o < K
        wm = n_ok[:, None] & om[None, :]
        wt = tl.load(w_rows + o[None, :], mask=wm, other=0.0)
        if SWIGLU or ROPE:
            wut = tl.load(w_rows + up_offset * stride_wn + o[None, :], mask=wm, other=0.0)
        xt = _x_tile(X, R, NormW, o, om, rstd, NORM, RESIDUAL)
        acc += wt.to(tl.float32) * xt[None, :]
        if SWIGLU or ROPE:
            acc_up += wut.to(tl.float32) * xt[None, :]

    y = tl.sum(acc, 1)
    if PRELOAD > 1:
        y += y_pre
    if ROPE:
        y_hi = tl.sum(acc_up, 1)
        if PRELOAD > 1:
            y_hi += y_pre_up
        if HAS_BIAS:
            y += tl.load(Bias + offs_n).to(tl.float32)
            y_hi += tl.load(Bias + offs_n + up_offset).to(tl.float32)
        _rope_epilogue(y, y_hi, Y, Cos, Sin, KCache, VCache, SlotMapping, head, lane, dt, num_heads, num_kv_heads,
                       head_dim, block_size, stride_kcb, stride_kcs, stride_kch, BLOCK_N)
    else:
        if HAS_BIAS:
            y += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        out = y.to(dt)
        if SWIGLU:
            g = out.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt)
            up = tl.sum(acc_up, 1)
            if PRELOAD > 1:
                up += y_pre_up
            out = (s.to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=n_ok)


def default_tiles(out_features: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for an ``[out_features, k]`` weight: 4 rows x 1024 columns (2048 for
    inputs >= 8192 wide or >= 65536 outputs, e.g. down_proj and LM heads), 4 warps. With ``single_pass`` of
    :func:`gemv`, rows up to 2048 wide are taken whole instead (padded to a power of two), so that a small
    model's projections load all their weights before the PDL wait.

    H200, bf16, with PDL (``bench_gemv-sweep-20261201-435ee97.json``): all matmuls of a Llama-3-8B-shaped
    token 3.734 ms (4.02 TB/s) against 3.862 / 3.900 / 3.930 / 4.094 ms with n2k1024w4 / n4k2048w4 /
    n4k1024w2 / n8k512w4 (cuBLAS with its norm and SwiGLU kernels: 4.320 ms). Per shape it is the best or
    within 3% of it, except down (3.82 vs 3.86 TB/s at n4k2048) and the LM head (4.33 vs 4.45)."""
    block_k = 2048 if (k >= 8192 or out_features >= 65536) else min(1024, max(16, triton.next_power_of_2(k)))
    return 4, block_k, 4


#: Most values of one program's weight tiles (``block_n x block_k``) that :func:`interpreter_rows` gives, so that
#: up to 8 preloaded tiles stay within the kernel's 65536.
INTERPRETER_TILE_VALUES = 8192


def interpreter_rows(rows: int, block_k: int, divide: bool = False) -> int:
    """Rows per program (``BLOCK_N``) under Triton's interpreter (CPU tensors), which runs the programs one
    after another at a Python cost per operation whatever the tile's size, so the fewest programs are the
    fastest: the next power of two of ``rows`` (with ``divide``: the largest power of two dividing ``rows``),
    at most 256 and at most ``INTERPRETER_TILE_VALUES // block_k``, at least 1 (2 with ``divide``, as on the
    GPU). Each output row's sum is the same whatever ``BLOCK_N`` is: only the rows per program change. The
    launchers check tile arguments against the GPU's rows first, so both accept the same arguments."""
    cap = max(1, INTERPRETER_TILE_VALUES // block_k)
    if divide:
        return max(2, min(rows & -rows, cap))
    return min(256, max(1, triton.next_power_of_2(rows)), cap)


def _preload_tiles(preload_tiles, k: int, block_n: int, block_k: int) -> int:
    """Validated ``preload_tiles``, halved while the tiles before the last one already cover ``k``."""
    if not isinstance(preload_tiles, int) or isinstance(preload_tiles, bool) or preload_tiles < 1 or \
            preload_tiles & (preload_tiles - 1) or preload_tiles > 8:
        raise ValueError(f"preload_tiles must be a power of two in [1, 8], got {preload_tiles!r}")
    while preload_tiles > 1 and (preload_tiles // 2) * block_k >= k:
        preload_tiles //= 2
    if block_n * block_k * preload_tiles > 1 << 16:
        raise ValueError(f"block_n x block_k x preload_tiles must be at most 65536 values, got "
                         f"{block_n} x {block_k} x {preload_tiles}")
    return preload_tiles


#: Most input columns the RMSNorm prologue of :func:`gemv` reads per step (:func:`_norm_k`).
MAX_NORM_K = 8192


def _norm_k(k: int, block_k: int, norm_k: int | None) -> int:
    """Columns per step of the norm prologue: by default the whole row (padded to a power of two, at most
    :data:`MAX_NORM_K`); ``norm_k`` 0 = ``block_k`` (the row walked in K tiles, as before); else ``norm_k``
    (a power of two in [16, MAX_NORM_K]). Raises ValueError for other values."""
    if norm_k is None:
        return min(MAX_NORM_K, max(16, triton.next_power_of_2(k)))
    if norm_k == 0:
        return block_k
    if not isinstance(norm_k, int) or isinstance(norm_k, bool) or norm_k < 16 or norm_k & (norm_k - 1) \
            or norm_k > MAX_NORM_K:
        raise ValueError(f"norm_k must be 0 or a power of two in [16, {MAX_NORM_K}], got {norm_k!r}")
    return norm_k


def _single_pass(single_pass: bool, norm_weight, k: int, block_k: int, preload_tiles: int,
                 norm_k: int | None) -> bool:
    """Whether the RMSNorm prologue reads the input row once, together with the first weight tiles: asked for, a
    norm, its row within the preloaded columns, and the default ``norm_k`` (``norm_k`` 0 or a step keeps the
    separate prologue)."""
    if not isinstance(single_pass, bool):
        raise ValueError(f"single_pass must be a bool, got {single_pass!r}")
    return single_pass and norm_weight is not None and norm_k is None and preload_tiles * block_k >= k


def _launch_tiles(out_features, k, eps, block_n, block_k, num_warps, whole_row: bool = False) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)``: the overrides given, else :func:`default_tiles`; raises ValueError
    for tiles that are not powers of two in range and for a non-float ``eps``."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise ValueError(f"eps must be a Python float, got {type(eps).__name__}")
    d_n, d_k, d_w = default_tiles(out_features, k)
    if whole_row and k <= 2048:
        d_k = max(16, triton.next_power_of_2(k))
    block_n = d_n if block_n is None else block_n
    block_k = d_k if block_k is None else block_k
    num_warps = d_w if num_warps is None else num_warps
    for name, v, most in (("block_n", block_n, 256), ("block_k", block_k, 8192), ("num_warps", num_warps, 16)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1) or v > most:
            raise ValueError(f"{name} must be a power of two in [1, {most}], got {v!r}")
    if block_n * block_k > 1 << 16:
        raise ValueError(f"block_n x block_k must be at most 65536 values, got {block_n} x {block_k}")
    return block_n, block_k, num_warps


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    preload_tiles: int = 1,
    norm_k: int | None = None,
    single_pass: bool = False,
):
    """``y = f(g(x) @ weight.T + bias)`` for one token row, in one kernel.

    ``g`` is the identity, or with ``norm_weight`` transformers' RMSNorm of ``x`` (of ``x + residual`` when
    ``residual`` is given, that sum being returned too); ``f`` is the identity, or with ``swiglu``
    ``silu(gate) * up`` where ``weight`` stacks the gate rows over the up rows.

    Args:
        x: [1, hidden], fp16/bf16/fp32, contiguous last dimension.
        weight: [out_features, hidden] (``[2 * intermediate, hidden]`` with ``swiglu``), x's dtype,
            contiguous last dimension.
        bias: optional [out_features] (not with ``swiglu``).
        norm_weight: optional [hidden] RMSNorm weight, x's dtype.
        eps: the norm's variance epsilon.
        residual: optional [1, hidden] added to ``x`` before the norm (needs ``norm_weight``).
        swiglu: gate/up epilogue; the output has ``out_features // 2`` columns.
        out_dtype: output dtype (default x's); the value is rounded to x's dtype first either way.
        pdl: launch with programmatic dependent launch (CUDA, compute capability >= 9.0, a triton with
            grid dependency control); ignored elsewhere. Safe next to any kernel: the kernel waits for
            the previous one before it touches anything but ``weight``.
        block_n, block_k, num_warps: tiling overrides (benchmark sweeps): powers of two, block_n <= 256,
            block_k <= 8192, block_n x block_k <= 65536, num_warps <= 16. Default :func:`default_tiles`
            (``block_n`` under Triton's interpreter: :func:`interpreter_rows`).
        preload_tiles: weight tiles (``block_k`` columns each) each program loads before its PDL wait: 1, 2,
            4 or 8 (fewer where fewer cover ``hidden``); block_n x block_k x preload_tiles <= 65536.
        norm_k: input columns the RMSNorm prologue reads per step: default the whole row (padded to a power
            of two, at most :data:`MAX_NORM_K`), so its loads are in flight at once; 0 = ``block_k``.
        single_pass: rows up to 2048 wide as one weight tile (unless ``block_k`` is given), and where the
            preloaded columns cover the whole row, one read of the input row for the norm and the product, with
            weights of up to 1024 columns converted to float32 before the PDL wait (module docstring); results
            within float32 summation order of the default.

    Returns:
        ``y`` [1, out_features (// 2 with swiglu)], or ``(y, x + residual)`` when ``residual`` is given.

    Raises:
        ValueError: ``x`` with more than one row or 0 columns, a dtype other than fp16/bf16/fp32,
            shape/dtype/stride mismatches (a strided ``bias`` or ``norm_weight`` included), invalid tiles or
            ``eps``, or a combination the kernel does not take (``residual`` without ``norm_weight``,
            ``bias`` with ``swiglu``).
    """
    rows, k, out_features = check_linear_args(x, weight, bias, norm_weight, residual, swiglu)
    if rows != 1:
        raise ValueError(f"gemv takes one row, got {rows} (use fused_linear or a matmul)")
    default_rows = block_n is None
    block_n, block_k, num_warps = _launch_tiles(out_features, k, eps, block_n, block_k, num_warps,
                                                whole_row=single_pass is True)
    preload_tiles = _preload_tiles(preload_tiles, k, block_n, block_k)  # checked with the GPU's tiles
    if default_rows and kernels_interpreted():
        block_n = interpreter_rows(out_features, block_k)
    y = torch.empty(1, out_features, dtype=out_dtype or x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else y
    pdl = use_pdl(pdl, x)
    extra = {"launch_pdl": True} if pdl else {}
    grid = (triton.cdiv(out_features, block_n),)
    check_launch_device(x, "gemv", "fused_linear_ref")
    _gemv_kernel[grid](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else x, y, r_out,
        x, x, x, x, x,  # RoPE operands (unused)
        out_features, k, out_features if swiglu else 0, weight.stride(0),
        eps,
        0, 0, 0, 0, 0, 0, 0,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=swiglu, HAS_BIAS=bias is not None,
        PDL=pdl, BLOCK_N=block_n, BLOCK_K=block_k, ROPE=False, PRELOAD=preload_tiles,
        NORM_K=_norm_k(k, block_k, norm_k),
        SINGLE_PASS=_single_pass(single_pass, norm_weight, k, block_k, preload_tiles, norm_k),
        num_warps=num_warps, num_stages=1, **extra,
    )
    return (y, r_out) if residual is not None else y


def gemv_rope(
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
    block_k: int | None = None,
    num_warps: int | None = None,
    preload_tiles: int = 1,
    norm_k: int | None = None,
    single_pass: bool = False,
    check_slots: bool = True,
):
    """The merged Q/K/V projection of one decode token with RoPE and the cache write as its epilogue:
    :func:`gemv` followed by :func:`~.rope_cache.rope_and_cache` (no per-head q/k norm) in one kernel,
    bitwise the same results.

    Each program takes 2 rows of one head's first half (under Triton's interpreter:
    ``interpreter_rows(head_dim / 2, block_k, divide=True)``) and their partners ``head_dim / 2`` rows on (the
    pairs RoPE rotates together, "rotate_half" layout; RoFormer, Su et al. 2021, §3.4.2), so the rotation
    needs no exchange between programs.

    Args:
        x: [1, hidden]; weight: [(num_heads + 2 * num_kv_heads) * head_dim, hidden], q rows, then k, then v;
            bias: optional [same rows]; norm_weight, eps, residual: as :func:`gemv`.
        cos, sin: [1, head_dim], the rotary tables at the token's position (transformers' layout), x's dtype.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], x's dtype, same strides,
            contiguous last dimension.
        slot_mapping: [1] int32 — ``block * block_size + offset`` of the token; -1 = not written.
        num_heads: query heads.
        pdl, block_k, num_warps, preload_tiles, norm_k, single_pass: as :func:`gemv`.
        check_slots: check that the slot lies in the pools or is -1 (:func:`~.reshape_and_cache.check_slot_range`:
            one device-to-host read, skipped while a CUDA graph is captured); the decode step passes False.

    Returns:
        rotated q [1, num_heads * head_dim], or ``(q, x + residual)`` when ``residual`` is given.

    Raises:
        ValueError: as :func:`gemv`, and for weight rows that are not (num_heads + 2 * num_kv_heads) x
            head_dim, an odd head_dim or one whose half is not a multiple of 2, cos/sin/cache/slot shapes,
            dtypes or strides that differ; (``check_slots``) a slot below -1 or past the pools.
    """
    rows, k, out_features = check_linear_args(x, weight, bias, norm_weight, residual, False)
    if rows != 1:
        raise ValueError(f"gemv_rope takes one row, got {rows}")
    block_n = 2
    num_kv_heads, head_dim = check_rope_args(x, weight, key_cache, value_cache, cos, sin, slot_mapping, num_heads,
                                             block_n, check_slots)
    _, block_k, num_warps = _launch_tiles(out_features, k, eps, block_n, block_k, num_warps,
                                          whole_row=single_pass is True)
    preload_tiles = _preload_tiles(preload_tiles, k, block_n, block_k)  # checked with the GPU's tiles
    if kernels_interpreted():  # rows of one head's half per program (they must divide it)
        block_n = interpreter_rows(head_dim // 2, block_k, divide=True)
    q = torch.empty(1, num_heads * head_dim, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else q
    pdl = use_pdl(pdl, x)
    extra = {"launch_pdl": True} if pdl else {}
    grid = ((num_heads + 2 * num_kv_heads) * (head_dim // 2 // block_n),)
    check_launch_device(x, "gemv_rope", "fused_linear_ref (then RoPE and the cache write)")
    _gemv_kernel[grid](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else x, q, r_out,
        cos, sin, key_cache, value_cache, slot_mapping,
        out_features, k, head_dim // 2, weight.stride(0),
        eps,
        num_heads, num_kv_heads, head_dim, key_cache.shape[1], key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2),
        NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=False, HAS_BIAS=bias is not None,
        PDL=pdl, BLOCK_N=block_n, BLOCK_K=block_k, ROPE=True, PRELOAD=preload_tiles,
        NORM_K=_norm_k(k, block_k, norm_k),
        SINGLE_PASS=_single_pass(single_pass, norm_weight, k, block_k, preload_tiles, norm_k),
        num_warps=num_warps, num_stages=1, **extra,
    )
    return (q, r_out) if residual is not None else q
