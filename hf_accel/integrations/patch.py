"""``accelerate_model`` / ``revert_model``: the one-line patch of a transformers model instance.

Only the given instance is changed (its config's attention implementation; peft LoRA weights merged
in place); no module-level class is patched, so later models are unaffected.
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers import GenerationMixin, PreTrainedModel

from hf_accel._logging import logger
from hf_accel.integrations import generate as paged_generate
from hf_accel.integrations.attention import register
from hf_accel.integrations.lora_fingerprints import (
    base_fingerprints, lora_base_weights, lora_flags, lora_layers, lora_parameters, lora_probes, lora_values,
)

#: ``config.model_type`` values :func:`accelerate_model` takes (decoder-only models with RoPE, RMSNorm, a SwiGLU MLP
#: and grouped-query attention as transformers implements them); other types raise ValueError.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_STATE_ATTR = "_hf_accel_state"
#: Set on a base model when hf-accel reverted itself before a peft call (:func:`_revert_for`): what was called, for
#: the error of a later ``revert_model``; cleared by the next ``accelerate_model``.
_AUTO_REVERTED_ATTR = "_hf_accel_reverted_for"

#: Config objects switched to hf-accel's attention, by id: [the attention before the first switch, how many
#: accelerated models share the config, a weak reference to it]. transformers keeps the attention choice in the
#: config, and models built from one config object share it: the last of them to be reverted restores it.
_SWITCHED_CONFIGS: dict[int, list] = {}


def _switch_attention(hf_model, name: str) -> str:
    """Set ``hf_model``'s attention to ``name``; returns the attention its config had before hf-accel switched it
    (for a config shared with a model accelerated earlier: what it had before that one)."""
    config = hf_model.config
    key = id(config)
    entry = _SWITCHED_CONFIGS.get(key)
    if entry is None or entry[2]() is not config:
        entry = [config._attn_implementation, 0, weakref.ref(config, lambda _, k=key: _SWITCHED_CONFIGS.pop(k, None))]
        _SWITCHED_CONFIGS[key] = entry
    hf_model.set_attn_implementation(name)
    entry[1] += 1
    return entry[0]


def _restore_attention(hf_model, original: str) -> None:
    """Undo :func:`_switch_attention`: the config gets ``original`` back once no other accelerated model shares it
    (until then those models keep hf-accel's attention, and so does this one: logged), unless the caller set another
    attention after ``accelerate_model`` (that one stays, logged)."""
    config = hf_model.config
    entry = _SWITCHED_CONFIGS.get(id(config))
    if entry is not None and entry[2]() is config:
        entry[1] -= 1
        if entry[1] > 0:
            logger.info("hf-accel: %s shares its config object with %d other accelerated model(s); the config keeps "
                        "attention %r until the last of them is reverted", type(hf_model).__name__, entry[1],
                        config._attn_implementation)
            return
        del _SWITCHED_CONFIGS[id(config)]
        original = entry[0]
    from hf_accel.integrations.attention import ATTN_NAME

    current = config._attn_implementation
    if current != ATTN_NAME:  # the caller chose another attention after accelerate_model: theirs stays
        logger.info("hf-accel: %s keeps attention %r, set after accelerate_model (it had %r before)",
                    type(hf_model).__name__, current, original)
        return
    hf_model.set_attn_implementation(original)


def _unwrap_peft(model):
    """Return (hf_model, peft_model_or_None)."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but keep the core usable without it
        return model, None
    if isinstance(model, PeftModel):
        return model.get_base_model(), model
    return model, None


def lora_change(model) -> str | None:
    """What changed, while hf-accel holds ``model``'s LoRA adapters merged, that the merged weights do not reflect
    (the LoRA weights or scalings, or the merged base weights: written in place, through ``.data`` or replaced with
    other values; peft's own unmerge by ``set_adapter`` included; a layer's adapters disabled, unmerged or switched
    on the layer itself), or None. Reads every LoRA parameter and merged
    base weight once (a fused add and norm over the LoRA parameters, a fused norm over the base weights, two host
    syncs per call)."""
    hf_model, _ = _unwrap_peft(model)
    state = getattr(hf_model, _STATE_ATTR, None)
    if state is None or not state.get("lora_merged") or state.get("lora_peft") is None:
        return None
    peft_model, saved = state["lora_peft"], state["lora_base_weights"]
    layers = lora_layers(peft_model)
    if [id(m.get_base_layer()) for m in layers] != [id(b) for b, _ in saved]:
        return "a LoRA layer or its base layer was replaced"
    if state.get("lora_flags") is not None and lora_flags(layers) != state["lora_flags"]:  # (None: an older pickle)
        return "a LoRA layer's adapters were disabled, unmerged or switched (on the layer)"
    lora, scalings, base = lora_values(peft_model, saved, state["lora_probes"], layers)
    if lora is None or lora != state["lora_values"][0] or scalings != state["lora_values"][1]:
        return "LoRA weights or scalings changed"
    if base != state["lora_values"][2]:
        return "base weights of LoRA layers changed"
    return None


#: peft calls that need the adapters unmerged: on a PeftModel (or its tuner) whose LoRA hf-accel holds merged they
#: revert hf-accel first, which copies the base weights back bit for bit (peft's own unmerge subtracts the LoRA
#: delta: float rounding is left in the base weights), then run. ``unload`` would otherwise keep the merged
#: weights; the adapter calls unmerge or change what is active.
_PEFT_REVERT_FIRST = ("unload", "merge_and_unload", "set_adapter", "disable_adapter", "add_adapter", "delete_adapter",
                      "load_adapter", "merge_adapter", "unmerge_adapter", "enable_adapter_layers",
                      "disable_adapter_layers")


def _guard_peft(peft_model, state: dict) -> None:
    """While hf-accel holds a PeftModel's LoRA adapters merged, the calls that assume they are not revert hf-accel
    first (logged): the calls of :data:`_PEFT_REVERT_FIRST` (on the PeftModel or its tuner: ``unload`` would keep
    the merged weights; ``set_adapter``, ``disable_adapter``, ``add_adapter`` and the like unmerge by subtraction or
    change the active adapters), ``train()``, a forward with autograd on while LoRA parameters require grad (training:
    merged adapters get no gradient), and ``load_state_dict`` (on the PeftModel or the base model, before anything
    loads). Any other forward checks :func:`lora_change` first (the merged weights gone stale: revert); a merged base
    layer's ``state_dict`` entries are the weights before the merge. Module-level functions bound with
    ``functools.partial``: a copy of the model (``copy.deepcopy``, ``torch.save``) carries guards of its own."""
    attrs = []
    for owner in (peft_model, peft_model.base_model):
        for name in _PEFT_REVERT_FIRST:
            if hasattr(owner, name):
                setattr(owner, name, functools.partial(_peft_revert_first, peft_model, owner, name))
                attrs.append((owner, name))
    peft_model.train = functools.partial(_peft_train, peft_model)
    attrs.append((peft_model, "train"))
    hooks = [peft_model.register_forward_pre_hook(_peft_pre_forward, with_kwargs=True)]
    for module in (peft_model, peft_model.get_base_model()):  # load_state_dict on either (before any weight loads)
        hooks.append(module.register_load_state_dict_pre_hook(functools.partial(_peft_before_load, peft_model)))
    for base, _ in state["lora_base_weights"]:  # state_dict(): the unmerged weights
        hooks.append(base.register_state_dict_post_hook(functools.partial(_peft_state_dict, peft_model)))
    state["peft_guards"] = (attrs, hooks)
    state["lora_peft"] = peft_model
    state["lora_probes"] = lora_probes(peft_model)
    state["lora_values"] = lora_values(peft_model, state["lora_base_weights"], state["lora_probes"])
    state["lora_flags"] = lora_flags(lora_layers(peft_model))


def _revert_for(peft_model, what: str) -> None:
    """Revert hf-accel on ``peft_model`` if it merged its LoRA adapters; ``what`` is the clause saying why, read
    after "when" ("train() was called", "LoRA weights changed while merged"), in the log and in
    :func:`revert_model`'s error afterwards."""
    state = getattr(peft_model.get_base_model(), _STATE_ATTR, None)
    if state is not None and state.get("lora_merged"):
        logger.warning("hf-accel: %s on a PeftModel whose LoRA adapters hf-accel merged: reverted hf-accel first "
                       "(accelerate_model again afterwards for inference)", what)
        revert_model(peft_model)
        peft_model.get_base_model().__dict__[_AUTO_REVERTED_ATTR] = what


def _peft_revert_first(peft_model, owner, name: str, *args, **kwargs):
    _revert_for(peft_model, f"{name}() was called")
    owner.__dict__.pop(name, None)  # (the revert removed it already)
    return getattr(owner, name)(*args, **kwargs)


def _peft_train(peft_model, mode: bool = True):
    if mode:
        _revert_for(peft_model, "train() was called")
    return type(peft_model).train(peft_model, mode)


def _peft_pre_forward(module, args, kwargs):
    if torch.is_grad_enabled() and any(p.requires_grad for p in lora_parameters(module)):
        _revert_for(module, "a forward with autograd ran")
    else:
        revert_if_lora_changed(module)


def revert_if_lora_changed(model) -> bool:
    """Revert hf-accel (logged) where :func:`lora_change` finds the merged weights stale; True if it did."""
    change = lora_change(model)
    if change is not None:
        _revert_for(model if _unwrap_peft(model)[1] is not None else getattr(model, _STATE_ATTR)["lora_peft"],
                    f"{change} while merged")
    return change is not None


def _peft_before_load(peft_model, *args, **kwargs):
    _revert_for(peft_model, "load_state_dict() was called")


def _peft_state_dict(peft_model, module, state_dict, prefix, local_metadata):
    """A merged base layer's entries of a state dict hold the weights before the merge (what the model holds when
    not accelerated); where the adapters or this layer's weights changed since, hf-accel is reverted first (the
    entries share their storage with the weights). Reads this layer's weights and the LoRA parameters only."""
    state = getattr(peft_model.get_base_model(), _STATE_ATTR, None)
    if state is None or not state.get("lora_merged") or state.get("lora_values") is None:
        return
    lora, scalings, _ = lora_values(peft_model, [], state["lora_probes"])
    params, stored, offset = None, [], 0
    for base, saved in state["lora_base_weights"]:  # this layer's fingerprints at the merge (flattened in this order)
        if base is module:
            params, stored = saved, state["lora_values"][2][offset: offset + len(saved)]
            break
        offset += len(saved)
    changed = (lora is None or lora != state["lora_values"][0] or scalings != state["lora_values"][1] or params is None
               or base_fingerprints([getattr(module, k) for k in params]) != stored)
    if changed:
        _revert_for(peft_model, "state_dict() was called after weights changed while merged")
        return
    for name, value in params.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = value.clone()


def _check_lora_only(peft_model) -> None:
    """Raise NotImplementedError (naming the adapter types found) if the peft model has non-LoRA adapters."""
    from peft import PeftType

    kinds = {cfg.peft_type for cfg in peft_model.peft_config.values()}
    if kinds - {PeftType.LORA}:
        names = ", ".join(sorted(str(k.value if hasattr(k, "value") else k) for k in kinds))
        raise NotImplementedError(
            f"hf-accel supports peft models with LoRA adapters only (found: {names}); "
            "merge the adapter with peft (merge_and_unload) and pass the plain model"
        )


def _check_adapters_enabled(peft_model) -> None:
    """Raise ValueError if the PeftModel's adapter layers are disabled (``disable_adapter()`` /
    ``disable_adapter_layers``): hf-accel merges the active adapters into the weights, and peft's forward unmerges them again while disabled."""
    from peft.tuners.lora import LoraLayer

    if any(isinstance(m, LoraLayer) and m.disable_adapters for m in peft_model.modules()):
        raise ValueError("the PeftModel's adapters are disabled (disable_adapter() / disable_adapter_layers()); "
                         "hf-accel merges the active adapters into the weights: enable them first, or accelerate "
                         "the model without its adapters")


def _check_no_tied_lora(peft_model) -> None:
    """Raise ValueError if a LoRA layer wraps a module whose weight another module shares (LoRA on
    ``embed_tokens`` of a model with ``tie_word_embeddings``): merging the adapter into that weight would change
    the other module too (the LM head), which the unmerged PeftModel does not."""
    from peft.tuners.lora import LoraLayer

    owners: dict[int, list[str]] = {}
    for name, module in peft_model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and not isinstance(module, LoraLayer):
            owners.setdefault(weight.untyped_storage().data_ptr(), []).append(name)
    for name, module in peft_model.named_modules():
        base = getattr(module, "base_layer", None) if isinstance(module, LoraLayer) else None
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        sharing = [n for n in owners.get(weight.untyped_storage().data_ptr(), [])
                   if n != f"{name}.base_layer" and not n.startswith(f"{name}.")]
        if sharing:
            raise ValueError(f"a LoRA adapter targets {name}, whose weight {', '.join(sharing)} shares (tied "
                             "embeddings): hf-accel merges adapters into the weights, which would change those "
                             "modules too; target other modules, or untie the weights before adding the adapter")


def _merged_adapters(peft_model) -> list:
    """Each LoRA layer with the adapters merged into it now (peft's ``merged_adapters``): what a caller merged
    before accelerate_model, restored by revert_model."""
    from peft.tuners.lora import LoraLayer

    return [(m, list(m.merged_adapters)) for m in peft_model.modules() if isinstance(m, LoraLayer)]


def check_model_type(hf_model) -> None:
    """Raise ValueError (listing the supported types) if ``hf_model.config.model_type`` is not one hf-accel runs."""
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"hf-accel does not support model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _is_bool(value) -> bool:
    """``value`` is True/False (Python's or numpy's bool)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def accelerate_model(
    model,
    *,
    paged_cache: bool = True,
    fast_decode: bool = True,
    cuda_graphs: bool = True,
    block_size: int = 16,
    merge_lora: bool = True,
    speculative=None,
):
    """Make ``model.generate()`` (and the model's forward) run on hf-accel's attention kernels.

    The model is patched in place and returned, so ``model = accelerate_model(model)`` is the one line
    a script needs. Calling it again with the same options does nothing; with other options it raises ValueError
    (:func:`revert_model` first). :func:`revert_model` undoes it exactly.

    Algorithms: FlashAttention-2 prefill (Dao 2023, "FlashAttention-2", §3), a paged KV cache (Kwon et al. 2023,
    "Efficient Memory Management for Large Language Model Serving with PagedAttention", §4) and split-KV decode
    attention merged by log-sum-exp (Dao et al. 2023, "Flash-Decoding for long-context inference"); speculative
    decoding as in Leviathan et al. 2023 and Chen et al. 2023 (:mod:`hf_accel.speculative`).

    Args:
        model: a transformers ``PreTrainedModel`` of type llama, mistral, qwen2 or qwen3, or a peft
            ``PeftModel`` wrapping one.
        paged_cache: ``generate`` uses a :class:`~hf_accel.cache.PagedCache` sized for each call (freed
            when it returns, or returned with ``return_dict_in_generate=True`` for the next turn) unless the
            caller passes a cache or ``cache_implementation``; beam search, and assisted generation the fast
            path cannot serve, keep transformers' cache (logged). A PagedCache passed back (a previous turn's) is
            continued.
        fast_decode: ``generate`` runs its decode loop on hf-accel's own step (model modules + paged
            kernels) for the configurations it supports (greedy/sampling with temperature, top-k,
            top-p, min/max lengths, EOS, streamers, left-padded batches, repetition penalty,
            ``num_return_sequences`` with sampling, multi-turn); calls with other logits processors, stopping
            criteria or per-step scores run that step inside transformers' ``generate`` (as its
            ``custom_generate``); the rest log why and use transformers' loop. Needs ``paged_cache`` (with
            ``paged_cache=False`` it is off, logged).
        cuda_graphs: on CUDA, capture that step in CUDA graphs (one per batch-size bucket).
        block_size: tokens per KV block of that cache (1 to ``hf_accel.cache.paged_cache.MAX_BLOCK_SIZE``, 1024).
        merge_lora: for a ``PeftModel``: merge its LoRA adapters into the base weights in place
            (peft's ``merge_adapter``; undone exactly by :func:`revert_model`, which keeps a copy of the
            affected base weights meanwhile). With ``False`` a PeftModel is
            refused, since unmerged LoRA layers are not accelerated. While merged, peft's ``unload()`` /
            ``merge_and_unload()``, the adapter calls (``set_adapter``, ``disable_adapter``, ``add_adapter``,
            ``delete_adapter``, ``load_adapter``, ``merge_adapter`` / ``unmerge_adapter``, ``enable_`` /
            ``disable_adapter_layers``), ``train()``, a forward with autograd on the LoRA parameters and
            ``load_state_dict`` revert hf-accel first (a warning says so): they need the adapters unmerged; LoRA
            weights, scalings or merged base weights changed otherwise meanwhile (or a base layer replaced) revert it
            at the next call (:func:`lora_change`). Meanwhile a base layer's weight holds W + delta, as after peft's
            own ``merge_adapter()``: an edit of it is an edit of the merged weight, kept as peft's unmerge keeps it
            (the delta subtracted afterwards: an added tensor ends in W as stock's, a scaling or a copy does not);
            edit base weights after :func:`revert_model`. ``state_dict()`` holds the unmerged weights.
        speculative: speculative decoding for every ``generate`` call on the fast path: a
            :class:`~hf_accel.speculative.SpeculativeConfig`, a method name (``"prompt_lookup"``,
            ``"early_exit"``) or a draft model (a smaller causal LM sharing the tokenizer). Greedy output
            stays the model's own greedy output; sampling keeps its distribution (rejection sampling).
            Without it, calls with transformers' ``assistant_model=`` / ``prompt_lookup_num_tokens=`` /
            ``assistant_early_exit=`` still decode speculatively on hf-accel's path.

    Returns:
        The same object, patched.

    Raises:
        TypeError: ``model`` is not a transformers/peft model, an unknown option is given, ``paged_cache``,
            ``fast_decode``, ``cuda_graphs`` or ``merge_lora`` is not a bool (numpy's bool is taken), or
            ``speculative`` is not a config, method name or model.
        ValueError: the model type is not supported (the message lists the supported ones), a
            PeftModel is given with ``merge_lora=False``, with its adapters disabled, or with LoRA on a weight another
            module shares (tied embeddings), the model was accelerated before with other options
            (:func:`revert_model` first), or ``block_size`` is not an int in [1, 1024].
        NotImplementedError: a PeftModel with non-LoRA adapters.
        ValueError: also for ``speculative`` without ``fast_decode``/``paged_cache`` or on a model without
            ``generate`` (a base model or a classification head: only its attention is accelerated), or a draft model
            with another vocabulary size, on another device, of an unsupported type, or unable to run
            the fast decode step (training mode, a dtype the kernels do not take, accelerated by the
            caller without ``fast_decode``; the message names it).

    A call that raises changes nothing: the options and a draft model are checked before either model is
    touched, and an error after that (building the decode engine, say) is re-raised once the model's
    attention, ``generate`` and LoRA merge are restored and a draft model it accelerated is reverted.

    Attention falls back to SDPA (eager for ``output_attentions``) per call (logged once with the reason) where
    the kernel does not apply: training, autograd, ``output_attentions``, sliding-window/softcap/sink kwargs, dtypes
    other than fp16/bf16/fp32, head_dim > 256, or masks other than causal + padding.
    """
    for flag, value in (("paged_cache", paged_cache), ("fast_decode", fast_decode), ("cuda_graphs", cuda_graphs),
                        ("merge_lora", merge_lora)):
        if not _is_bool(value):  # a string like "no" would read as True
            raise TypeError(f"accelerate_model: {flag} must be True or False, got {value!r}")
    hf_model, peft_model = _unwrap_peft(model)
    if not isinstance(hf_model, PreTrainedModel):
        raise TypeError(
            f"accelerate_model expects a transformers PreTrainedModel (or a peft PeftModel); "
            f"got {type(model).__module__}.{type(model).__qualname__}"
        )
    check_model_type(hf_model)
    model_type = hf_model.config.model_type
    # a base model or a classification head (LlamaModel, *ForSequenceClassification) has no generate(): its
    # attention is accelerated, the cache and decode paths (which replace generate) are not installed
    generates = isinstance(hf_model, GenerationMixin)
    if peft_model is not None and not merge_lora:
        raise ValueError("a PeftModel needs merge_lora=True (unmerged LoRA layers are not accelerated)")
    if peft_model is not None:
        _check_lora_only(peft_model)
        _check_adapters_enabled(peft_model)
        _check_no_tied_lora(peft_model)
    from hf_accel.cache.paged_cache import check_block_size

    check_block_size(block_size)
    spec = None
    if speculative is not None:
        from hf_accel.speculative.config import SpeculativeConfig

        spec = SpeculativeConfig.from_arg(speculative)
        if not generates:
            raise ValueError(f"speculative decoding needs a model with generate() (a *ForCausalLM); "
                             f"{type(hf_model).__name__} has none")
        if not (paged_cache and fast_decode):
            raise ValueError("speculative decoding runs on the fast decode path: it needs paged_cache=True and "
                             "fast_decode=True")
        from hf_accel.speculative.config import check_speculative

        check_speculative(hf_model, spec)
    options = {"paged_cache": bool(paged_cache), "fast_decode": bool(fast_decode), "cuda_graphs": bool(cuda_graphs),
               "block_size": block_size, "speculative": None if spec is None else _describe(spec)}
    previous = getattr(hf_model, _STATE_ATTR, None)
    if previous is not None:
        if previous.get("options") != options:
            how = (f" as the draft model of a {previous['draft_of']}'s speculative decoding (revert_model on that "
                   "model reverts it too)" if previous.get("draft_of") else "")
            raise ValueError(f"model already accelerated{how} with {previous.get('options')}; call revert_model "
                             f"first to use {options}")
        logger.info("hf-accel: model already accelerated; nothing to do")
        return model

    # Everything above only checks; below the instance (and a draft model, in install) changes. An error from
    # here on is re-raised after _restore has undone what was done, so a failed call changes nothing.
    name = register()
    state = {"attn_implementation": hf_model.config._attn_implementation, "lora_merged": False,
             "paged_cache": bool(paged_cache), "options": options}
    try:
        if peft_model is not None:
            # Merge/unmerge in floating point is not exact: keep the base weights to restore them bit for bit.
            state["lora_base_weights"] = lora_base_weights(peft_model)
            state["lora_prior_merged"] = _merged_adapters(peft_model)  # a caller's own merge_adapter(), kept
            peft_model.merge_adapter()
            state["lora_merged"] = True
            _guard_peft(peft_model, state)
        state["attn_implementation"] = _switch_attention(hf_model, name)
        state["attn_switched"] = True
        if paged_cache and not generates:
            logger.info("hf-accel: %s has no generate() (not a *ForCausalLM): its attention runs hf-accel's kernels; "
                        "PagedCache and the fast decode path apply to generate only", type(hf_model).__name__)
        elif paged_cache:
            paged_generate.install(hf_model, block_size, fast_decode=fast_decode, cuda_graphs=cuda_graphs,
                                   speculative=spec)
        elif fast_decode:
            logger.info("hf-accel: fast_decode is off: it runs on the paged cache (paged_cache=False); generate "
                        "keeps transformers' loop and cache, with hf-accel's attention kernels")
    except BaseException:
        _restore(hf_model, peft_model, state)
        raise
    setattr(hf_model, _STATE_ATTR, state)
    hf_model.__dict__.pop(_AUTO_REVERTED_ATTR, None)
    path = "Triton kernel" if hf_model.device.type == "cuda" else "PyTorch (scaled_dot_product_attention; no GPU for this model)"
    logger.info(
        "hf-accel: %s (%s, %d layers) now uses attention %r: %s%s%s",
        type(hf_model).__name__, model_type, hf_model.config.num_hidden_layers, name, path,
        f"; generate uses PagedCache (block_size {block_size})" if paged_cache and generates else "",
        "; LoRA adapters merged" if state["lora_merged"] else "",
    )
    return model


def _describe(spec) -> str:
    """A speculative config as compared between ``accelerate_model`` calls: every field, the draft model by
    identity."""
    import dataclasses

    parts = []
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name == "draft_model" and value is not None:
            parts.append(f"draft_model={type(value).__name__}@{id(value):#x}")
        else:
            parts.append(f"{f.name}={value!r}")
    return "SpeculativeConfig(" + ", ".join(parts) + ")"


def revert_model(model):
    """Undo :func:`accelerate_model` on this instance: attention implementation restored, LoRA unmerged.

    Raises:
        TypeError: ``model`` is not a transformers/peft model.
        ValueError: the model is not accelerated (never was, was reverted already, or hf-accel reverted itself
            before a peft call such as ``disable_adapter()`` or ``train()``: the message says which).
    """
    hf_model, peft_model = _unwrap_peft(model)
    if not isinstance(hf_model, PreTrainedModel):
        raise TypeError(f"revert_model expects a transformers PreTrainedModel; got {type(model).__qualname__}")
    state = getattr(hf_model, _STATE_ATTR, None)
    if state is None:
        what = hf_model.__dict__.get(_AUTO_REVERTED_ATTR)
        if what is not None:
            raise ValueError(f"this model is not accelerated: hf-accel already reverted it itself when {what} on "
                             "the PeftModel (logged); accelerate_model(model) accelerates it again")
        raise ValueError("this model is not accelerated: accelerate_model was not called on it, or revert_model "
                         "already undid it")
    _restore(hf_model, peft_model, state)
    logger.info("hf-accel: reverted %s to attention %r", type(hf_model).__name__, state["attn_implementation"])
    return model


def _restore(hf_model, peft_model, state: dict) -> None:
    """Undo accelerate_model's changes recorded in ``state``, also those of a call that failed part-way:
    attention implementation, generate (and a draft model its speculative engine accelerated), LoRA merge
    (base weights copied back bit for bit from the copies taken before merging)."""
    paged_generate.uninstall(hf_model)  # first: it may raise (releasing the engine), leaving the model accelerated
    if state.pop("attn_switched", False):
        _restore_attention(hf_model, state["attn_implementation"])
    guards = state.pop("peft_guards", None)
    if guards is not None:
        attrs, hooks = guards
        for hook in hooks:
            hook.remove()
        for owner, name in attrs:
            owner.__dict__.pop(name, None)
    saved = state.get("lora_base_weights")
    if saved is not None and not state.get("lora_merged"):
        # failed inside peft's merge_adapter (a layer it cannot merge): the layers merged before it get their
        # weights and flags from before the call back
        with torch.no_grad():
            for base, params in saved:
                for k, v in params.items():
                    getattr(base, k).copy_(v)
        for layer, prior in state.get("lora_prior_merged", ()):
            layer.merged_adapters[:] = prior
        saved = None
    if saved is not None:
        # Base weights written since the merge (a caller's edit) keep it: peft's unmerge subtracts the LoRA delta
        # from them. The others get their copies from before the merge back, bit for bit. (If the LoRA weights
        # changed as well, peft subtracts the new delta from an edited weight: not exact.)
        edited = set()
        if state.get("lora_values") is not None:
            keys = [(id(b), k) for b, params in saved for k in params]
            now = base_fingerprints([getattr(b, k) for b, params in saved for k in params])
            edited = {key for key, before, after in zip(keys, state["lora_values"][2], now) if before != after}
        saved_bases = {id(b) for b, _ in saved}
        if peft_model is not None and state.get("lora_merged"):
            # a LoRA layer whose base layer was replaced meanwhile: the new base holds no merged delta (peft's unmerge
            # would subtract it from the new weights); its flags are cleared instead
            for layer in lora_layers(peft_model):
                if id(layer.get_base_layer()) not in saved_bases:
                    layer.merged_adapters.clear()
            peft_model.unmerge_adapter()
        with torch.no_grad():  # also after peft's unload(), which keeps these very base layers
            for base, params in saved:
                for k, v in params.items():
                    if (id(base), k) not in edited:
                        getattr(base, k).copy_(v)
        # Adapters the caller had merged before accelerate_model stay merged: the copied-back weights hold them
        # (peft's unmerge above cleared the flags); an edited weight gets them merged again by peft.
        for layer, prior in state.get("lora_prior_merged", ()):
            if prior and list(layer.merged_adapters) != prior and id(layer.get_base_layer()) in saved_bases:
                base = layer.get_base_layer()
                if any((id(base), k) in edited for k, _ in base.named_parameters(recurse=False)):
                    layer.merge(adapter_names=prior)
                else:
                    layer.merged_adapters[:] = prior
    state.pop("lora_peft", None)
    hf_model.__dict__.pop(_STATE_ATTR, None)


def original_attention(model) -> str | None:
    """The attention implementation ``model`` had before :func:`accelerate_model` (None if not accelerated)."""
    hf_model, _ = _unwrap_peft(model)
    state = getattr(hf_model, _STATE_ATTR, None)
    return None if state is None else state["attn_implementation"]


def is_accelerated(model) -> bool:
    """True if :func:`accelerate_model` is in effect on ``model`` (a transformers model or a peft ``PeftModel``
    wrapping one); False after :func:`revert_model`, for a model never accelerated, and for any other object
    (never raises)."""
    hf_model, _ = _unwrap_peft(model)
    return getattr(hf_model, _STATE_ATTR, None) is not None


__all__ = ["SUPPORTED_MODEL_TYPES", "accelerate_model", "revert_model", "is_accelerated"]
