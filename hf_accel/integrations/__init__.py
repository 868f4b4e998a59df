"""Glue between hf-accel's kernels and transformers / peft. No Triton kernels live here."""
