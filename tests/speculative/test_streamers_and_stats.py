"""Speculative ``generate`` with a streamer, and the statistics a call reports (speculative_stats).

A streamer gets every committed token once, in the shapes transformers' plain or assisted loop gives it; with a
streamer the adaptive draft length gets the real budget; several rows with a streamer decode plainly. The
counters add up to the new tokens when an EOS ends the call early, and a call that does not decode
speculatively clears them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, _messages, greedy, repetitive_batch, truncated
from transformers.generation.streamers import BaseStreamer

from hf_accel import SpeculativeConfig, accelerate_model, speculative_stats
from hf_accel.speculative import draft_length
from hf_accel.speculative.draft_length import _KChooser


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_streamer_gets_every_committed_token_once(tiny):
    """A model accelerated with speculative=: the call is a plain generate, so the streamer gets what transformers'
    plain loop gives it (one [1] tensor per token), also when a verify step commits several tokens. A call with
    transformers' assisted-generation arguments: [1, n] per verify step, as transformers' assisted loop puts them."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    stock = _Recorder()
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=None, streamer=stock)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", adaptive=False,
                                                                               draft_model=truncated(model, LAYERS)))
    rec = _Recorder()
    out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, streamer=rec)
    assert torch.equal(out, want) and speculative_stats(ours)["accepted_tokens"] > 0
    assert rec.ends == 1 and len(rec.puts) == len(stock.puts)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(rec.puts, stock.puts))

    assisted = accelerate_model(copy.deepcopy(model))
    rec = _Recorder()
    out = greedy(assisted, ids, mask, tiny.PAD, eos_token_id=None, streamer=rec, assistant_model=truncated(model, LAYERS))
    assert torch.equal(out, want) and rec.ends == 1 and torch.equal(rec.puts[0], ids)
    assert torch.cat([p.flatten() for p in rec.puts[1:]]).tolist() == out[0, ids.shape[1]:].tolist()
    assert all(p.dim() == 2 and p.shape[0] == 1 for p in rec.puts[1:])
    assert any(p.numel() > 1 for p in rec.puts[1:])  # several tokens per verify step


@pytest.mark.parametrize("plain_bursts", [False, True])
@pytest.mark.parametrize("method", ["draft_model", "early_exit"])
def test_streamer_gives_the_adaptive_draft_length_the_real_budget(method, plain_bursts, tiny, monkeypatch):
    """With a streamer the engine asks the chooser for one round per host sync (``burst=False``) with the row's
    real token budget; it passed a budget of 1 token instead, which allows no drafts (k < budget), so with a
    streamer the draft model and early exit ran their first 16 rounds plain
    (test_k_chooser_with_a_streamer_drafts_as_without_one_one_round_per_sync: the choices then equal those
    without a streamer)."""
    asked = []
    original = _KChooser.choose

    def choose(self, max_remaining, burst=True):
        asked.append((max_remaining, burst))
        return original(self, max_remaining, burst)

    monkeypatch.setattr(_KChooser, "choose", choose)
    monkeypatch.setattr(draft_length, "UNGATED_PLAIN_BURSTS_FROM_BATCH", 1 if plain_bursts else 2)
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    config = (SpeculativeConfig("early_exit", exit_layer=2) if method == "early_exit"
              else SpeculativeConfig("draft_model", draft_model=truncated(model, 2)))
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    ours = accelerate_model(copy.deepcopy(model), speculative=config)
    for streamer in (_Recorder(), None):
        asked.clear()
        greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, streamer=streamer, max_new_tokens=20)
        # 20 new tokens, one from the prefill; plain bursts only without a streamer, where they are on
        bursts = streamer is None and plain_bursts
        assert asked and asked[0] == (19, bursts), asked
        assert {b for _, b in asked} == {bursts}


def test_streamer_with_several_rows_takes_the_plain_fast_path(tiny, hf_log):
    """A verify step commits a different number of tokens per row, which a streamer ([batch] per put) cannot
    take: such calls decode without speculation (logged), and every put holds one token of each row."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", adaptive=False))
    rec = _Recorder()
    out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, streamer=rec)
    assert torch.equal(out, stock)
    assert speculative_stats(ours) is None
    assert _messages(hf_log, "speculative decoding not used: a streamer with more than one row")
    assert rec.ends == 1 and torch.equal(rec.puts[0], ids)
    assert all(p.shape == (ids.shape[0],) for p in rec.puts[1:])
    assert torch.equal(torch.stack(rec.puts[1:], 1), out[:, ids.shape[1]:])


@pytest.mark.parametrize("options", [{}, {"match_gated": False}, {"adaptive": False}],
                         ids=["gated", "ungated-bursts", "fixed-k"])
def test_counters_add_up_to_the_tokens_when_eos_ends_early(options, tiny, monkeypatch):
    """bs1, EOS in the middle of a 20-token budget: plain steps + verify steps x tokens per verify step + the
    prefill token = the new tokens, however many rounds the host queued past the end. The ungated chooser
    is made to run a verify round, then bursts of 8 plain rounds, so that a burst runs past the EOS."""
    if options.get("match_gated") is False:
        picks = []

        def choose(self, max_remaining, burst=True):
            picks.append(len(picks))
            return (3, 1) if len(picks) == 1 else (0, 8)

        monkeypatch.setattr(_KChooser, "choose", choose)
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[:1, mask[0].argmax():], mask[:1, mask[0].argmax():]
    new = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(new) if 4 <= i and t not in new[:i])
    n_new = new.index(eos) + 1
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=3,
                                                                               **options))
    for _ in range(2):
        out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=eos)
        assert out[0, ids.shape[1]:].tolist() == new[:n_new]
        s = speculative_stats(ours)
        from_verify = s["mean_tokens_per_step"] * s["verify_steps"] if s["verify_steps"] else 0
        assert from_verify + s["backed_off_steps"] + 1 == pytest.approx(n_new), s
        assert sum(s["draft_lengths"].values()) == s["verify_steps"] + s["backed_off_steps"]
        assert s["round_ms"] and all(v > 0 for v in s["round_ms"].values()), s  # measured per k that ran
        assert set(s["draft_lengths"]) <= set(s["round_ms"]) | {"0"}, s


def test_stats_are_cleared_by_a_call_that_does_not_decode_speculatively(tiny, hf_log):
    """A call that takes transformers' loop (a repetition penalty, beams) or keeps transformers' cache
    (use_cache=False) reports None, not the counters of the speculative call before it."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup")
    for other in ({"repetition_penalty": 1.3}, {"num_beams": 2}, {"use_cache": False}):
        greedy(ours, ids[:1], mask[:1], tiny.PAD, max_new_tokens=6, eos_token_id=None)
        assert speculative_stats(ours) is not None
        greedy(ours, ids[:1], mask[:1], tiny.PAD, max_new_tokens=6, eos_token_id=None, **other)
        assert speculative_stats(ours) is None, other
