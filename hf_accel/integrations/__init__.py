"""Glue between hf-accel's kernels and transformers / peft. No Triton kernels live here.

Importing this package registers hf-accel's attention and mask functions in transformers (under the name
``hf_accel``): a model accelerated and saved with ``torch.save`` then loaded in another process (which imports
this package as it unpickles the model's ``generate``) finds the attention its config names.
"""

from hf_accel.integrations.attention import register

register()
