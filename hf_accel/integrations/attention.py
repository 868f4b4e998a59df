"""hf-accel's attention function and mask function, registered into transformers.

transformers (>= 5) looks attention up by name in ``AttentionInterface`` and builds the mask with the
function of the same name in ``AttentionMaskInterface``. Both are registered here under
:data:`ATTN_NAME`, a name with none of the substrings ("flash", "sdpa", "paged", "|") that make
transformers change behaviour. Selecting it is done per model instance by
:func:`hf_accel.accelerate_model`.

Mask protocol between the two functions: for the plain causal mask whose queries are the last
``q_len`` keys (DynamicCache prefill/decode, no cache), the mask function returns only the 2-D key
padding mask [batch, kv_len] (or ``None`` when nothing is padded), and the attention function applies
causality itself, bottom-right aligned. Anything else (sliding window, packed sequences, static cache,
custom mask functions, bidirectional configs) gets transformers' own 4-D SDPA mask, and the attention
function then falls back to SDPA, logging the reason once. So no case silently loses its mask.
"""

from __future__ import annotations


import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_accel._logging import log_once, logger
from hf_accel.cache.paged_cache import active_step
from hf_accel.kernels.attention import MAX_HEAD_DIM, SUPPORTED_DTYPES, allowed_mask, attention, attention_sdpa
from hf_accel.kernels.paged_attention import paged_attention
from hf_accel.kernels.paged_attention_torch import paged_attention_sdpa
from hf_accel.kernels.prefill import prefill_attention

ATTN_NAME = "hf_accel"


def hf_accel_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """Mask function registered under :data:`ATTN_NAME` (same signature as ``sdpa_mask``).

    Returns ``None`` (causal, nothing padded), a bool key mask [batch, kv_length] (causal with
    padding; the attention function applies causality), or transformers' 4-D bool SDPA mask
    [batch, 1, q_length, kv_length] for every other pattern (which makes attention fall back to SDPA).
    """
    aligned = (
        mask_function is causal_mask_function
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset + q_length == kv_offset + kv_length
    )
    if aligned and attention_mask is None:
        return None
    if aligned and attention_mask.dim() == 2 and attention_mask.shape[1] == kv_offset + kv_length:
        key_mask = attention_mask[:, kv_offset:].to(torch.bool)
        if key_mask.shape[0] != batch_size and key_mask.shape[0] == 1:
            key_mask = key_mask.expand(batch_size, -1)
        if torch.compiler.is_compiling():  # no data-dependent branch in a traced graph: the key mask as it is
            return key_mask
        return None if bool(key_mask.all()) else key_mask
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )


def _fallback_reason(module, query, kv_len, attention_mask, dropout, kwargs) -> str | None:
    if kwargs.get("output_attentions"):
        return "output_attentions=True (the kernel does not materialise attention weights)"
    if module.training or dropout:
        return "training mode / attention dropout"
    if torch.is_grad_enabled() and query.requires_grad:
        return "autograd is recording (the kernel has no backward pass)"
    if torch.is_autocast_enabled(query.device.type):
        return "autocast is on (SDPA casts Q/K/V as autocast asks, as in transformers; the kernels take one dtype)"
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            return f"{name} is set"
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype} (supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)})"
    if query.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {query.shape[-1]} > {MAX_HEAD_DIM}"
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            return "a non-causal or custom mask (4-D mask: static cache, sliding window, packed sequences, ...)"
        if tuple(attention_mask.shape) != (query.shape[0], kv_len):
            return f"key mask shape {tuple(attention_mask.shape)} != [batch, kv_len]"
    return None


# Below this much attention work per call the tuned prefill kernel's extra host launch cost (87 vs 59 us
# measured on the H200 host, docs/prefill.md) outweighs its faster GPU time, and TTFT of small models got
# worse with it (SmolLM2, 4k prompt: 26.3 vs 22.6 ms); ~40 GFLOP is ~100 us of GPU time at the kernel's
# measured 400-500 TFLOP/s. The threshold itself is a reasoned choice, not yet measured end to end.
PREFILL_KERNEL_MIN_FLOPS = 40e9


def _prefill_flops(query, key, causal) -> float:
    batch, heads, q_len, head_dim = query.shape
    flops = 4.0 * batch * heads * q_len * key.shape[2] * head_dim
    return flops * 0.5 if causal else flops


def _dense_bool_mask(query, kv_len, attention_mask, causal) -> torch.Tensor:
    """[batch, 1, q_len, kv_len] bool mask (True = attend) equivalent to what the kernel applies."""
    if attention_mask is not None and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return attention_mask
        return attention_mask == 0  # additive float mask: 0 = attend
    return allowed_mask(query.shape[0], query.shape[2], kv_len, attention_mask, causal, query.device)


