"""Triton kernels of hf-accel, one op per module, each with a launcher and a pure-PyTorch reference
(e.g. :mod:`hf_accel.kernels.attention`). Nothing in this package imports transformers.

The launchers take CUDA tensors, or CPU tensors when Triton's interpreter is on (``TRITON_INTERPRET=1`` set
before hf_accel is imported; slow, for tests); a CPU tensor otherwise raises ValueError
(:func:`hf_accel.kernels.device.check_launch_device`) and the ``*_ref`` functions are the way to go."""
