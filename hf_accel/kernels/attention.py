"""Causal / non-causal attention over a contiguous KV cache: Triton kernel, launcher and reference.

The kernel is FlashAttention-2 style (Dao 2023, "FlashAttention-2", Algorithm 1): Q is tiled in
``BLOCK_M`` rows, K/V are streamed in ``BLOCK_N`` blocks, the softmax is computed online with a running
max and sum in fp32 (scale folded with log2(e), ``exp2``) and normalised once at the end
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax").

GQA/MQA (Ainslie et al. 2023) is handled inside the kernel without copying K/V: one program owns one
KV head and packs the ``q_len * group`` query rows of that head's group into its M dimension
(row ``r`` -> query position ``r // group``, query head ``kv_head * group + r % group``), so every K/V
block is loaded once per group. For decode (``q_len == 1``) this fills the tile with the group's heads.

Masking: an optional per-key validity mask ``key_mask`` [batch, kv_len] (padding; any pattern, not only
left padding) and a causal mask aligned bottom-right, i.e. query ``i`` sees key ``j`` iff
``j <= i + (kv_len - q_len)``. Causal blocks entirely above the diagonal are not visited. A query row
with no visible key returns 0 (never NaN).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_launch_device, check_interpreter_dot

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

# log2(e): softmax(x) = 2^(x*log2e - max) / sum, computed with exp2.
_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    """``tl.dot`` in IEEE fp32 when ``IEEE_DOT`` (fp32 inputs), else Triton's default precision."""
    if IEEE_DOT:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _tile_probs(q, k, offs_n, n_valid, row_valid, q_pos, causal_shift, KeyMask, b64, stride_mb, stride_mn,
                m_i, l_i, acc, sm_scale_log2,
                IS_CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, IEEE_DOT: tl.constexpr):
    """Online-softmax step of one K tile (FlashAttention-2, Algorithm 1, lines 8-10): scores ``q @ k``
    (``k``: [BLOCK_D, BLOCK_N]) in the log2 domain, masked (key validity, bottom-right causal, key mask),
    the new running max, the tile's probabilities ``p`` [BLOCK_M, BLOCK_N] fp32, the running sum and the
    rescaled accumulator. The caller adds ``p @ v``. Rows that have seen no valid key keep m = -inf (0 is
    used as the shift so exp2 stays finite)."""
    s = _dot(q, k, IEEE_DOT) * sm_scale_log2
    allowed = n_valid[None, :] & row_valid[:, None]
    if IS_CAUSAL:
        allowed = allowed & (offs_n[None, :] <= (q_pos[:, None] + causal_shift))
    if HAS_KEY_MASK:
        km = tl.load(KeyMask + b64 * stride_mb + offs_n * stride_mn, mask=n_valid, other=0)
        allowed = allowed & (km[None, :] != 0)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


