"""Quality measurement on fixed real text: perplexity over Python's bundled ``pydoc_data`` topics."""

from hf_accel.evaluation.perplexity import PerplexityResult, perplexity
from hf_accel.evaluation.texts import (
    calibration_text,
    evaluation_ids,
    pydoc_topics_fingerprint,
    pydoc_topics_text,
)

__all__ = [
    "PerplexityResult",
    "calibration_text",
    "evaluation_ids",
    "perplexity",
    "pydoc_topics_fingerprint",
    "pydoc_topics_text",
]
