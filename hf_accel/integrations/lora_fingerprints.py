"""What hf-accel remembers of a PeftModel whose LoRA adapters it merged, to notice later changes the merged weights
would not reflect (:func:`hf_accel.integrations.patch.lora_change`) and to restore the base weights exactly on
revert: copies of the base weights, and cheap fingerprints (one read of each tensor, one host sync per kind) of the
LoRA parameters (norm of the parameter plus a fixed random probe, which changes when values change but their norm
does not: a sign flip, reordered rows) and of the merged base weights (their norms: an edit that keeps a base
weight's norm while merged is not noticed).
"""

from __future__ import annotations

import torch


def lora_base_weights(peft_model) -> list:
    """Copies of the base weights LoRA merging will change, with the base layers holding them (restored exactly
    by revert_model, also after peft's ``unload`` has replaced the LoRA layers by those base layers)."""
    from peft.tuners.lora import LoraLayer

    saved = []
    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            saved.append((base, {k: v.detach().clone() for k, v in base.named_parameters(recurse=False)}))
    return saved


def _norms(tensors) -> list[float]:
    """float32 L2 norm of each tensor, read with one host sync: what tells whether a weight changed (in place,
    through ``.data`` or replaced) from the same values in other storage (the fast path's merged projections)."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return []
    with torch.no_grad():
        try:
            norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        except (AttributeError, TypeError, RuntimeError):  # (a torch without it): one kernel per tensor
            norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
        return torch.stack([n.to(tensors[0].device) for n in norms]).tolist()


def base_fingerprints(tensors) -> list[float]:
    """The float32 norm of each merged base tensor, one host sync. (A bilinear form ``s . (W r)`` was tried to catch
    edits that keep the norm; ``torch.mv`` gives other last bits with another CPU thread count or under CUDA
    autocast, so the merged weights would look stale when nothing changed: not kept.)"""
    return _norms(tensors)


def lora_layers(peft_model) -> list:
    """The LoRA layers of a PeftModel, in module order (the order of :func:`lora_base_weights`)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in peft_model.modules() if isinstance(m, LoraLayer)]


def lora_flags(layers) -> tuple:
    """Per LoRA layer (:func:`lora_layers`): whether its adapters are disabled, the adapters merged into it and the
    active ones. A layer-level ``enable_adapters(False)``, ``set_adapter`` or ``unmerge()`` changes them without
    touching a weight (a disabled layer's forward unmerges by subtraction, or, captured in a graph, not at all)."""
    return tuple((bool(m.disable_adapters), tuple(m.merged_adapters), tuple(m.active_adapters)) for m in layers)


def lora_parameters(peft_model):
    """The LoRA parameters of a PeftModel (named ``lora_*``: A, B, embedding A/B, DoRA magnitudes), in module order."""
    return [p for n, p in peft_model.named_parameters() if "lora_" in n]


def lora_probes(peft_model) -> list:
    """One fixed random tensor per LoRA parameter, of its shape, dtype and device, scaled to its RMS: the
    parameter's fingerprint is the norm of parameter + probe, which (unlike its norm alone) changes when the values
    change but not their norm (a sign flip, rows swapped)."""
    generator = torch.Generator().manual_seed(0)
    probes = []
    with torch.no_grad():
        for p in lora_parameters(peft_model):
            rms = float(p.detach().float().pow(2).mean().sqrt()) if p.numel() else 0.0
            probes.append((torch.randn(p.shape, generator=generator) * rms).to(p.device, p.dtype))
    return probes


def lora_fingerprints(peft_model, probes) -> list[float] | None:
    """The float32 norm of each LoRA parameter plus its probe (:func:`lora_probes`), with one host sync; None when
    the parameters no longer match the probes in number, shape, dtype or device (replaced: changed)."""
    params = [p.detach() for p in lora_parameters(peft_model)]
    if len(params) != len(probes) or any(p.shape != q.shape or p.dtype != q.dtype or p.device != q.device
                                         for p, q in zip(params, probes)):
        return None
    with torch.no_grad():
        try:
            summed = torch._foreach_add(params, probes)
        except (AttributeError, TypeError, RuntimeError):  # (a torch without it): one kernel per tensor
            summed = [p + q for p, q in zip(params, probes)]
    return _norms(summed)


def lora_values(peft_model, saved, probes, layers=None) -> tuple:
    """What the merged weights depend on: the fingerprints of the LoRA parameters (:func:`lora_fingerprints`),
    their scalings, and the fingerprints of the merged base weights (:func:`base_fingerprints`). ``layers``: the
    model's :func:`lora_layers` where the caller has them already (one walk of the modules fewer)."""
    lora = lora_fingerprints(peft_model, probes)
    scalings = tuple(tuple(sorted(m.scaling.items())) for m in (lora_layers(peft_model) if layers is None else layers))
    return lora, scalings, base_fingerprints([getattr(b, k) for b, params in saved for k in params])