@triton.jit
def _attention_fwd_kernel(
    Q, K, V, Out, KeyMask,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_mb, stride_mn,
    q_len, kv_len, head_dim, num_kv_heads,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads

    # Packed rows: r -> (query position, query head within the group).
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_valid = q_pos < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim

    b64 = b.to(tl.int64)
    q_ptrs = (Q + b64 * stride_qb + q_head[:, None].to(tl.int64) * stride_qh
              + q_pos[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    k_base = K + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    causal_shift = kv_len - q_len
    if IS_CAUSAL:
        # Last key any row of this tile may see (+1), clipped to kv_len: later blocks are skipped.
        last_pos = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        kv_end = tl.minimum(kv_len, last_pos + causal_shift + 1)
    else:
        kv_end = kv_len

    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_len
        k = tl.load(k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None] * stride_kd,
                    mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        p, m_new, l_i, acc = _tile_probs(q, k, offs_n, n_valid, row_valid, q_pos, causal_shift, KeyMask, b64,
                                         stride_mb, stride_mn, m_i, l_i, acc, sm_scale_log2,
                                         IS_CAUSAL, HAS_KEY_MASK, IEEE_DOT)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        acc += _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new

    # Fully-masked rows: l == 0 -> output 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = (Out + b64 * stride_ob + q_head[:, None].to(tl.int64) * stride_oh
              + q_pos[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def _check_inputs(query, key, value, key_mask):
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"attention expects 4-D query/key/value [batch, heads, len, head_dim]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    batch, num_heads, q_len, head_dim = query.shape
    kb, num_kv_heads, kv_len, kd = key.shape
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if kb != batch or kd != head_dim:
        raise ValueError(
            f"key shape {tuple(key.shape)} does not match query shape {tuple(query.shape)} "
            "(batch and head_dim must agree)"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if key_mask is not None:
        if key_mask.dim() != 2 or tuple(key_mask.shape) != (batch, kv_len):
            raise ValueError(
                f"key_mask must have shape [batch, kv_len] = {(batch, kv_len)}; got {tuple(key_mask.shape)}"
            )
    return batch, num_heads, num_kv_heads, q_len, kv_len, head_dim


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with GQA, bottom-right causal mask and key padding, in Triton.

    Args:
        query: [batch, num_heads, q_len, head_dim], fp16/bf16/fp32, any strides.
        key: [batch, num_kv_heads, kv_len, head_dim], same dtype; ``num_heads % num_kv_heads == 0``.
        value: [batch, num_kv_heads, kv_len, head_dim], same dtype.
        key_mask: optional [batch, kv_len], bool or integer; nonzero = key is visible (e.g. the 2-D
            attention mask of left-padded prompts). Any pattern is allowed.
        causal: if True, query ``i`` sees key ``j`` iff ``j <= i + kv_len - q_len`` (bottom-right
            aligned, as in chunked prefill and decode with a cache).
        sm_scale: softmax scale; default ``1 / sqrt(head_dim)``.
        out: optional [batch, q_len, num_heads, head_dim] output buffer of the query's dtype.

    Returns:
        [batch, q_len, num_heads, head_dim] tensor, query's dtype (the layout transformers expects
        after attention). Rows with no visible key are 0.

    Raises:
        ValueError: on shape/dtype mismatches, head_dim > 256, or a num_heads that is not a
            multiple of num_kv_heads; bfloat16 CPU tensors under Triton's interpreter
            (:func:`~hf_accel.kernels.device.check_interpreter_dot`).

    Algorithm: FlashAttention-2 (Dao 2023), see the module docstring.
    """
    batch, num_heads, num_kv_heads, q_len, kv_len, head_dim = _check_inputs(query, key, value, key_mask)
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {query.dtype}; supported: {SUPPORTED_DTYPES}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported (1..{MAX_HEAD_DIM})")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(batch, q_len, num_heads, head_dim, dtype=query.dtype, device=query.device)
    elif out.shape != (batch, q_len, num_heads, head_dim) or out.dtype != query.dtype:
        raise ValueError(f"out must be [batch, q_len, num_heads, head_dim] {query.dtype}; got {tuple(out.shape)}")
    if batch == 0 or q_len == 0:
        return out
    out_v = out.transpose(1, 2)  # [batch, heads, q_len, head_dim] view

    if key_mask is not None and key_mask.dtype == torch.bool:
        key_mask = key_mask.view(torch.uint8) if key_mask.is_contiguous() else key_mask.to(torch.uint8)
    mask_arg = key_mask if key_mask is not None else query  # dummy pointer when HAS_KEY_MASK is False
    stride_mb, stride_mn = (key_mask.stride(0), key_mask.stride(1)) if key_mask is not None else (0, 0)

    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = q_len * group
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    if block_d >= 256:
        block_m = min(block_m, 32)
    block_n = 32 if block_d >= 128 else 64
    grid = (triton.cdiv(rows, block_m), batch * num_kv_heads)
    check_launch_device(query, "attention")
    check_interpreter_dot(query, "attention")
    _attention_fwd_kernel[grid](
        query, key, value, out_v, mask_arg,
        sm_scale * _LOG2E,
        *query.stride(), *key.stride(), *value.stride(), *out_v.stride(),
        stride_mb, stride_mn,
        q_len, kv_len, head_dim, num_kv_heads,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IS_CAUSAL=bool(causal) and q_len > 0,
        HAS_KEY_MASK=key_mask is not None,
        IEEE_DOT=query.dtype == torch.float32,
        num_warps=4 if block_m <= 32 else 8, num_stages=2,
    )
    return out


def allowed_mask(batch: int, q_len: int, kv_len: int, key_mask: torch.Tensor | None, causal: bool,
                 device) -> torch.Tensor:
    """[batch, 1, q_len, kv_len] bool, True where query ``i`` may see key ``j``: the kernel's masking
    (bottom-right causal ``j <= i + kv_len - q_len`` and ``key_mask`` [batch, kv_len]) made dense."""
    if causal:
        i = torch.arange(q_len, device=device)[:, None]
        j = torch.arange(kv_len, device=device)[None, :]
        allowed = j <= i + (kv_len - q_len)
    else:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    allowed = allowed.expand(batch, 1, q_len, kv_len)
    if key_mask is not None:
        allowed = allowed & key_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return allowed


def attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-PyTorch reference of :func:`attention` (same arguments, same output layout).

    Computes in ``compute_dtype`` (default: the input dtype, upcast to fp32 for fp16/bf16 and kept
    for fp32/fp64), groups query heads by KV head with a view (no copy of K/V), and returns
    [batch, q_len, num_heads, head_dim] in the query's dtype; fully-masked rows are 0.
    Used as the runtime path on machines without a GPU and as the test oracle (in float64).
    """
    batch, num_heads, num_kv_heads, q_len, kv_len, head_dim = _check_inputs(query, key, value, key_mask)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if compute_dtype is None:
        compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    group = num_heads // num_kv_heads
    q = query.to(compute_dtype).reshape(batch, num_kv_heads, group, q_len, head_dim)
    k = key.to(compute_dtype).unsqueeze(2)  # [b, kvh, 1, kv_len, d]
    v = value.to(compute_dtype).unsqueeze(2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * sm_scale  # [b, kvh, g, q_len, kv_len]
    allowed = allowed_mask(batch, q_len, kv_len, key_mask, causal, query.device)[:, :, None]  # [b,1,1,q,kv]
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_visible = allowed.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~any_visible, 0.0), dim=-1)
    probs = probs.masked_fill(~allowed, 0.0)
    out = torch.matmul(probs, v)  # [b, kvh, g, q_len, d]
    out = out.reshape(batch, num_heads, q_len, head_dim).transpose(1, 2)
    return out.to(query.dtype).contiguous()


def attention_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The same op as :func:`attention` computed with PyTorch's ``scaled_dot_product_attention``
    (``enable_gqa``, no K/V copy): the runtime path on machines without a GPU, where it is much faster
    than :func:`attention_ref` on long prompts (no [q_len, kv_len] fp32 score tensor per head).

    Same arguments and output as :func:`attention`; rows with no visible key are 0.
    """
    batch, num_heads, num_kv_heads, q_len, kv_len, head_dim = _check_inputs(query, key, value, key_mask)
    F = torch.nn.functional
    if key_mask is None and (not causal or q_len == kv_len or q_len == 1):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal and q_len > 1, scale=sm_scale,
                                             enable_gqa=num_heads != num_kv_heads)
        return out.transpose(1, 2).contiguous()
    return sdpa_allowed(query, key, value, allowed_mask(batch, q_len, kv_len, key_mask, causal, query.device),
                        sm_scale)


def sdpa_allowed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                 sm_scale: float | None) -> torch.Tensor:
    """``scaled_dot_product_attention`` of query [batch, num_heads, q_len, head_dim] over key/value
    [batch, num_kv_heads, kv_len, head_dim] where ``allowed`` [batch, 1, q_len, kv_len] bool is True;
    rows with no allowed key are 0 (SDPA alone would give NaN). Returns [batch, q_len, num_heads, head_dim]."""
    visible = allowed.any(-1, keepdim=True)  # [batch, 1, q_len, 1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed | ~visible,
                                                           scale=sm_scale,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.masked_fill(~visible, 0.0).transpose(1, 2).contiguous()
