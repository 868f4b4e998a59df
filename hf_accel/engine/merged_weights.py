"""Merged projections for the fused decode step: Q/K/V as one matrix, gate/up as one matrix.

One matmul per group instead of three (two) halves the launches of a bs1 decode layer, whose small
matmuls are latency-bound. No weight is copied twice: the merged matrix is built once per layer and the
modules' own parameters become row slices (views) of it, so memory stays the same and the modules'
forward is unchanged. :func:`unmerge_projections` gives every module its own storage back; the model's
``state_dict()`` does so first (a pre-hook of ``hf_accel.integrations.generate``), so that any saver writes an
ordinary checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MergedLayer:
    """qkv_weight: [(num_heads + 2 * num_kv_heads) * head_dim, hidden]; qkv_bias: same rows or None;
    qkv_split: row counts (q, k, v); gate_up_weight: [2 * intermediate, hidden]; intermediate: int."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_split: tuple[int, int, int]
    gate_up_weight: torch.Tensor
    intermediate: int


def _mergeable(linears) -> bool:
    ws = [m.weight for m in linears]
    if any(w.device.type == "meta" for w in ws) or len({(w.device, w.dtype, w.shape[1]) for w in ws}) != 1:
        return False
    return len({m.bias is None for m in linears}) == 1


def _merge(linears):
    weight = torch.cat([m.weight.detach() for m in linears], 0)
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears], 0)
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]  # the same Parameter (an optimizer's reference stays valid)
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return weight, bias


def merge_projections(model) -> list[MergedLayer] | None:
    """Merge each decoder layer's q/k/v and gate/up projections in place (see module docstring).

    The parameters stay the same ``Parameter`` objects (their ``.data`` becomes the slice), with their
    ``requires_grad``, and ordinary tensors even when this runs inside ``torch.inference_mode`` (as
    ``generate`` does): the model stays trainable and loadable, and an optimizer's references stay valid.

    Returns one :class:`MergedLayer` per layer, or None (nothing changed) if any layer's projections
    differ in device/dtype/bias presence or are offloaded.
    """
    with torch.inference_mode(False), torch.no_grad():
        return _merge_projections(model)


def _merge_projections(model) -> list[MergedLayer] | None:
    layers = model.model.layers
    for ly in layers:
        a, mlp = ly.self_attn, ly.mlp
        if not (_mergeable([a.q_proj, a.k_proj, a.v_proj]) and _mergeable([mlp.gate_proj, mlp.up_proj])
                and mlp.gate_proj.bias is None):
            return None
    merged = []
    for ly in layers:
        a, mlp = ly.self_attn, ly.mlp
        split = (a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0])
        qkv_w, qkv_b = _merge([a.q_proj, a.k_proj, a.v_proj])
        gu_w, _ = _merge([mlp.gate_proj, mlp.up_proj])
        merged.append(MergedLayer(qkv_w, qkv_b, split, gu_w, mlp.gate_proj.weight.shape[0]))
    return merged


def projections_share_storage(model) -> bool:
    """Whether any layer's Q/K/V or gate/up weights are slices of one storage (merged by this engine, or by the
    engine of the model this one was pickled from: ``torch.save`` keeps the sharing)."""
    def storage(linear):  # None for a module without a weight tensor (a quantized Linear's weight is a method)
        weight = getattr(linear, "weight", None)
        return weight.untyped_storage().data_ptr() if isinstance(weight, torch.Tensor) else None

    for ly in model.model.layers:
        a, mlp = ly.self_attn, ly.mlp
        q, g = storage(a.q_proj), storage(mlp.gate_proj)
        if (q is not None and q == storage(a.k_proj)) or (g is not None and g == storage(mlp.up_proj)):
            return True
    return False


def unmerge_projections(model) -> None:
    """Give every projection its own storage again (the same ``Parameter`` objects, values unchanged;
    ordinary tensors, also when called inside ``torch.inference_mode``). Modules replaced since the merge by ones
    without weight tensors (a quantized Linear, whose ``weight`` is a method) are left as they are."""
    with torch.inference_mode(False), torch.no_grad():
        for ly in model.model.layers:
            a, mlp = ly.self_attn, ly.mlp
            for m in (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj):
                for name in ("weight", "bias"):
                    t = getattr(m, name, None)
                    if isinstance(t, torch.Tensor):
                        t.data = t.detach().clone()
