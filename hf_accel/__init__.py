"""hf-accel: one-line LLM inference acceleration for Hugging Face transformers.

    import hf_accel
    model = hf_accel.accelerate_model(model)   # the one line
    model.generate(...)                        # unchanged
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The public names are imported on first use (PEP 562), so that `import hf_accel.cli` (and the command
# line's argument errors) does not wait for torch and transformers to load.
_EXPORTS = {
    "convert_to_gqa": "hf_accel.conversion",
    "expand_kv_heads": "hf_accel.conversion",
    "GenerationStats": "hf_accel.integrations.measure",
    "TimingStreamer": "hf_accel.integrations.measure",
    "measure_generate": "hf_accel.integrations.measure",
    "speculative_stats": "hf_accel.integrations.call_state",
    "cache_in_use": "hf_accel.integrations.call_state",
    "last_cache_stats": "hf_accel.integrations.call_state",
    "SUPPORTED_MODEL_TYPES": "hf_accel.integrations.patch",
    "accelerate_model": "hf_accel.integrations.patch",
    "is_accelerated": "hf_accel.integrations.patch",
    "revert_model": "hf_accel.integrations.patch",
    "SpeculativeConfig": "hf_accel.speculative",
}
# Subpackages reachable as attributes after `import hf_accel` (`hf_accel.models.load_default_model(...)`,
# `hf_accel.cache.PagedCache`), imported on first use.
_SUBMODULES = ("cache", "conversion", "engine", "integrations", "kernels", "models", "speculative")

if TYPE_CHECKING:
    from hf_accel.conversion import convert_to_gqa, expand_kv_heads
    from hf_accel.integrations.call_state import cache_in_use, last_cache_stats, speculative_stats
    from hf_accel.integrations.measure import GenerationStats, TimingStreamer, measure_generate
    from hf_accel.integrations.patch import SUPPORTED_MODEL_TYPES, accelerate_model, is_accelerated, revert_model
    from hf_accel.speculative import SpeculativeConfig


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"hf_accel.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


__version__ = "0.1.0"
__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SpeculativeConfig",
    "GenerationStats",
    "TimingStreamer",
    "accelerate_model",
    "cache_in_use",
    "convert_to_gqa",
    "expand_kv_heads",
    "is_accelerated",
    "last_cache_stats",
    "measure_generate",
    "revert_model",
    "speculative_stats",
    "__version__",
]
