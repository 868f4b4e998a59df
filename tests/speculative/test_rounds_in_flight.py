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


@pytest.mark.parametrize("bursts", [False, True])
def test_backed_off_rounds_in_flight_stop_soon_after_the_answers_end(bursts, tiny, monkeypatch):
    """An answer that ends with its end-of-sequence token long before ``max_new_tokens``, the ungated chooser
    backed off (plain rounds; probes draft the smallest k), the host one queued item ahead as on the GPU. With
    plain bursts (``UNGATED_PLAIN_BURSTS_FROM_BATCH`` = 1, the default before; now only from batch 2) two bursts of
    8 were queued when the host read that the row had finished, and all ran; one round per item leaves at most one
    round past the end."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = tiny.batch(seed=3, lengths=(9,))
    answer = greedy(model, ids, mask, tiny.PAD, max_new_tokens=40)[0, ids.shape[1]:].tolist()
    end = next(i for i in range(3, len(answer)) if answer[i] not in answer[:i])  # a token seen first at i >= 3
    eos = answer[end]
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=40, eos_token_id=eos)
    assert stock.shape[1] == ids.shape[1] + end + 1  # the stock answer ends at that token
    surplus = []
    run_round = SpeculativeEngine._round

    def spy_round(engine, k, st, ctx):
        surplus.append(not bool(st.active[:1].any()))  # a round queued after the row had finished
        run_round(engine, k, st, ctx)

    monkeypatch.setattr(SpeculativeEngine, "_round", spy_round)
    monkeypatch.setattr(SpeculativeEngine, "_rounds_ahead", staticmethod(lambda graphs, streaming, gated: 1))
    monkeypatch.setattr(_KChooser, "_best", lambda self, ks: min(ks))  # backed off: plain rounds, small probes
    if bursts:  # else the default: batch 1 goes one round per item
        monkeypatch.setattr("hf_accel.speculative.draft_length.UNGATED_PLAIN_BURSTS_FROM_BATCH", 1)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", match_gated=False))
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    if bursts:
        assert sum(surplus) >= 8, surplus  # the second burst of 8 ran whole after the end
    else:
        assert sum(surplus) <= 1, surplus


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_plain_bursts_by_default_only_in_batches(rows, tiny, monkeypatch):
    """The ungated chooser is asked for bursts of plain rounds in calls of 2 or more rows, one round per queued
    item at batch 1 (``UNGATED_PLAIN_BURSTS_FROM_BATCH``: on an H100 bursts were 1-2.5% faster at bs8, one round
    per item up to 13% faster at bs1 on answers that end early)."""
    asked = []
    original = _KChooser.choose

    def choose(self, max_remaining, burst=True):
        asked.append(burst)
        return original(self, max_remaining, burst)

    monkeypatch.setattr(_KChooser, "choose", choose)
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = tiny.batch(seed=3, lengths=(9, 6, 8)[:rows])
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=12)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", match_gated=False))
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=12)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert asked and set(asked) == {rows >= 2}, asked
