"""The device state of one speculative ``generate`` call, which every captured round graph reads and updates."""

from __future__ import annotations

import torch

from hf_accel.kernels.argmax import scratch_for
from hf_accel.kernels.commit_tokens import INFO_SIZE, MAX_DRAFT, TOTALS_SIZE


class RoundState:
    """Device state of one generate call (static buffers; the round graphs read and update them).

    tokens [batch, capacity] int64 (prompt with its left padding, then output; pad after a row's end),
    lengths / starts / remaining [batch] int64, active [batch] bool, info [INFO_SIZE] int64 (this round's
    counters, layout in :mod:`hf_accel.kernels.commit_tokens`), totals [TOTALS_SIZE] int64 (drafts proposed,
    accepted, row-steps, tokens they committed, rounds per k that had an active row); for match-gated prompt
    lookup the next round's lookup: drafts [batch, k_max] int64, valid [batch, k_max] bool and ngram [batch]
    int64 (match class). One state per graph key, reused by every call
    of that shape (captured graphs read these very tensors)."""

    NAMES = ("tokens", "lengths", "starts", "remaining", "active", "info", "totals", "drafts", "valid", "ngram")

    def __init__(self, batch: int, capacity: int, device, k_max: int = 1):
        self.tokens = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.lengths = torch.ones(batch, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)
        self.remaining = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.info = torch.zeros(INFO_SIZE, dtype=torch.long, device=device)
        self.totals = torch.zeros(TOTALS_SIZE, dtype=torch.long, device=device)
        self.eos = torch.full((8,), -1, dtype=torch.long, device=device)
        self.eos_ids: tuple = ()  # the EOS ids in eos (-1 after them); kept across calls, rewritten when they change
        self.drafts = torch.zeros(batch, k_max, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, k_max, dtype=torch.bool, device=device)
        self.ngram = torch.zeros(batch, dtype=torch.long, device=device)
        self._host = None  # host_counters: (host rows, their numpy view)
        #: the rounds' counters written by a kernel into page-locked memory
        #: (:class:`~hf_accel.kernels.host_counters.HostCounters`; set by the engine), or None: copied after each round
        self.host = None
        self._argmax = None  # argmax_scratch: argmax_rows' scratch for every k of this state

    def argmax_scratch(self, vocab: int):
        """:func:`~hf_accel.kernels.argmax.argmax_rows`' scratch for ``batch x (k + 1)`` rows of any k <=
        ``MAX_DRAFT``, made once (the rounds' captured graphs all use these tensors)."""
        if self._argmax is None or self._argmax[0] != vocab:
            self._argmax = (vocab, scratch_for(self.tokens.shape[0] * (MAX_DRAFT + 1), vocab, self.tokens.device))
        return self._argmax[1]

    def reset(self, pad: int) -> None:
        self.tokens.fill_(pad)
        self.lengths.fill_(1)
        for t in (self.starts, self.remaining, self.info, self.totals, self.drafts, self.ngram):
            t.zero_()
        self.active.zero_()
        self.valid.zero_()
        if self.host is not None:
            self.host.reset()

    def host_counters(self, pinned: bool):
        """Three host rows of ``info``'s size (page-locked when ``pinned``: the rounds' counters are copied
        there without blocking) and their numpy view, made once per state: the host reads a few counters per
        round, and numpy indexing is cheaper than tensor indexing."""
        if self._host is None or self._host[0].is_pinned() != pinned:
            rows = torch.zeros(3, self.info.numel(), dtype=torch.long, pin_memory=pinned)
            self._host = (rows, rows.numpy())
        return self._host

    def snapshot(self):
        return [getattr(self, n).clone() for n in self.NAMES]

    def restore(self, saved) -> None:
        for n, t in zip(self.NAMES, saved):
            getattr(self, n).copy_(t)
