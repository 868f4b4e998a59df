"""Triton kernels of hf-accel, each with a launcher and a pure-PyTorch reference.

Nothing in this package imports transformers.
"""

from hf_accel.kernels.attention import attention, attention_ref

__all__ = ["attention", "attention_ref"]
