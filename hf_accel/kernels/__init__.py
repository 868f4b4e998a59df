"""Triton kernels of hf-accel, one op per module, each with a launcher and a pure-PyTorch reference
(e.g. :mod:`hf_accel.kernels.attention`). Nothing in this package imports transformers.

The launchers take CUDA tensors, or CPU tensors when Triton's interpreter is on (``TRITON_INTERPRET=1`` set
before hf_accel is imported; slow, for tests); a CPU tensor otherwise raises ValueError
(:func:`hf_accel.kernels.device.check_launch_device`) naming the PyTorch equivalent: the op's ``*_ref``
function, or for ``gemv`` / ``gemv_rope`` / ``fused_linear_rope``
:func:`~hf_accel.kernels.fused_linear.fused_linear_ref` and for ``argmax_rows`` ``torch.argmax``."""