def hf_accel_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """Attention function registered under :data:`ATTN_NAME` (transformers' attention signature).

    Args:
        query: [batch, num_heads, q_len, head_dim]; key/value: [batch, num_kv_heads, kv_len, head_dim]
            as returned by a contiguous cache, or the block pools of a :class:`~hf_accel.cache.PagedCache`
            step (then the paged kernel reads them through the step's block table); fp16/bf16/fp32.
        attention_mask: ``None``, a bool key mask [batch, kv_len] from :func:`hf_accel_mask`, or a
            4-D mask (-> SDPA fallback).
        dropout: attention dropout probability; above 0 (training) the call falls back to SDPA.
        scaling: ``sm_scale`` applied to Q·Kᵀ; None: ``head_dim ** -0.5``.
        is_causal: causal masking among the query tokens; None: the module's ``is_causal`` (True by default).

    Returns:
        (attn_output [batch, q_len, num_heads, head_dim], None). On CUDA tensors the Triton kernel
        :func:`hf_accel.kernels.attention.attention` runs; on other devices, and while ``torch.compile`` traces
        the forward (its compiler takes PyTorch ops; the kernels' launch code is not traceable), the same op in
        PyTorch (:func:`~hf_accel.kernels.attention.attention_sdpa`).
    """
    if query.is_cuda and not torch.compiler.is_compiling() and query.device.index != torch.cuda.current_device():
        with torch.cuda.device(query.device):  # Triton launches on the current device, not the tensors'
            return hf_accel_attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                              is_causal, **kwargs)
    step = active_step(key)
    kv_len = step.max_seq_len if step is not None else key.shape[2]
    reason = _fallback_reason(module, query, kv_len, attention_mask, dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if reason is not None:
        if step is not None:
            key, value = step.gather()  # the fallbacks need contiguous K/V
        mask = _dense_bool_mask(query, key.shape[2], attention_mask, causal)
        if kwargs.get("output_attentions"):
            log_once(f"fallback:{reason}", f"hf-accel: eager attention fallback: {reason}")
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            additive.masked_fill_(~mask, torch.finfo(query.dtype).min)
            return eager_attention_forward(module, query, key, value, additive, scaling=scaling,
                                           dropout=dropout, **kwargs)
        log_once(f"fallback:{reason}", f"hf-accel: SDPA fallback: {reason}")
        # A query row with no visible key (left padding) would give NaN in SDPA, also in its gradient: it attends
        # everywhere, then its output is set to 0, as transformers' own SDPA path and hf-accel's kernels give it
        # (the logits at padding positions enter a loss through the label of the first real token).
        empty = ~mask.any(-1, keepdim=True)  # [batch, 1, q_len, 1]
        out, weights = sdpa_attention_forward(module, query, key, value, mask | empty, dropout=dropout,
                                              scaling=scaling, is_causal=False, **kwargs)
        if bool(empty.any()):
            out = out * (~empty).squeeze(-1).transpose(1, 2)[..., None].to(out.dtype)  # out: [batch, q, heads, d]
        return out, weights
    kernels = query.is_cuda and not torch.compiler.is_compiling()
    if step is not None:
        fn = paged_attention if kernels else paged_attention_sdpa
        # the block manager's tables: no host check of the block ids (a device read per layer)
        out = fn(query, step.key_cache, step.value_cache, step.block_table, step.seq_lens, step.max_seq_len,
                 attention_mask, causal=causal, sm_scale=scaling, check_blocks=False)
        return out, None
    if kernels and query.shape[2] > 1 and _prefill_flops(query, key, causal) >= PREFILL_KERNEL_MIN_FLOPS:
        log_once("path:prefill", "hf-accel: prefill attention runs the Triton FlashAttention-2 kernel")
        out = prefill_attention(query, key, value, attention_mask, causal=causal, sm_scale=scaling)
    elif kernels:
        log_once("path:triton", "hf-accel: attention runs the Triton kernel")
        out = attention(query, key, value, attention_mask, causal=causal, sm_scale=scaling)
    else:
        log_once(
            f"path:ref:{query.device.type}",
            f"hf-accel: no GPU for this tensor ({query.device.type}); attention runs the PyTorch path "
            "(scaled_dot_product_attention with the same masks)",
        )
        out = attention_sdpa(query, key, value, attention_mask, causal=causal, sm_scale=scaling)
    return out, None


_registered = False


def register() -> str:
    """Register the attention and mask functions under :data:`ATTN_NAME`; returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, hf_accel_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, hf_accel_mask)
        _registered = True
        logger.debug("registered attention and mask functions under %r", ATTN_NAME)
    return ATTN_NAME


__all__ = ["ATTN_NAME", "hf_accel_attention_forward", "hf_accel_mask", "register"]
