"""Pure-PyTorch references of the prefill attention kernels (:mod:`hf_accel.kernels.prefill`): same arguments,
layouts, causality (bottom-right aligned) and zero rows, computed with an explicit [q_len, kv_len] mask. For tests
(float64 as the oracle, the input dtype as "PyTorch's own error") and CPU fallbacks only.
"""

from __future__ import annotations

import math

import torch


def prefill_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    kv_start: torch.Tensor | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """Pure-PyTorch reference of :func:`prefill_attention` (same arguments, layouts and zero rows).

    Computes in ``compute_dtype`` (default: fp32 for fp16/bf16 inputs, else the input dtype; the tests
    use float64 as the oracle and the input dtype as "PyTorch's own error"). K/V heads are shared
    through a view (no copy). Builds the [q_len, kv_len] mask: for tests and CPU fallbacks only.
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if compute_dtype is None:
        compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    group = num_heads // num_kv_heads
    dev = query.device
    q = query.to(compute_dtype).reshape(batch, num_kv_heads, group, q_len, head_dim)
    k = key.to(compute_dtype).unsqueeze(2)
    v = value.to(compute_dtype).unsqueeze(2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * sm_scale  # [b, kvh, g, q, k]
    j = torch.arange(kv_len, device=dev)
    allowed = torch.ones(batch, q_len, kv_len, dtype=torch.bool, device=dev)
    if causal:
        i = torch.arange(q_len, device=dev)[:, None]
        allowed = allowed & (j[None, :] <= i + (kv_len - q_len))[None]
    if key_mask is not None:
        allowed = allowed & (key_mask != 0)[:, None, :]
    if kv_start is not None:
        allowed = allowed & (j[None, :] >= kv_start.to(dev).long()[:, None])[:, None, :]
    allowed = allowed[:, None, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_visible = allowed.any(-1, keepdim=True)
    safe = scores.masked_fill(~any_visible, 0.0)
    probs = torch.softmax(safe, dim=-1).masked_fill(~allowed, 0.0)
    out = torch.matmul(probs, v).reshape(batch, num_heads, q_len, head_dim).transpose(1, 2)
    out = out.to(query.dtype).contiguous()
    if not return_lse:
        return out
    lse = torch.logsumexp(scores, dim=-1).reshape(batch, num_heads, q_len).to(torch.float32)
    return out, lse


def prefill_attention_varlen_ref(query, key, value, cu_seqlens_q, cu_seqlens_k, *, causal=True,
                                 sm_scale=None, return_lse=False, compute_dtype=None):
    """Reference of :func:`prefill_attention_varlen`: :func:`prefill_attention_ref` per sequence."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q = query[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        k = key[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        v = value[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        o, lse = prefill_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True,
                                       compute_dtype=compute_dtype)
        outs.append(o[0])
        lses.append(lse[0])
    out = torch.cat(outs, 0)
    return (out, torch.cat(lses, 1)) if return_lse else out
