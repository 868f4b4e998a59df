"""The hf-accel features the right pane can use, and how the accelerated model is built from them.

Every hf-accel feature is one entry of :data:`FEATURES`: the page shows a toggle for each feature the
installed package has (:func:`available_features`), and :func:`build_accelerated` applies the ones toggled
on to a fresh copy of the weights (weight transforms first, then :func:`hf_accel.accelerate_model` with
the features' keyword options).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import hf_accel
from hf_accel.cache import MAX_BLOCK_SIZE

from request import first_line, parse_int

log = logging.getLogger("hf_accel.demo")


@dataclass(frozen=True)
class Feature:
    """One hf-accel feature the right pane can use; the page shows a toggle for it when ``available()``.

    A feature acts in one or both of two ways on a fresh copy of the weights:

    - ``transform(model, setting) -> model`` changes the model before it is accelerated (e.g. GQA
      conversion of the weights);
    - ``options(on, setting) -> dict`` gives keyword options of :func:`hf_accel.accelerate_model`
      (called when it is toggled on *and* when off, so "off" can be passed explicitly).

    ``setting`` is the value of the feature's optional numeric setting (``setting_label``), else None.
    ``requires`` names features that must be on for this one to do anything.
    """

    key: str
    label: str
    info: str
    default: bool = True
    available: Callable[[], bool] = lambda: True
    transform: Callable[[Any, Any], Any] | None = None
    options: Callable[[bool, Any], dict] | None = None
    setting_label: str | None = None
    setting_default: int | None = None
    requires: tuple[str, ...] = ()
    changes_output: bool = False  # True when the feature changes the weights (outputs may differ)


ATTENTION = "attention"  # the feature that is accelerate_model() itself; the other options need it


def _import_convert_to_gqa():
    """``hf_accel.conversion.convert_to_gqa`` if this install has it, else None."""
    try:
        return importlib.import_module("hf_accel.conversion").convert_to_gqa
    except (ImportError, AttributeError):
        return None


def _accelerate_accepts(option: str) -> bool:
    """True if this install's ``accelerate_model`` takes the keyword option ``option``."""
    try:
        return option in inspect.signature(hf_accel.accelerate_model).parameters
    except (TypeError, ValueError):
        return False


def _transform_gqa(model, num_kv_heads):
    convert = _import_convert_to_gqa()
    if convert is None:
        raise RuntimeError("GQA conversion is not available in this hf-accel install")
    n = parse_int(num_kv_heads, "KV heads after conversion")
    out = convert(model, n)
    return model if out is None else out


def _paged_options(on: bool, block_size) -> dict:
    if not on:
        return {"paged_cache": False}
    n = parse_int(block_size, "KV block size")
    if not 1 <= n <= MAX_BLOCK_SIZE:
        raise ValueError(f"KV block size must be between 1 and {MAX_BLOCK_SIZE} (got {n})")
    return {"paged_cache": True, "block_size": n}


FEATURES: tuple[Feature, ...] = (
    Feature(
        key="gqa",
        label="GQA conversion (mean-pool K/V heads)",
        info="Pools the K/V heads of each group into one (Ainslie et al. 2023): a smaller KV cache. "
             "Changes the weights, so the answer may differ from stock.",
        default=False,
        available=lambda: _import_convert_to_gqa() is not None,
        transform=_transform_gqa,
        setting_label="KV heads after conversion",
        setting_default=1,
        changes_output=True,
    ),
    Feature(
        key=ATTENTION,
        label="hf-accel attention",
        info="accelerate_model(): Triton attention kernels on GPU, their PyTorch reference on CPU. "
             "Off: the right pane runs an unmodified copy.",
    ),
    Feature(
        key="paged",
        label="Paged KV cache",
        info="K/V kept in fixed-size blocks (PagedAttention) instead of one growing tensor per layer.",
        available=lambda: _accelerate_accepts("paged_cache"),
        options=_paged_options,
        setting_label="KV block size (tokens)",
        setting_default=16,
        requires=(ATTENTION,),
    ),
    # Later features (speculative decoding, quantization) are added here.
)


def build_accelerated(model, enabled: dict[str, Any], features=FEATURES):
    """Apply the enabled features to ``model`` (a fresh copy) and return the model for the right pane.

    Args:
        enabled: feature key -> setting, for the features toggled on.
        features: the features shown on the page, in order.

    Raises:
        ValueError: a page message (bad setting, a feature that needs another one, a failing feature).
    """
    for f in features:
        if f.key in enabled:
            missing = [r for r in f.requires if r not in enabled]
            if missing:
                names = ", ".join(next((g.label for g in features if g.key == r), r) for r in missing)
                raise ValueError(f"{f.label} needs {names} to be on")
    for f in features:
        if f.transform is not None and f.key in enabled:
            model = _run_feature(f, f.transform, model, enabled[f.key])
    options = accelerate_options(enabled, features)
    if options is not None:
        model = _run_feature(next(f for f in features if f.key == ATTENTION),
                             lambda m, _s: hf_accel.accelerate_model(m, **options), model, None)
    return model


def accelerate_options(enabled: dict[str, Any], features=FEATURES) -> dict | None:
    """The ``accelerate_model`` options of the enabled features (None: hf-accel attention is off, the right pane
    runs an unmodified copy). Raises ValueError with a page message for a bad setting."""
    if ATTENTION not in enabled:
        return None
    options = {}
    for f in features:
        if f.options is not None:
            options.update(_run_feature(f, f.options, f.key in enabled, enabled.get(f.key, f.setting_default)))
    return options


def uses_paged_cache(enabled: dict[str, Any], features=FEATURES) -> bool:
    """Whether the right pane's model decodes on hf-accel's paged cache (its fast decode path): hf-accel attention
    on, and the paged cache not switched off (``accelerate_model``'s default where the toggle is not shown)."""
    options = accelerate_options(enabled, features)
    return options is not None and options.get("paged_cache", True)


def _run_feature(feature: Feature, fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        raise ValueError(f"{feature.label}: {first_line(e)}") from None
    except Exception as e:
        log.warning("feature %s failed", feature.key, exc_info=True)
        raise ValueError(f"{feature.label}: {type(e).__name__}: {first_line(e)}") from None


def available_features(features=FEATURES) -> list[Feature]:
    return [f for f in features if f.available()]


def enabled_features(feats: list[Feature], values) -> dict:
    """{feature key: setting} of the toggled-on features, from the flat (checkbox, setting) UI values."""
    values = list(values)
    if len(values) != 2 * len(feats):
        raise ValueError("internal error: feature inputs do not match the feature list")
    return {f.key: values[2 * i + 1] for i, f in enumerate(feats) if values[2 * i]}
