"""Which models the fused decode step (:class:`~hf_accel.engine.decode_step.DecodeStep` with ``fused``) can run, and
whether its small-batch matmuls can be :func:`~hf_accel.kernels.fused_linear.fused_linear` / ``gemv`` calls: each
check returns the reason it cannot (a short phrase for the log), or None.
"""

from __future__ import annotations

import torch

from hf_accel.engine import step_switches as switches


def _silu_types() -> set:
    from transformers.activations import ACT2FN

    return {torch.nn.SiLU, type(ACT2FN["silu"])}


_SILU_TYPES = _silu_types()


def plain_linear(module) -> torch.nn.Linear | None:
    """The plain ``nn.Linear`` whose forward is ``module``'s (None if there is none): ``module`` itself, or the base
    layer of a peft LoRA layer whose forward runs only that base layer: its adapters merged (and not disabled:
    peft's forward would unmerge them first), or unmerged and disabled, or none of its active adapters on this
    layer (an adapter set active that targets other modules)."""
    if type(module) is torch.nn.Linear:
        return module
    if not hasattr(module, "get_base_layer") or not hasattr(module, "merged_adapters"):
        return None
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft not installed: no LoRA layer either
        return None
    if not isinstance(module, LoraLayer):
        return None
    base = getattr(module, "base_layer", None)  # (not get_base_layer(): a tuner layer wrapping another is refused)
    if type(base) is not torch.nn.Linear:
        return None
    if module.merged:
        return None if module.disable_adapters else base
    if module.disable_adapters or not any(name in module.lora_A for name in module.active_adapters):
        return base
    return None


def _model_rms_norm(norm, model) -> bool:
    """Whether ``norm`` is an RMSNorm of the model's own modeling module (``LlamaRMSNorm`` in a llama model ...) with
    ``weight`` and ``variance_epsilon``: the math the fused kernels compute. Another norm with those attributes
    (``CohereLayerNorm`` subtracts the mean) or a subclass from elsewhere runs on the module step."""
    cls = type(norm)
    return (cls.__name__.endswith("RMSNorm") and cls.__module__ == type(model).__module__
            and hasattr(norm, "variance_epsilon") and getattr(norm, "weight", None) is not None)


def fused_supported(model) -> str | None:
    """Why the fused step cannot run this model (None if it can): it needs the model's own RMSNorm class for every
    norm (q_norm / k_norm with one ``variance_epsilon``), plain ``nn.Linear`` projections (or LoRA layers computing
    as one: :func:`plain_linear`), a SiLU-gated MLP (``hidden_act`` and each layer's ``act_fn``), an even head_dim,
    and the embedding, norms, projections and LM head in one dtype (its buffers and kernels take the
    embedding's)."""
    inner = model.model
    if getattr(model.config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(model.config, 'hidden_act', None)!r}"
    acts = {type(getattr(ly.mlp, "act_fn", None)) for ly in model.model.layers}
    if not acts <= _SILU_TYPES:  # an act_fn replaced on a layer: the fused kernels compute SiLU
        return f"an MLP activation that is not SiLU ({', '.join(sorted(t.__name__ for t in acts - _SILU_TYPES))})"
    norms = [inner.norm] + [n for ly in inner.layers for n in (ly.input_layernorm, ly.post_attention_layernorm)]
    if any(not _model_rms_norm(n, model) for n in norms):
        return "a norm that is not the model's own RMSNorm class (with weight and variance_epsilon)"
    for ly in inner.layers:
        attn, mlp = ly.self_attn, ly.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, getattr(mlp, "gate_proj", None),
                   getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None)]
        if any(plain_linear(m) is None for m in linears):
            return ("a projection that does not compute as a plain nn.Linear (e.g. an unmerged LoRA adapter or a "
                    "quantized layer)")
        qk_norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        if qk_norms != [None, None]:
            if not all(_model_rms_norm(n, model) for n in qk_norms):
                return "a q_norm / k_norm that is not the model's own RMSNorm class"
            if qk_norms[0].variance_epsilon != qk_norms[1].variance_epsilon:  # one eps in the RoPE kernel
                return "q_norm and k_norm with different variance_epsilon"
    if inner.layers[0].self_attn.head_dim % 2:
        return "odd head_dim"
    weights = [getattr(model.get_input_embeddings(), "weight", None), getattr(model.lm_head, "weight", None)]
    weights += [n.weight for n in norms]
    for ly in inner.layers:
        attn = ly.self_attn
        weights += [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, ly.mlp.gate_proj,
                                       ly.mlp.up_proj, ly.mlp.down_proj)]
        weights += [getattr(n, "weight", None) for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))]
    dtypes = {w.dtype for w in weights if isinstance(w, torch.Tensor)}
    if len(dtypes) > 1:
        return f"weights in several dtypes ({', '.join(sorted(str(d) for d in dtypes))})"
    return None


def fused_linear_supported(model, merged, check_hidden: bool = True) -> str | None:
    """Why the fused step cannot use :func:`fused_linear` (or, with ``check_hidden=False``, :func:`gemv`)
    for this model (None if it can): it needs the merged projections, a hidden size <=
    :data:`~hf_accel.engine.step_switches.FUSED_LINEAR_MAX_HIDDEN` (fused_linear only) and plain ``nn.Linear``
    o_proj / down_proj (:func:`plain_linear`). Asked only of models :func:`fused_supported` takes, whose weights share
    one dtype."""
    if merged is None:
        return "projections not merged"
    if check_hidden and model.config.hidden_size > switches.FUSED_LINEAR_MAX_HIDDEN:
        return f"hidden size {model.config.hidden_size} > {switches.FUSED_LINEAR_MAX_HIDDEN} (cuBLAS is faster there)"
    linears = [m for ly in model.model.layers for m in (ly.self_attn.o_proj, ly.mlp.down_proj)]
    if any(plain_linear(m) is None for m in linears):
        return "an o_proj or down_proj that is not a plain nn.Linear"
    return None
