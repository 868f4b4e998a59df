"""MHA -> GQA / MQA conversion of a loaded transformers model by K/V head pooling, and its exact inverse
direction (head expansion) and head permutation.

Source: Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints", §3.1 (mean pooling of the K and V heads of each group). The calibrated variants are
described in :mod:`hf_accel.conversion.pooling` and :mod:`hf_accel.conversion.calibration`.
"""

from __future__ import annotations

import numbers

import torch
from transformers import PreTrainedModel

from hf_accel._checks import check_int, check_token_ids
from hf_accel._logging import logger
from hf_accel.conversion import pooling
from hf_accel.conversion.compensation import UNSUPPORTED_MODEL_TYPES as PCA_UNSUPPORTED
from hf_accel.conversion.compensation import pca_pool_module
from hf_accel.conversion.calibration import (
    balanced_groups,
    calibration_windows,
    collect_input_moments,
    head_distances,
)
from hf_accel.conversion.heads import (
    all_or_nothing,
    attention_modules,
    expand_module_kv,
    head_dim_of,
    permute_module_kv,
    pool_module_kv,
)
from hf_accel.integrations.patch import SUPPORTED_MODEL_TYPES, is_accelerated

GROUPINGS = ("adjacent", "similarity")
METHODS = pooling.METHODS


def _check_model(model) -> None:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        PeftModel = ()
    if PeftModel and isinstance(model, PeftModel):
        raise ValueError("got a peft PeftModel; call merge_and_unload() first and convert the plain model")
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"expected a transformers PreTrainedModel; got {type(model).__module__}.{type(model).__qualname__}"
        )
    if is_accelerated(model):
        raise ValueError(
            "the model is accelerated (its generate keeps per-head-count caches and decode steps); call "
            "hf_accel.revert_model(model) first, convert, then hf_accel.accelerate_model(model) again"
        )
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"KV head conversion does not support model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _drop_gguf_marker(model) -> None:
    """A model loaded from a GGUF file holds dense, dequantised weights but keeps transformers' GGUF
    quantizer object, which makes ``save_pretrained`` refuse. Every conversion (also one that changes
    nothing) removes that marker, weights untouched, so its result saves as a plain checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is not None and str(getattr(method, "value", method)) == "gguf":
        quantizer.remove_quantization_config(model)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def kv_head_choices(model) -> list[int]:
    """Valid ``num_kv_heads`` for :func:`convert_to_gqa`: the divisors of the current KV head count
    (pooling merges whole groups, so the new count must divide the old one). ``model``: a model or its
    config."""
    return _divisors(getattr(model, "config", model).num_key_value_heads)


def _as_int(value) -> int | None:
    """``value`` as an int if it is an integer (Python, numpy or a 0-d integer tensor; not a bool), else None."""
    import operator

    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dim() or value.is_floating_point())):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_num_kv_heads(model, num_kv_heads) -> None:
    """ValueError naming the valid choices unless ``num_kv_heads`` is one of :func:`kv_head_choices`
    (``model``: a model or its config, so a caller can check before loading the weights)."""
    cfg = getattr(model, "config", model)
    current, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    choices = kv_head_choices(cfg)
    integer = _as_int(num_kv_heads)
    if integer is None or integer not in choices:
        why = "must be an int" if integer is None else (
            "must be >= 1" if integer < 1 else
            f"must be <= the current {current}" if integer > current else
            f"must divide the current {current}"
        )
        raise ValueError(
            f"num_kv_heads={num_kv_heads!r} {why} (pooling merges whole groups); valid choices for this "
            f"model ({heads} query heads, {current} KV heads): {choices}"
        )


def expand_choices(model) -> list[int]:
    """Valid ``num_kv_heads`` for :func:`expand_kv_heads`: multiples of the current KV head count that
    divide the number of query heads."""
    cur, heads = model.config.num_key_value_heads, model.config.num_attention_heads
    return [k for k in _divisors(heads) if k % cur == 0]


def kv_cache_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """KV-cache size of one token, all layers: ``2 (K and V) * layers * num_kv_heads * head_dim *
    element size``, in bytes.

    Args:
        config: a transformers config with num_hidden_layers, num_key_value_heads and head_dim (or
            hidden_size / num_attention_heads).
        dtype: cache element dtype.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elem


