"""A draft model while the adaptive draft length is backed off (CPU, float32).

Plain rounds must not run the draft model; its paged cache lags and one forward over a fixed window of
committed tokens catches it up right before the next round that drafts. Checked: greedy output equals
plain greedy (left-padded batch, EOS in the middle of it), no draft forward in any plain round, one
window-wide forward per catch-up, and after every catch-up the draft's cache holds, at every committed
position but the newest, the K/V that the stock draft model computes for that prefix (what a draft that
never lagged would hold). With a draft equal to the target every draft is accepted, so the gap before a
catch-up is the largest the window must cover: one token less of window leaves a stale slot.
"""

from __future__ import annotations

import copy
import random

import torch
import pytest

from hf_accel import SpeculativeConfig, accelerate_model, speculative_stats
from hf_accel.engine.decode_step import DecodeStep
from hf_accel.speculative.draft_length import _PLAIN_BURST, _KChooser
from hf_accel.speculative.draft_window import catch_up_width
from hf_accel.speculative.engine import SpeculativeEngine

LAYERS = 4
NEW_TOKENS = 80
KV_ATOL = 1e-4  # float32: the paged step vs the stock model's attention (a stale slot is off by O(1))


class DraftSpy:
    """Wraps the draft model's decode steps and the engine's rounds: ``rounds`` lists (k, draft forwards
    during that round), ``catch_ups`` lists (rounds before it, widths of its draft forwards), and
    ``kv_errors`` the largest |K/V - reference| over the committed positions after each catch-up."""

    def __init__(self, monkeypatch, draft, reference):
        self.widths: list[int] = []
        self.rounds: list[tuple[int, int]] = []
        self.catch_ups: list[tuple[int, list[int]]] = []
        self.kv_errors: list[float] = []
        forward_tokens = DecodeStep.forward_tokens
        run_round = SpeculativeEngine._round
        catch_up = SpeculativeEngine._catch_up_draft

        def spy_forward(step, input_ids, *args, **kwargs):
            if step.model is draft:
                self.widths.append(input_ids.shape[1])
            return forward_tokens(step, input_ids, *args, **kwargs)

        def spy_round(engine, k, st, ctx):
            n = len(self.widths)
            run_round(engine, k, st, ctx)
            self.rounds.append((k, len(self.widths) - n))

        def spy_catch_up(engine, st, ctx):
            n = len(self.widths)
            catch_up(engine, st, ctx)
            self.catch_ups.append((len(self.rounds), self.widths[n:]))
            self.kv_errors.append(kv_error(engine.draft_fast.cache, st, reference))

        monkeypatch.setattr(DecodeStep, "forward_tokens", spy_forward)
        monkeypatch.setattr(SpeculativeEngine, "_round", spy_round)
        monkeypatch.setattr(SpeculativeEngine, "_catch_up_draft", spy_catch_up)

    def catch_ups_due(self) -> int:
        """Rounds that drafted right after a plain round."""
        return sum(1 for (k0, _), (k1, _) in zip(self.rounds, self.rounds[1:]) if k0 == 0 and k1 > 0)


def kv_error(cache, st, reference) -> float:
    """Largest |K/V| difference, over every layer and every committed position but the newest of every row,
    between the draft's paged cache and the stock ``reference`` model run over that row's committed prefix."""
    worst = 0.0
    for row, seq in enumerate(cache.seq_ids):
        start, end = int(st.starts[row]), int(st.lengths[row]) - 1
        with torch.no_grad():
            past = reference(input_ids=st.tokens[row, start:end][None], use_cache=True).past_key_values
        table = torch.tensor(cache.manager.block_table(seq))
        for layer, ref in zip(cache.layers, past.layers):
            for pool, want in ((layer.keys, ref.keys), (layer.values, ref.values)):
                got = pool[table].flatten(0, 1)[start:end]  # [tokens, num_kv_heads, head_dim]
                worst = max(worst, float((got - want[0].transpose(0, 1)).abs().max()))
    return worst


def prompts(tiny, batch):
    ids, mask = tiny.batch(seed=1, lengths=(9, 5, 3))  # rows 1 and 2 left padded
    return ids[:batch], mask[:batch]


def greedy(model, ids, mask, pad, eos):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=pad, eos_token_id=eos)


def mid_eos(model, ids, mask, pad) -> int:
    """A token the first row emits for the first time between new tokens 40 and 60: with it as EOS the
    first row ends there, after several bursts of plain rounds, and the other rows run on."""
    new = greedy(model, ids, mask, pad, None)[0, ids.shape[1]:].tolist()
    return next(new[i] for i in range(40, 60) if new[i] not in new[:i])


def window() -> int:
    return catch_up_width(_KChooser.max_plain_run)


def force_schedule(monkeypatch, schedule):
    """Make the chooser return ``schedule``'s (k, rounds) pairs in turn, cyclically."""
    calls = []

    def choose(self, max_remaining, burst=True):
        calls.append(schedule[len(calls) % len(schedule)])
        return calls[-1]

    monkeypatch.setattr(_KChooser, "choose", choose)


