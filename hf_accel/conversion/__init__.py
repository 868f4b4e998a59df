"""Checkpoint conversion between attention layouts: MHA -> GQA / MQA by K/V head pooling
(Ainslie et al. 2023, "GQA", §3.1), with calibrated variants, exact head expansion and permutation,
and an optional LoRA recovery fine-tune."""

from hf_accel.conversion.gqa import (
    GROUPINGS,
    METHODS,
    convert_to_gqa,
    expand_choices,
    expand_kv_heads,
    kv_cache_bytes_per_token,
    kv_head_choices,
    permute_kv_heads,
)
from hf_accel.conversion.recovery import recover_with_lora

__all__ = [
    "GROUPINGS",
    "METHODS",
    "convert_to_gqa",
    "expand_choices",
    "expand_kv_heads",
    "kv_cache_bytes_per_token",
    "kv_head_choices",
    "permute_kv_heads",
    "recover_with_lora",
]
