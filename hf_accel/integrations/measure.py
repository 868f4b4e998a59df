"""Timing of ``model.generate()``: tokens/s, time to first token (TTFT) and peak memory.

Used by the CLI's side-by-side table and by the demo. The time to first token comes from an ordinary
transformers streamer passed to the call, so what is timed is the call with a streamer attached; where a streamer
changes the call's path (speculative decoding at batch > 1 runs plain decoding with one; beam search takes none),
``time_first_token=False`` times the call exactly as given.
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
        sync_device: a CUDA device (``torch.device``, ``"cuda:0"``, or an index) to synchronise before the first
            token's timestamp (so that TTFT counts the GPU work queued before it); a CPU device or None: no sync.

    Attributes (seconds, ``time.perf_counter``): ``t_start`` (set by the caller, or at construction),
    ``t_first`` (first generated token; None until then), ``t_end`` (``end()``); ``steps``: ``put`` calls after the
    prompt's (one per decode step; one per round of several tokens in assisted generation); ``tokens``: positions
    generated per row (a ``put`` of [batch, n] ids adds n). A ``put`` after ``end()`` starts a new measurement (the
    next call's prompt): ``t_start`` is then that ``put``'s time.

    Raises:
        ValueError: ``sync_device`` names no device (``torch.device`` cannot parse it).
    """

    def __init__(self, inner: BaseStreamer | None = None, sync_device: torch.device | str | int | None = None):
        self.inner = inner
        if sync_device is not None and not isinstance(sync_device, torch.device):
            try:
                sync_device = torch.device(sync_device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"sync_device must be a torch.device, a device string or an index, got "
                                 f"{sync_device!r}: {e}") from None
        self.sync_device = sync_device
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.steps = 0
        self.tokens = 0
        self._prompt_seen = False

    def put(self, value):
        if self.t_end is not None:  # a new call on the same streamer: a new measurement
            self.t_start, self.t_first, self.t_end = time.perf_counter(), None, None
            self.steps = self.tokens = 0
            self._prompt_seen = False
        if not self._prompt_seen:
            self._prompt_seen = True
        else:
            if self.t_first is None:
                if self.sync_device is not None and self.sync_device.type == "cuda":
                    torch.cuda.synchronize(self.sync_device)
                self.t_first = time.perf_counter()
            self.steps += 1
            self.tokens += int(value.shape[-1]) if getattr(value, "dim", None) and value.dim() == 2 else 1
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
        ttft_s: time to the first generated token, or None when no token was streamed (none generated, or the
            call timed without a streamer: beam search, ``time_first_token=False``).
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


_UNSET = object()


def _call_option(model, generate_kwargs: dict, name: str):
    """The value ``generate`` uses for generation option ``name``: the call's keyword, else the call's
    ``generation_config``'s (where set), else the model's ``generation_config``'s; None where none sets it."""
    value = generate_kwargs.get(name, _UNSET)
    if value is not _UNSET:
        return value
    for config in (generate_kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _eos_ids(eos) -> set[int]:
    """EOS ids given as None, an int, a list/tuple of ints or a tensor, as a set."""
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        return {int(v) for v in eos.flatten().tolist()}
    if isinstance(eos, int):
        return {eos}
    return {int(v) for v in eos}


def measure_generate(model, inputs: dict, streamer: BaseStreamer | None = None, *, time_first_token: bool = True,
                     **generate_kwargs) -> GenerationStats:
    """Run ``model.generate(**inputs, **generate_kwargs)`` once and time it.

    Args:
        model: any transformers generation model (accelerated or not).
        inputs: tokenizer output with ``input_ids`` [batch, prompt_len] int64 and optionally
            ``attention_mask`` [batch, prompt_len].
        streamer: optional streamer (e.g. ``TextStreamer``) that also receives the tokens.
        time_first_token: time the first token through a :class:`TimingStreamer` passed to ``generate`` (default).
            False passes no streamer of ours (``ttft_s`` is None; a ``streamer`` given still gets the tokens): the
            call runs exactly as given, which matters where a streamer changes its path (speculative decoding at
            batch > 1 runs plain decoding with a streamer).
            Beam search (``num_beams`` > 1) takes no streamer: it is timed without one.
        **generate_kwargs: passed to ``generate`` as they are (``max_new_tokens``, ``generation_config``,
            ``do_sample``, ...). With ``return_dict_in_generate`` the stats read the output's ``sequences``.

    Returns:
        :class:`GenerationStats`; tokens after the first EOS of a row are not counted (the EOS ids the call uses:
        its ``eos_token_id``, else its ``generation_config``'s, else the model's).

    Raises:
        TypeError: ``inputs`` is not a mapping holding an ``input_ids`` tensor of shape [batch, prompt_len], or
            ``inputs`` holding a ``streamer``.
        Whatever ``model.generate`` raises for these arguments.
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a mapping (a tokenizer's output) holding input_ids, got "
                        f"{type(inputs).__name__}")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        got = f"a tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"inputs['input_ids'] must be a [batch, prompt_len] tensor, got {got}")
    if "streamer" in inputs:
        raise TypeError("inputs holds a 'streamer': measure_generate takes it as its own `streamer` argument")
    device = ids.device
    on_cuda = device.type == "cuda"
    beams = _call_option(model, generate_kwargs, "num_beams")
    timer = None
    if time_first_token and not (isinstance(beams, int) and beams > 1):
        timer = TimingStreamer(streamer, sync_device=device)
    call_streamer = timer if timer is not None else streamer
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if timer is not None:
        timer.t_start = t0
    out = model.generate(**inputs, **({"streamer": call_streamer} if call_streamer is not None else {}),
                         **generate_kwargs)
    if on_cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if not isinstance(sequences, torch.Tensor):
        raise TypeError(f"generate returned {type(out).__name__}, neither a tensor of token ids nor an output "
                        "with `sequences`")
    eos_ids = _eos_ids(_call_option(model, generate_kwargs, "eos_token_id"))
    prompt_len = ids.shape[1]
    new_tokens = _count_new_tokens(sequences, prompt_len, eos_ids)
    return GenerationStats(
        new_tokens=new_tokens,
        steps=sequences.shape[1] - prompt_len,
        seconds=seconds,
        ttft_s=None if timer is None or timer.t_first is None else timer.t_first - t0,
        tokens_per_s=new_tokens / seconds if seconds > 0 else float("nan"),
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if on_cuda else None,
        sequences=sequences,
    )
