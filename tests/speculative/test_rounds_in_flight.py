"""Rounds queued ahead of the counters the host has read (CPU, float32).

On the GPU the host queues the next round before it reads the last one's counters (ungated chooser, batch >
1 by default). A burst of plain rounds chosen from counters a round old used to run past every row's token
budget, by up to a burst (seen on the H100: 133 rounds for 127 tokens at bs8 on open-ended prompts). Here
the eager engine queues one round ahead as the GPU path does, the chooser always backs off in bursts of 8,
and the rounds run are counted.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_accel import SpeculativeConfig, accelerate_model
from hf_accel.speculative.draft_length import _KChooser
from hf_accel.speculative.engine import SpeculativeEngine

from speculative_helpers import LAYERS, greedy


@pytest.mark.parametrize("new_tokens", [21, 26])
def test_plain_bursts_in_flight_never_run_past_the_budget(new_tokens, tiny, monkeypatch):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = tiny.batch(seed=3, lengths=(9, 6))
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=new_tokens)
    rounds = []
    run_round = SpeculativeEngine._round

    def spy_round(engine, k, st, ctx):
        rounds.append(k)
        run_round(engine, k, st, ctx)

    budgets = []

    def choose(self, max_remaining, burst=True):
        budgets.append(max_remaining)
        return 0, min(8, max_remaining)

    monkeypatch.setattr(SpeculativeEngine, "_round", spy_round)
    monkeypatch.setattr(SpeculativeEngine, "_rounds_ahead", staticmethod(lambda graphs, streaming, gated: 1))
    monkeypatch.setattr(_KChooser, "choose", choose)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", match_gated=False))
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=new_tokens)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    # the prefill gives the first token; every round one more per row: new_tokens - 1 rounds, not one more
    assert len(rounds) == new_tokens - 1, (len(rounds), budgets)
    assert len(budgets) >= 3 and budgets[1] < budgets[0], budgets  # the second burst saw the first in flight
