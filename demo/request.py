"""What one Generate click asks for: the form's values checked and turned into ``generate()`` arguments.

:func:`validate_request` checks the prompt and the generation settings and returns them as
:class:`GenSettings`, or raises ``ValueError`` whose text is the message the page shows;
:func:`generate_kwargs` makes the keyword arguments of ``model.generate`` from them. :func:`parse_int`
and :func:`first_line` are the two ways the demo turns a UI value or an exception into such a one-line
message (the feature settings and the model loading use them too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The most new tokens a request may ask for: the slider's end, the request check and the launcher's flag.
MAX_NEW_TOKENS = 1024

EMPTY_PROMPT_MESSAGE = "Please enter a prompt: the prompt box is empty."
RUN_MODES = {
    "concurrent": "Both at once (two threads sharing the device)",
    "sequential": "One after the other (each gets the whole device)",
}
DECODING = ("Greedy", "Sampling")


@dataclass(frozen=True)
class GenSettings:
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    run_mode: str


def validate_request(prompt, max_new_tokens, decoding, temperature, top_p, run_mode) -> tuple[str, GenSettings]:
    """Check the form; returns (stripped prompt, settings) or raises ValueError with the page message."""
    text = (prompt or "").strip()
    if not text:
        raise ValueError(EMPTY_PROMPT_MESSAGE)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: not text a tokenizer takes
        raise ValueError("The prompt holds characters that are not valid Unicode text") from None
    n = parse_int(max_new_tokens, "Max new tokens")
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise ValueError(f"Max new tokens must be between 1 and {MAX_NEW_TOKENS} (got {n})")
    if decoding not in DECODING:
        raise ValueError(f"Decoding must be one of {', '.join(DECODING)} (got {decoding!r})")
    do_sample = decoding == "Sampling"
    try:
        temperature, top_p = float(temperature), float(top_p)
    except (TypeError, ValueError):
        raise ValueError("Temperature and top-p must be numbers") from None
    if do_sample and not 0 < temperature < math.inf:
        raise ValueError(f"Temperature must be > 0 and finite for sampling (got {temperature})")
    if do_sample and not 0 < top_p <= 1:
        raise ValueError(f"Top-p must be in (0, 1] (got {top_p})")
    if run_mode not in RUN_MODES:
        raise ValueError(f"unknown run mode {run_mode!r}")
    return text, GenSettings(n, do_sample, temperature, top_p, run_mode)


def cap_to_context(max_new_tokens: int, prompt_len: int, max_positions) -> tuple[int, str | None]:
    """``max_new_tokens`` capped where prompt + answer would run past the model's ``max_positions``
    (``max_position_embeddings``; None: not capped), and a note saying so (None when not capped). Both panes
    would otherwise generate past the positions the model was trained for, as the CLI's cap avoids too.

    Raises:
        ValueError: the prompt alone fills the context (the page message)."""
    if not max_positions or prompt_len + max_new_tokens <= max_positions:
        return max_new_tokens, None
    if prompt_len >= max_positions:
        raise ValueError(f"The prompt ({prompt_len} tokens) fills the model's context ({max_positions} positions)")
    n = max_positions - prompt_len
    return n, (f"capped to {n} new tokens: the {prompt_len}-token prompt and {max_new_tokens} new tokens would run "
               f"past the model's context of {max_positions} positions")


def generate_kwargs(settings: GenSettings, pad_token_id) -> dict:
    kw = dict(max_new_tokens=settings.max_new_tokens, do_sample=settings.do_sample, pad_token_id=pad_token_id)
    if settings.do_sample:
        kw.update(temperature=settings.temperature, top_p=settings.top_p)
    else:  # keep the model's generation_config from adding sampling knobs to a greedy run
        kw.update(temperature=None, top_p=None, top_k=None)
    return kw


def parse_int(value, what: str) -> int:
    """An integer from a UI number/text value, or ValueError with a readable message."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a whole number (got {value!r})") from None
    if not math.isfinite(f) or f != int(f):
        raise ValueError(f"{what} must be a whole number (got {value!r})")
    return int(f)


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