def _calibration_ids(calibration_text, tokenizer) -> torch.Tensor:
    if isinstance(calibration_text, torch.Tensor):
        if calibration_text.dtype != torch.long:
            raise ValueError(f"calibration token ids must be int64; got {calibration_text.dtype}")
        return calibration_text
    if not isinstance(calibration_text, str):
        raise TypeError(f"calibration_text must be a str or a LongTensor of token ids; got {type(calibration_text)}")
    if tokenizer is None:
        raise ValueError("calibration_text is a string: pass tokenizer= as well (or pass token ids)")
    return tokenizer(calibration_text, return_tensors="pt", add_special_tokens=False).input_ids


@torch.no_grad()
def convert_to_gqa(
    model,
    num_kv_heads: int,
    method: str = "mean",
    calibration_text: str | torch.Tensor | None = None,
    *,
    tokenizer=None,
    grouping: str = "adjacent",
    calibration_tokens: int = 4096,
    context_length: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
):
    """Convert the model in place to ``num_kv_heads`` K/V heads by pooling the heads of each group.

    KV head groups are merged whole: new head ``g`` pools old heads ``g*r .. g*r + r - 1`` (r = old /
    new), after an optional regrouping (``grouping="similarity"``) that reorders the KV heads, with
    their query heads and the matching o_proj input columns, so that similar heads are adjacent. The
    pooled K/V projections (weights and biases) are ``sum_j A_j W_j`` with the ``A_j`` of ``method``.
    ``q_proj`` / ``o_proj`` are unchanged except for that reordering (a permutation, exact), and for
    method="pca", which refits them to the pooled heads.
    ``config.num_key_value_heads`` and each attention module's ``num_key_value_groups`` are updated,
    so ``save_pretrained`` writes a checkpoint stock transformers loads.

    Args:
        model: a transformers llama / mistral / qwen2 / qwen3 causal LM (plain, not peft-wrapped).
        num_kv_heads: the new number of K/V heads; a divisor of the current number (1 = MQA).
        method: "mean" (Ainslie et al. 2023, §3.1), "norm" (data-free weights from the query / o_proj
            norms reading each head), "activation" (least-squares weights from calibration query
            statistics) — see :mod:`hf_accel.conversion.pooling` — or "pca" (principal-subspace
            pooling that also refits q_proj rows and o_proj columns to the pooled head, calibrated;
            not for qwen3) — see :mod:`hf_accel.conversion.compensation`.
        calibration_text: text (with ``tokenizer``) or token ids [n] / [1, n] int64; needed by
            method="activation" / "pca" and grouping="similarity".
        tokenizer: the model's tokenizer, when ``calibration_text`` is a string.
        grouping: "adjacent" (heads ``g*r ..``, the paper's choice) or "similarity" (groups of heads
            whose K and V activations on the calibration text are closest; see
            :func:`hf_accel.conversion.calibration.balanced_groups`).
        calibration_tokens: at most this many calibration tokens are used.
        context_length: calibration window length in tokens, at most the model's ``max_position_embeddings``;
            None: 512, or the model's positions if fewer.
        batch_size: calibration windows per forward pass.
        progress: show tqdm progress bars.

    Returns:
        The same model, converted. ``num_kv_heads`` equal to the current count pools nothing (logged) and
        leaves the weights as they are; like any conversion it drops the GGUF quantizer marker of a model
        loaded with transformers' ``from_pretrained(..., gguf_file=)`` (``hf_accel.models.load_model`` leaves
        none), so ``save_pretrained`` works on the result.

    Raises:
        TypeError: not a transformers model, or calibration_text of the wrong type.
        ValueError: unsupported model type, a peft model, or an accelerated model (revert it first);
            ``num_kv_heads`` not a divisor of the
            current count, < 1 or > current (the message lists the valid choices); unknown method or
            grouping; a ``batch_size`` below 1; a calibrated choice without calibration text; too little
            calibration text, token ids outside the model's vocabulary, a ``context_length`` that is not an int in
            [2, the model's positions], or ``calibration_tokens`` not an int >= ``context_length``; with
            ``method="pca"``, no more calibration tokens (whole windows) than ``hidden_size``.
    """
    from tqdm.auto import tqdm

    _check_model(model)
    cfg = model.config
    current, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    check_num_kv_heads(cfg, num_kv_heads)
    num_kv_heads = int(num_kv_heads)  # a numpy / torch integer: a plain int in the config (it is saved as JSON)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if grouping not in GROUPINGS:
        raise ValueError(f"unknown grouping {grouping!r}; choose one of {', '.join(GROUPINGS)}")
    if _as_int(batch_size) is None or batch_size < 1:
        raise ValueError(f"batch_size (calibration windows per forward pass) must be an int >= 1; got {batch_size!r}")
    if method == "pca" and cfg.model_type in PCA_UNSUPPORTED:
        raise ValueError(
            f"method='pca' does not support model_type {cfg.model_type!r} (its per-head q/k norms undo the "
            "query-side compensation); use method='mean', 'norm' or 'activation'"
        )
    modules = attention_modules(model)
    if num_kv_heads == current:  # nothing to pool; the same post-conditions as a pooling (saves like one)
        _drop_gguf_marker(model)
        logger.info("hf-accel: model already has %d KV heads; no pooling needed (weights unchanged)", current)
        return model
    needs_data = method in pooling.CALIBRATED_METHODS or (grouping == "similarity" and num_kv_heads > 1)
    moments = None
    if needs_data:
        max_pos = getattr(cfg, "max_position_embeddings", None)
        if context_length is None:
            context_length = min(512, max_pos) if max_pos else 512
        else:
            context_length = check_int(context_length, "context_length", minimum=2)
            if max_pos and context_length > max_pos:  # windows past the trained positions: meaningless statistics
                raise ValueError(f"context_length={context_length} is more than the model's {max_pos} positions "
                                 "(max_position_embeddings)")
        if calibration_text is None:
            raise ValueError(
                f"method={method!r} with grouping={grouping!r} needs calibration_text (a short text in the "
                "model's domain, with tokenizer=, or token ids)"
            )
        ids = check_token_ids(_calibration_ids(calibration_text, tokenizer), model, "calibration token ids")
        calibration_tokens = check_int(calibration_tokens, "calibration_tokens", minimum=1)
        if calibration_tokens < context_length:
            raise ValueError(f"calibration_tokens={calibration_tokens} is less than context_length={context_length}: "
                             "not one calibration window")
        windows = calibration_windows(ids, context_length, calibration_tokens)
        hidden = getattr(cfg, "hidden_size", None)
        if method == "pca" and hidden and windows.numel() <= hidden:
            # the moment has rank <= tokens: its inverse square root would blow the refitted Q/O weights up
            raise ValueError(f"method='pca' refits Q/O through the inverse square root of each layer's input second "
                             f"moment (hidden_size + 1 = {hidden + 1} square): it needs more calibration tokens than "
                             f"hidden_size={hidden}; got {windows.numel()} (calibration_tokens={calibration_tokens}, "
                             f"whole windows of context_length={context_length})")
        moments = collect_input_moments(model, windows, batch_size=batch_size, progress=progress)

    d = head_dim_of(model)
    r = current // num_kv_heads
    # a layer that fails (e.g. a NaN weight in PCA) leaves every layer as before: nothing half-done
    with all_or_nothing(modules):
        for i, module in enumerate(tqdm(modules, desc=f"pool KV heads {current}->{num_kv_heads}",
                                        disable=not progress, leave=False)):
            if grouping == "similarity" and num_kv_heads > 1:
                groups = balanced_groups(head_distances(module, current, moments[i]), num_kv_heads)
                order = torch.tensor([h for g in groups for h in g])
                permute_module_kv(module, heads, current, order)
            device = module.k_proj.weight.device
            if method == "mean":
                dtype = torch.float64 if module.k_proj.weight.dtype == torch.float64 else torch.float32
                a_k = a_v = pooling.mean_weights(num_kv_heads, r, d, dtype=dtype, device=device)
            elif method == "norm":
                a_k, a_v = pooling.norm_weights(module, current, num_kv_heads, d)
            elif method == "activation":
                a_k, a_v = pooling.activation_weights(module, heads, current, num_kv_heads, d, moments[i])
            if method == "pca":
                pca_pool_module(module, heads, current, num_kv_heads, d, moments[i])
            else:
                pool_module_kv(module, heads, a_k, a_v)
    cfg.num_key_value_heads = num_kv_heads
    _drop_gguf_marker(model)
    logger.info(
        "hf-accel: pooled KV heads %d -> %d (method=%s, grouping=%s) in %d layers",
        current, num_kv_heads, method, grouping, len(modules),
    )
    return model


