"""The fixed evaluation text: Python's bundled ``pydoc_data.topics`` (the help() topics of the
language reference), which ships with every CPython, so it needs no download.

* Full text: the topic texts in sorted key order, joined by one blank line ("\\n\\n").
* Evaluation tokens: the first ``max_tokens`` tokens of the full text (no special tokens added).
* Calibration text: the last topics in the same order (a suffix of whole topics), disjoint from the
  evaluation tokens as long as the two together stay under the text's length (checked).

The text differs between Python releases, so results record :func:`pydoc_topics_fingerprint`.
"""

from __future__ import annotations

import hashlib
import platform

import torch

from hf_accel._checks import check_int

SEPARATOR = "\n\n"


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def pydoc_topics_text() -> str:
    """All topic texts of ``pydoc_data.topics`` in sorted key order, joined by a blank line."""
    topics = _topics()
    return SEPARATOR.join(topics[k] for k in sorted(topics))


def pydoc_topics_fingerprint() -> dict:
    """Python version, topic count, length in characters and SHA-256 of :func:`pydoc_topics_text`."""
    text = pydoc_topics_text()
    return {
        "source": "pydoc_data.topics (sorted keys, joined by a blank line)",
        "python": platform.python_version(),
        "topics": len(_topics()),
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


def evaluation_ids(tokenizer, max_tokens: int = 16384) -> torch.Tensor:
    """The first ``max_tokens`` tokens of :func:`pydoc_topics_text`.

    Args:
        tokenizer: the model's tokenizer (no special tokens are added).
        max_tokens: how many tokens to keep; must be >= 2.

    Returns:
        [1, n] int64 token ids, n = min(max_tokens, tokens in the text).

    Raises:
        ValueError: ``max_tokens`` not an int >= 2.
    """
    max_tokens = check_int(max_tokens, "max_tokens", minimum=2)
    ids = tokenizer(pydoc_topics_text(), return_tensors="pt", add_special_tokens=False).input_ids
    return ids[:, :max_tokens]


def calibration_text(max_chars: int = 40_000, *, avoid_tokens: int = 16384, tokenizer=None) -> str:
    """The shortest suffix of whole topics of :func:`pydoc_topics_text` with at least ``max_chars``
    characters (the last topics in sorted order), for calibration and recovery fine-tuning.

    Args:
        max_chars: wanted length in characters (the suffix starts at a topic boundary, so it can be a
            little longer).
        avoid_tokens: the evaluation prefix, in tokens, that must not overlap; checked when
            ``tokenizer`` is given, else checked conservatively assuming up to 16 characters a token.
        tokenizer: the model's tokenizer, for the exact overlap check.

    Raises:
        ValueError: ``max_chars`` not an int >= 1, ``avoid_tokens`` not an int >= 0, or the suffix would overlap
            the evaluation prefix.
    """
    max_chars = check_int(max_chars, "max_chars", minimum=1)
    avoid_tokens = check_int(avoid_tokens, "avoid_tokens", minimum=0)
    topics = _topics()
    texts = [topics[k] for k in sorted(topics)]
    taken: list[str] = []
    length = 0
    while texts and length < max_chars:
        taken.insert(0, texts.pop())
        length += len(taken[0]) + len(SEPARATOR)
    suffix = SEPARATOR.join(taken)
    full = pydoc_topics_text()
    start = len(full) - len(suffix)
    if avoid_tokens == 0:  # no evaluation prefix to keep clear of
        eval_end = 0
    elif tokenizer is not None:
        ids = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        offsets = ids["offset_mapping"]
        eval_end = offsets[min(avoid_tokens, len(offsets)) - 1][1]
    else:
        eval_end = avoid_tokens * 16
    if start < eval_end:
        raise ValueError(
            f"a calibration text of {max_chars} characters would overlap the first {avoid_tokens} "
            f"evaluation tokens (it starts at character {start}, they end at {eval_end})"
        )
    return suffix
