"""hf-accel: one-line LLM inference acceleration for Hugging Face transformers.

    import hf_accel
    model = hf_accel.accelerate_model(model)   # the one line
    model.generate(...)                        # unchanged
"""

from hf_accel.conversion import convert_to_gqa, expand_kv_heads
from hf_accel.integrations.measure import GenerationStats, TimingStreamer, measure_generate
from hf_accel.integrations.generate import speculative_stats
from hf_accel.integrations.patch import SUPPORTED_MODEL_TYPES, accelerate_model, is_accelerated, revert_model
from hf_accel.speculative import SpeculativeConfig

__version__ = "0.1.0"
__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SpeculativeConfig",
    "GenerationStats",
    "TimingStreamer",
    "accelerate_model",
    "convert_to_gqa",
    "expand_kv_heads",
    "is_accelerated",
    "measure_generate",
    "revert_model",
    "speculative_stats",
    "__version__",
]
