"""Speculative decoding: prompt lookup, early-exit self-speculation and draft models, verified on the
paged cache by the fast decode step (see :mod:`hf_accel.speculative.engine`)."""

from hf_accel.speculative.config import METHODS, SpeculativeConfig
from hf_accel.speculative.engine import SpeculativeEngine
from hf_accel.speculative.proposers import prompt_lookup
from hf_accel.speculative.verify import greedy_accept, rejection_sample

__all__ = ["METHODS", "SpeculativeConfig", "SpeculativeEngine", "greedy_accept", "prompt_lookup", "rejection_sample"]
