"""Weight surgery on the K/V heads of one attention module: pool, expand, permute.

Layout conventions (transformers' Llama-family attention, including Mistral, Qwen2 and Qwen3):
``k_proj.weight`` / ``v_proj.weight`` are [num_kv_heads * head_dim, hidden] (head ``h`` owns rows
``h*head_dim : (h+1)*head_dim``), ``q_proj.weight`` is [num_heads * head_dim, hidden] and
``o_proj.weight`` is [hidden, num_heads * head_dim]. Query head ``q`` reads KV head
``q // (num_heads // num_kv_heads)`` (``repeat_kv``), so each KV head owns a contiguous block of query
heads. Everything here keeps that invariant.

RoPE rotates every head of a position by the same matrix and is linear, and Qwen3's ``k_norm`` /
``q_norm`` weights are shared by all heads, so pooling or duplicating rows of ``k_proj`` needs no
other change; pooling before Qwen3's ``k_norm`` (an RMSNorm, not linear) is the one approximation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def attention_modules(model) -> list[nn.Module]:
    """The self-attention modules of ``model`` in layer order (modules with q/k/v/o projections).

    Raises:
        ValueError: the number found differs from ``config.num_hidden_layers``, or a projection is not
            a plain ``nn.Linear`` on a real device (peft-wrapped, quantised or offloaded to ``meta``).
    """
    found = [m for m in model.modules() if all(isinstance(getattr(m, p, None), nn.Module) for p in PROJECTIONS)]
    expected = model.config.num_hidden_layers
    if len(found) != expected:
        raise ValueError(f"found {len(found)} attention modules with q/k/v/o_proj, config says {expected} layers")
    for module in found:
        for name in PROJECTIONS:
            proj = getattr(module, name)
            if type(proj) is not nn.Linear:
                raise ValueError(
                    f"{name} is a {type(proj).__qualname__}, not a plain nn.Linear (merge peft adapters and "
                    "dequantise the model before converting its heads)"
                )
            if proj.weight.device.type == "meta":
                raise ValueError(f"{name} has weights on the meta device (offloaded); load the model fully first")
    return found


def head_dim_of(model) -> int:
    """Per-head width: ``config.head_dim`` if set, else ``hidden_size // num_attention_heads``."""
    cfg = model.config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _set_linear(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Replace a Linear's parameters (new shapes allowed), keeping dtype, device and requires_grad."""
    requires_grad = linear.weight.requires_grad
    dtype, device = linear.weight.dtype, linear.weight.device
    linear.weight = nn.Parameter(weight.to(device=device, dtype=dtype).contiguous(), requires_grad=requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype).contiguous(), requires_grad=requires_grad)
    linear.out_features, linear.in_features = weight.shape


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the surgery computes in: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads(linear: nn.Linear, num_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [num_heads, head_dim, in], bias [num_heads, head_dim] or None), in :func:`compute_dtype`."""
    ct = compute_dtype(linear.weight.dtype)
    w = linear.weight.detach().to(ct)
    w = w.view(num_heads, w.shape[0] // num_heads, w.shape[1])
    b = None if linear.bias is None else linear.bias.detach().to(ct).view(num_heads, -1)
    return w, b


def _set_heads(linear: nn.Linear, w: torch.Tensor, b: torch.Tensor | None) -> None:
    _set_linear(linear, w.reshape(-1, w.shape[-1]), None if b is None else b.reshape(-1))


def module_state(module: nn.Module) -> tuple:
    """What the head surgery of this module changes: the Parameters (and shapes) of its q/k/v/o projections and
    its head-count attributes. The surgery replaces Parameters (:func:`_set_linear`) rather than editing them,
    so :func:`restore_module_state` puts the module back exactly."""
    linears = tuple((name, getattr(module, name), getattr(module, name).weight, getattr(module, name).bias,
                     getattr(module, name).in_features, getattr(module, name).out_features)
                    for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    attrs = tuple((name, getattr(module, name)) for name in ("num_key_value_groups", "num_key_value_heads")
                  if hasattr(module, name))
    return linears, attrs


@contextlib.contextmanager
def all_or_nothing(modules) -> Iterator[None]:
    """Head surgery over several attention modules as one step: if the block raises, every module gets its
    :func:`module_state` from before the block back (no half-converted model), and the error propagates."""
    saved = [module_state(module) for module in modules]
    try:
        yield
    except BaseException:
        for module, state in zip(modules, saved):
            restore_module_state(module, state)
        raise


def restore_module_state(module: nn.Module, state: tuple) -> None:
    """Undo a partial or complete surgery of ``module`` from its :func:`module_state`."""
    linears, attrs = state
    for name, linear, weight, bias, in_features, out_features in linears:
        setattr(module, name, linear)
        linear.weight, linear.bias = weight, bias
        linear.in_features, linear.out_features = in_features, out_features
    for name, value in attrs:
        setattr(module, name, value)


def _set_bookkeeping(module: nn.Module, num_heads: int, num_kv_heads: int) -> None:
    """Attributes transformers' attention modules derive from the config at construction time."""
    if hasattr(module, "num_key_value_groups"):
        module.num_key_value_groups = num_heads // num_kv_heads
    if hasattr(module, "num_key_value_heads"):
        module.num_key_value_heads = num_kv_heads


