"""Triton kernels of hf-accel, one op per module, each with a launcher and a pure-PyTorch reference
(e.g. :mod:`hf_accel.kernels.attention`). Nothing in this package imports transformers."""
