"""The rounds' counters read from the ring a kernel writes (``HOST_MAPPED_COUNTERS``) or from copies: the same tokens,
the same choices of k and the same statistics (CPU, float32; the eager rounds publish as the graphs' replays do)."""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, greedy, repetitive_batch, truncated

from hf_accel import SpeculativeConfig, accelerate_model, speculative_stats
from hf_accel.kernels.host_counters import HostCounters
from hf_accel.speculative import draft_length
from hf_accel.speculative import engine as spec_engine


def _config(method, model):
    if method == "prompt_lookup-gated":
        return SpeculativeConfig("prompt_lookup")
    if method == "prompt_lookup-ungated":
        return SpeculativeConfig("prompt_lookup", match_gated=False)
    if method == "early_exit":
        return SpeculativeConfig("early_exit", exit_layer=2)
    return SpeculativeConfig("draft_model", draft_model=truncated(model, 2))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("method", ["prompt_lookup-gated", "prompt_lookup-ungated", "early_exit", "draft_model"])
def test_polled_counters_give_what_copied_counters_give(method, rows, tiny, monkeypatch):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=(14, 9, 6)[:rows])
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
    waits = []
    wait = HostCounters.wait

    def counted(self, number):
        waits.append(number)
        return wait(self, number)

    monkeypatch.setattr(HostCounters, "wait", counted)
    # the choosers' round times: their priors, not the wall clock of eager rounds (which would vary the choices)
    monkeypatch.setattr(draft_length, "_record_time", lambda times, k, seconds: None)
    stats = {}
    for mapped in (True, False):
        monkeypatch.setattr(spec_engine, "HOST_MAPPED_COUNTERS", mapped)
        ours = accelerate_model(copy.deepcopy(model), speculative=_config(method, model))
        waits.clear()
        for _ in range(2):  # a second call on the same state (round numbers start again)
            out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
            assert torch.equal(out, stock), f"mapped={mapped}\nstock:\n{stock}\nours:\n{out}"
        s = speculative_stats(ours)
        stats[mapped] = {k: v for k, v in s.items() if k != "round_ms"}
        if mapped:  # every queued item read from the ring, the numbers counted from 1 in each call
            assert waits and waits[0] == 1 and waits.count(1) == 2, waits
        else:
            assert not waits
    assert stats[True] == stats[False]