@torch.no_grad()
def expand_kv_heads(model, num_kv_heads: int | None = None):
    """Duplicate every K/V head so the model has ``num_kv_heads`` of them (default: one per query head,
    i.e. MHA). Exact: every query head reads a copy of the head it read before, so outputs are equal.

    Args:
        model: a transformers llama / mistral / qwen2 / qwen3 causal LM.
        num_kv_heads: a multiple of the current KV head count that divides the number of query heads.

    Returns:
        The same model, expanded in place (config and attention bookkeeping updated): each layer's ``k_proj`` /
        ``v_proj`` weight goes from [current * head_dim, hidden] to [num_kv_heads * head_dim, hidden] (biases
        likewise), each head repeated ``num_kv_heads // current`` times in a row, in the
        weights' dtype; q_proj / o_proj are unchanged.

    Raises:
        TypeError / ValueError: as :func:`convert_to_gqa`; an invalid count lists the valid choices.
    """
    _check_model(model)
    cfg = model.config
    current, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    given = heads if num_kv_heads is None else num_kv_heads
    target = _as_int(given)
    choices = expand_choices(model)
    if target not in choices:
        raise ValueError(
            f"num_kv_heads={given!r} must be a multiple of the current {current} KV heads that divides "
            f"the {heads} query heads; valid choices: {choices}"
        )
    modules = attention_modules(model)
    with all_or_nothing(modules):
        for module in modules:
            expand_module_kv(module, heads, current, target // current)
    cfg.num_key_value_heads = target
    _drop_gguf_marker(model)
    logger.info("hf-accel: expanded KV heads %d -> %d (exact)", current, target)
    return model


@torch.no_grad()
def permute_kv_heads(model, orders):
    """Reorder the KV heads of every layer, moving each head's query heads and o_proj input columns
    with it; the model computes the same function (exact up to float summation order in o_proj).

    Args:
        model: a supported transformers causal LM.
        orders: one permutation per layer ([num_kv_heads] ints; new head p = old head order[p]).

    Raises:
        ValueError: wrong number of orders, or an order that is not a permutation of ints (checked for every
            layer before any changes).
    """
    _check_model(model)
    modules = attention_modules(model)
    if len(orders) != len(modules):
        raise ValueError(f"need one order per layer ({len(modules)}); got {len(orders)}")
    cfg = model.config
    checked = []
    for i, order in enumerate(orders):  # every order checked before any layer changes
        values = order.tolist() if isinstance(order, torch.Tensor) else list(order)
        if (any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values)
                or sorted(values) != list(range(cfg.num_key_value_heads))):
            raise ValueError(f"orders[{i}] must be a permutation of range({cfg.num_key_value_heads}) (ints); got "
                             f"{values}")
        checked.append(torch.tensor(values, dtype=torch.long))
    for module, order in zip(modules, checked):
        permute_module_kv(module, cfg.num_attention_heads, cfg.num_key_value_heads, order)
    return model
