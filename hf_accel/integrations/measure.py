"""Timing of ``model.generate()``: tokens/s, time to first token (TTFT) and peak memory.

Used by the CLI's side-by-side table and by the demo; it wraps an ordinary transformers streamer, so
it measures exactly what a user's ``generate`` call does.
"""

from __future__ import annotations

from collections.abc import Mapping

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer


class TimingStreamer(BaseStreamer):
    """A transformers streamer that timestamps every ``put`` and forwards to an optional inner streamer.

    transformers calls ``put`` once with the prompt ids, then once per generated step with the new
    token ids [batch] (or [batch, 1]); the first of those is the first token (TTFT).

    Args:
        inner: a streamer that gets every ``put`` / ``end`` as well (e.g. ``TextStreamer``), or None.
        sync_device: a CUDA device to synchronise before the first token's timestamp (so that TTFT counts the
            GPU work queued before it), or None.

    Attributes (seconds, ``time.perf_counter``): ``t_start`` (set by the caller, or at construction),
    ``t_first`` (first generated token; None until then), ``t_end`` (``end()``); ``steps``: generated steps seen.
    """

    def __init__(self, inner: BaseStreamer | None = None, sync_device: torch.device | None = None):
        self.inner = inner
        self.sync_device = sync_device
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.steps = 0
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
        else:
            if self.t_first is None:
                if self.sync_device is not None and self.sync_device.type == "cuda":
                    torch.cuda.synchronize(self.sync_device)
                self.t_first = time.perf_counter()
            self.steps += 1
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        self.t_end = time.perf_counter()
        if self.inner is not None:
            self.inner.end()


@dataclass
class GenerationStats:
    """What one timed ``generate`` call did (:func:`measure_generate`). Times in seconds, memory in bytes.

    Attributes:
        new_tokens: generated tokens summed over the batch, each row counted up to and including its first EOS
            (the padding after it is not counted).
        steps: decode steps, i.e. new positions of the returned sequences (the longest row).
        seconds: wall time of the whole ``generate`` call (prefill included; synchronised on CUDA).
        ttft_s: time to the first generated token, or None when no token was streamed.
        tokens_per_s: ``new_tokens / seconds``.
        peak_memory_bytes: ``torch.cuda.max_memory_allocated`` during the call; None off-GPU.
        sequences: [batch, prompt_len + steps] int64, what ``generate`` returned.
    """

    new_tokens: int  # generated tokens summed over the batch (padding after EOS not counted)
    steps: int  # decode steps (max new tokens over the batch)
    seconds: float  # wall time of the whole generate call
    ttft_s: float | None  # time to first generated token
    tokens_per_s: float  # new_tokens / seconds
    peak_memory_bytes: int | None  # torch.cuda.max_memory_allocated during the call (CUDA only)
    sequences: torch.Tensor = field(repr=False, default=None)  # [batch, prompt + new] token ids

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("sequences")
        return d


def _count_new_tokens(sequences: torch.Tensor, prompt_len: int, eos_ids) -> int:
    new = sequences[:, prompt_len:]
    if new.numel() == 0:
        return 0
    eos = torch.tensor(sorted(eos_ids), device=new.device) if eos_ids else None
    total = 0
    for row in new:
        n = row.numel()
        if eos is not None:
            hits = torch.isin(row, eos).nonzero()
            if hits.numel():
                n = int(hits[0, 0]) + 1
        total += n
    return total


def measure_generate(model, inputs: dict, streamer: BaseStreamer | None = None, **generate_kwargs) -> GenerationStats:
    """Run ``model.generate(**inputs, **generate_kwargs)`` once and time it.

    Args:
        model: any transformers generation model (accelerated or not).
        inputs: tokenizer output with ``input_ids`` [batch, prompt_len] int64 and optionally
            ``attention_mask`` [batch, prompt_len].
        streamer: optional streamer (e.g. ``TextStreamer``) that also receives the tokens.
        **generate_kwargs: passed to ``generate`` as they are (``max_new_tokens``, ``do_sample``, ...; not
            ``return_dict_in_generate``: the call must return the sequences tensor).

    Returns:
        :class:`GenerationStats`; tokens after the first EOS of a row are not counted.

    Raises:
        TypeError: ``inputs`` is not a mapping holding an ``input_ids`` tensor of shape [batch, prompt_len].
        Whatever ``model.generate`` raises for these arguments.
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a mapping (a tokenizer's output) holding input_ids, got "
                        f"{type(inputs).__name__}")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        got = f"a tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"inputs['input_ids'] must be a [batch, prompt_len] tensor, got {got}")
    device = ids.device
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timer = TimingStreamer(streamer, sync_device=device)
    t0 = time.perf_counter()
    timer.t_start = t0
    sequences = model.generate(**inputs, streamer=timer, **generate_kwargs)
    if on_cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    gen_config = getattr(model, "generation_config", None)
    eos = generate_kwargs.get("eos_token_id", getattr(gen_config, "eos_token_id", None))
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    prompt_len = inputs["input_ids"].shape[1]
    new_tokens = _count_new_tokens(sequences, prompt_len, eos_ids)
    return GenerationStats(
        new_tokens=new_tokens,
        steps=sequences.shape[1] - prompt_len,
        seconds=seconds,
        ttft_s=None if timer.t_first is None else timer.t_first - t0,
        tokens_per_s=new_tokens / seconds if seconds > 0 else float("nan"),
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if on_cuda else None,
        sequences=sequences,
    )