@pytest.mark.parametrize("batch", [1, 3])
def test_backed_off_draft_model_runs_no_draft_forward(batch, tiny, monkeypatch):
    """A random draft for a random target: drafts are rejected, the adaptive chooser backs off and
    probes; plain rounds run no draft forward and every catch-up restores the draft's cache. The chooser sees
    fixed round times (a round of k drafted tokens 1 + k/2 plain rounds): wall-clock times of these tiny CPU
    rounds under load made it keep drafting (4 backed-off steps in one run of the whole suite)."""
    update = _KChooser.update
    monkeypatch.setattr(_KChooser, "update", lambda self, k, counts, seconds: update(
        self, k, counts, None if seconds is None else 1e-3 * (1 + 0.5 * k)))
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = tiny.model("llama", seed=11, num_hidden_layers=2)
    ids, mask = prompts(tiny, batch)
    eos = mid_eos(model, ids, mask, tiny.PAD)
    stock = greedy(model, ids, mask, tiny.PAD, eos)
    spy = DraftSpy(monkeypatch, draft, copy.deepcopy(draft))
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(
        "draft_model", draft_model=draft, num_draft_tokens=3))
    out = greedy(ours, ids, mask, tiny.PAD, eos)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    if batch > 1:
        assert (out[1:, -1] != tiny.PAD).all() and out[0, -1] == tiny.PAD  # the first row ended early
    stats = speculative_stats(ours)
    assert stats["backed_off_steps"] >= 2 * _KChooser.max_plain_run and stats["verify_steps"] >= 3, stats
    plain = [n for k, n in spy.rounds if k == 0]
    # no draft forward in a plain round; the stats count only rounds in which a row was active, a burst of
    # plain rounds may run past the end
    assert stats["backed_off_steps"] <= len(plain) < stats["backed_off_steps"] + 8 and not any(plain)
    assert all(n == k for k, n in spy.rounds if k > 0)  # a round with k drafts: the re-feed + k - 1 steps
    assert len(spy.catch_ups) == spy.catch_ups_due() >= 2
    assert all(widths == [window()] for _, widths in spy.catch_ups)  # one forward of the window each
    assert len(spy.widths) == sum(k for k, _ in spy.rounds) + len(spy.catch_ups)
    assert max(spy.kv_errors) < KV_ATOL, spy.kv_errors


@pytest.mark.parametrize("batch", [1, 3])
def test_catch_up_window_covers_the_largest_gap(batch, tiny, monkeypatch):
    """The draft is the target: every draft is accepted, so a round that drafted leaves the two newest
    committed tokens out of the draft's cache; then the most plain rounds in a row the chooser allows,
    one token each. The catch-up must leave the draft's cache exact, and every later draft accepted."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = copy.deepcopy(model)
    ids, mask = prompts(tiny, batch)
    eos = mid_eos(model, ids, mask, tiny.PAD) if batch > 1 else None
    stock = greedy(model, ids, mask, tiny.PAD, eos)
    force_schedule(monkeypatch, [(3, 1), (0, _PLAIN_BURST), (0, _KChooser.max_plain_run - _PLAIN_BURST)])
    spy = DraftSpy(monkeypatch, draft, copy.deepcopy(draft))
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(
        "draft_model", draft_model=draft, num_draft_tokens=3))
    out = greedy(ours, ids, mask, tiny.PAD, eos)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert not any(n for k, n in spy.rounds if k == 0)
    assert len(spy.catch_ups) == spy.catch_ups_due() >= 2
    assert max(spy.kv_errors) < KV_ATOL, spy.kv_errors
    stats = speculative_stats(ours)
    assert stats["acceptance_rate"] == 1.0 and stats["verify_steps"] >= 3, stats


def test_catch_up_window_past_a_short_row(tiny, monkeypatch):
    """Short prompts and few new tokens: the window starts at the row's first slot and reaches past the
    committed tokens (its blocks must be reserved); the draft's cache is still exact there."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = copy.deepcopy(model)
    ids, mask = tiny.batch(seed=2, lengths=(4, 2, 1))
    assert ids.shape[1] + 6 < window()
    with torch.no_grad():
        stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               pad_token_id=tiny.PAD, eos_token_id=None)
    force_schedule(monkeypatch, [(0, 2), (2, 1)])
    spy = DraftSpy(monkeypatch, draft, copy.deepcopy(draft))
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(
        "draft_model", draft_model=draft, num_draft_tokens=2))
    with torch.no_grad():
        out = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            pad_token_id=tiny.PAD, eos_token_id=None)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert spy.catch_ups and max(spy.kv_errors) < KV_ATOL, spy.kv_errors
    assert speculative_stats(ours)["acceptance_rate"] == 1.0


def test_k_chooser_plain_runs_fit_the_catch_up_window():
    """Whatever the remaining budgets, a backed-off chooser runs at most ``max_plain_run`` plain rounds
    between two rounds that draft (bursts cut short by the budget used to let the run grow past the
    probe), and reaches it when the budget allows."""
    rng = random.Random(0)
    chooser = _KChooser(k_max=4, adaptive=True, draft_cost=0.3)
    run, runs = 0, []
    for i in range(400):
        k, rounds = chooser.choose(rng.randint(1, 12) if i % 50 < 40 else 100)
        if k == 0:
            run += rounds
        else:
            runs.append(run)
            run = 0
        chooser.update(k, [1] + [0] * k, seconds=1.0 + 0.3 * k)  # nothing is ever accepted
    assert max(runs) == _KChooser.max_plain_run, runs
    assert window() == _KChooser.max_plain_run + 1