@torch.no_grad()
def pool_module_kv(
    module: nn.Module,
    num_heads: int,
    weights_k: torch.Tensor,
    weights_v: torch.Tensor,
) -> None:
    """Pool adjacent KV heads of one attention module with per-group weights (in place).

    The new KV head ``g`` replaces old heads ``g*r .. g*r + r - 1`` (r = old // new); its projection is
    ``sum_j A_j W_j`` over those heads, where ``A_j`` is a [head_dim, head_dim] matrix weight. Plain
    mean pooling (Ainslie et al. 2023, "GQA", §3.1) is ``A_j = I / r``. Biases are pooled the same way.
    Query heads and ``o_proj`` are unchanged: the query blocks of the r old heads become one block.

    Args:
        module: a Llama-family attention module with ``k_proj`` / ``v_proj`` as described above.
        num_heads: number of query heads.
        weights_k: [new_kv_heads, r, head_dim, head_dim], float, the matrices ``A_j`` for K (unitless
            mixing weights; the sum over j is the identity for a weighted mean).
        weights_v: [new_kv_heads, r, head_dim, head_dim], float, the same for V.
    """
    new_kv, r, d, _ = weights_k.shape
    for name, a in (("k_proj", weights_k), ("v_proj", weights_v)):
        linear = getattr(module, name)
        w, b = _heads(linear, new_kv * r)
        a = a.to(device=w.device, dtype=w.dtype)
        w = w.view(new_kv, r, d, -1)
        w_new = torch.einsum("grij,grjk->gik", a, w)
        b_new = None if b is None else torch.einsum("grij,grj->gi", a, b.view(new_kv, r, d))
        _set_heads(linear, w_new, b_new)
    _set_bookkeeping(module, num_heads, new_kv)


@torch.no_grad()
def expand_module_kv(module: nn.Module, num_heads: int, num_kv_heads: int, factor: int) -> None:
    """Duplicate every KV head ``factor`` times (in place); exact, since query head ``q`` still reads a
    copy of the head it read before (new head ``h*factor + c`` is old head ``h``)."""
    for name in ("k_proj", "v_proj"):
        linear = getattr(module, name)
        w, b = _heads(linear, num_kv_heads)
        _set_heads(
            linear,
            w.repeat_interleave(factor, dim=0),
            None if b is None else b.repeat_interleave(factor, dim=0),
        )
    _set_bookkeeping(module, num_heads, num_kv_heads * factor)


@torch.no_grad()
def permute_module_kv(module: nn.Module, num_heads: int, num_kv_heads: int, order: torch.Tensor) -> None:
    """Reorder the KV heads of one attention module (new head ``p`` = old head ``order[p]``), moving each
    head's block of query heads (rows of ``q_proj``, input columns of ``o_proj``) with it, so the module
    computes the same function (up to floating-point summation order in ``o_proj``)."""
    order = torch.as_tensor(order, dtype=torch.long).cpu()
    if sorted(order.tolist()) != list(range(num_kv_heads)):
        raise ValueError(f"order must be a permutation of range({num_kv_heads}); got {order.tolist()}")
    if torch.equal(order, torch.arange(num_kv_heads)):
        return
    rep = num_heads // num_kv_heads
    q_order = (order[:, None] * rep + torch.arange(rep)[None, :]).reshape(-1)
    for name in ("k_proj", "v_proj"):
        linear = getattr(module, name)
        w, b = _heads(linear, num_kv_heads)
        idx = order.to(w.device)
        _set_heads(linear, w[idx], None if b is None else b[idx])
    q_proj, o_proj = module.q_proj, module.o_proj
    w, b = _heads(q_proj, num_heads)
    idx = q_order.to(w.device)
    _set_heads(q_proj, w[idx], None if b is None else b[idx])
    wo = o_proj.weight.detach()
    wo = wo.view(wo.shape[0], num_heads, -1)[:, idx].reshape(wo.shape[0], -1)
    _set_linear(o_proj, wo, None if o_proj.bias is None else o_proj.bias.detach())
