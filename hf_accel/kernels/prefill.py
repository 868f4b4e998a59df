"""Prefill (prompt) attention: a FlashAttention-2 forward kernel tuned for Hopper and its launchers (launch
configurations and the tuner: :mod:`~hf_accel.kernels.prefill_tuning`; the PyTorch reference:
:mod:`~hf_accel.kernels.prefill_reference`, both re-exported here; the Triton kernel itself:
:mod:`~hf_accel.kernels.prefill_kernel`).

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

from hf_accel.kernels.device import capturing, check_launch_device, check_interpreter_dot
from hf_accel.kernels.prefill_kernel import _prefill_fwd_kernel
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
    if varlen:
        check_launch_device(q4, "prefill_attention_varlen",
                            "hf_accel.kernels.prefill_reference.prefill_attention_varlen_ref")
    else:
        check_launch_device(q4, "prefill_attention", "hf_accel.kernels.prefill_reference.prefill_attention_ref")
    check_interpreter_dot(q4, "prefill_attention")
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
            a multiple of num_kv_heads, a mask or offsets of the wrong shape, ``sm_scale`` <= 0; bfloat16 CPU
            tensors under Triton's interpreter (:func:`~hf_accel.kernels.device.check_interpreter_dot`).

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
            longer than ``max_seqlen_q``; ``sm_scale`` <= 0; bfloat16 CPU tensors under Triton's interpreter.
            (The offsets are read on the host, one small copy, except while a CUDA graph is being captured: there
            they are the caller's to get right.)
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
