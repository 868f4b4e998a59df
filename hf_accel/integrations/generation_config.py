"""A generate call's prepared ``GenerationConfig``, remembered between calls with the same settings.

transformers' ``GenerationMixin._prepare_generation_config(generation_config, **kwargs)`` merges the call's
options, the caller's ``generation_config``, the model's ``generation_config`` and the global defaults, and
(without a caller's config) checks that ``model.config`` holds no generation options. Its result is a
function of those inputs alone. It deep-copies configs on every call, and transformers 5.17's check builds a
default model config of the model's class each time; together a few hundred microseconds to over a
millisecond of host time per call, while the GPU waits for the prefill. A batch-1 call of 128 tokens on the
fast path takes ~25-65 ms, so that is a few percent of it.

:func:`prepare_generation_config` runs transformers' function once per distinct set of inputs and returns a
copy of the remembered result after that. The key holds every input by value: the call's option values,
the caller's and the model's generation configs (all attributes), the model config's values of the
generation options transformers' check looks at, and the names of the call's tensor (or other object)
arguments. Those objects pass through to ``model_kwargs`` as they are; a call in which one of them would
be consumed as a generation option, or whose configs hold a value that cannot be compared by value, is
not remembered (transformers' function runs every time). Errors are raised by transformers' function
itself (nothing failing is remembered).
"""

from __future__ import annotations

import copy
import threading

import torch
from transformers import GenerationConfig

#: Prepared configs remembered per model (the oldest is dropped past this many).
MAX_ENTRIES = 16
#: False: transformers' function runs on every call (for A/B timing).
REMEMBER = True
_SIMPLE_TYPES = frozenset((type(None), bool, int, float, str))
_LOCK = threading.Lock()  # calls from several threads share a model's memo


class _NotComparable(Exception):
    pass


def _freeze(value):
    """``value`` as a hashable value-equal key: scalars with their type (1, True and 1.0 are different
    options), lists / tuples / sets / dicts recursively (dicts in their insertion order: the same attributes
    set in another order only miss the memo); raises _NotComparable for anything else (objects compared by
    identity)."""
    kind = type(value)
    if kind in _SIMPLE_TYPES:
        return (kind, value)
    if kind is list or kind is tuple:
        return (kind, tuple(_freeze(v) for v in value))
    if kind is dict:
        return (dict, tuple((k, _freeze(v)) for k, v in value.items()))
    if kind is set or kind is frozenset:
        return (kind, frozenset(_freeze(v) for v in value))
    if isinstance(value, torch.dtype):
        return (torch.dtype, value)
    raise _NotComparable(kind.__name__)


def _config_key(config):
    return None if config is None else (type(config), _freeze(vars(config)))


def _key(model, user_config, call: dict):
    """The memo key of a call and the names of its pass-through (object) arguments. Raises _NotComparable or
    TypeError where a config holds a value that cannot be compared by value (the call is then not remembered)."""
    simple, objects = [], []
    for name, value in call.items():
        try:
            simple.append((name, _freeze(value)))
        except _NotComparable:
            objects.append(name)
    gen_keys = GenerationConfig._get_default_generation_params().keys()
    model_cfg = vars(model.config)
    checked = tuple(_freeze(model_cfg.get(k)) for k in gen_keys)
    key = (tuple(sorted(simple)), tuple(sorted(objects)), _config_key(user_config),
           _config_key(model.generation_config), type(model.config), checked)
    hash(key)  # TypeError here (an unhashable value) means: not remembered
    return key, objects


def prepare_generation_config(model, user_config, call: dict):
    """``model._prepare_generation_config(user_config, **call)``: ``(generation_config, model_kwargs)``.

    Args:
        model: a transformers generative model.
        user_config: the caller's ``GenerationConfig`` or None.
        call: the call's other keyword arguments (``input_ids`` and ``attention_mask`` tensors included).

    Returns:
        A ``GenerationConfig`` of the caller's own (a copy; changing it changes nothing remembered) and the
        model kwargs dict, as transformers returns them.

    Raises:
        Whatever transformers' function raises for these inputs.
    """
    if not REMEMBER:
        return model._prepare_generation_config(user_config, **call)
    try:
        key, objects = _key(model, user_config, call)
    except (_NotComparable, TypeError):
        return model._prepare_generation_config(user_config, **call)
    memo = model.__dict__.setdefault("_hf_accel_generation_configs", {})
    hit = memo.get(key)
    if hit is None:
        gc, model_kwargs = model._prepare_generation_config(user_config, **call)
        if any(name not in model_kwargs or model_kwargs[name] is not call[name] for name in objects):
            return gc, model_kwargs  # an object was taken as a generation option: not remembered
        # model kwargs from the call are taken from each call; the others (transformers' additions) kept
        added = {k: v for k, v in model_kwargs.items() if k not in call}
        passed = [k for k in model_kwargs if k in call]
        entry = (copy.deepcopy(gc), passed, copy.deepcopy(added))
        with _LOCK:
            while len(memo) >= MAX_ENTRIES:
                memo.pop(next(iter(memo)))
            memo[key] = entry
        return gc, model_kwargs
    gc, passed, added = hit
    out = object.__new__(type(gc))  # a copy: scalars shared, containers copied
    out.__dict__.update({k: v if type(v) in _SIMPLE_TYPES else copy.deepcopy(v) for k, v in vars(gc).items()})
    model_kwargs = {k: call[k] for k in passed}
    if added:
        model_kwargs.update(copy.deepcopy(added))
    return out, model_kwargs
