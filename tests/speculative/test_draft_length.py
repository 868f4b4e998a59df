"""The adaptive draft length's choosers (hf_accel.speculative.draft_length), no model.

_KChooser: backs off to plain rounds, probes and recovers, drafts no more than the budget can take, sees
all-or-nothing copies, times a plain round, weighs the slower rows of a batch (slowest_rows), and with a
streamer drafts as without one, one round per sync. _GatedChooser (match-gated prompt lookup): plain rounds without
matches, verifies the classes that hold, weighs the rows of a batch, and its prepared choices equal those made on
arrival.
"""

from __future__ import annotations

import pytest

from hf_accel.kernels.commit_tokens import NUM_CLASSES
from hf_accel.speculative import draft_length
from hf_accel.speculative.draft_length import _PROBE_EVERY, _GatedChooser, _KChooser, slowest_rows


# --- _KChooser ----------------------------------------------------------------------------------------------------


def test_k_chooser_backs_off_probes_and_recovers():
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.3)
    for _ in range(20):  # nothing is ever accepted; drafting costs time
        k, rounds = chooser.choose(100)
        chooser.update(k, [1] + [0] * k, seconds=1.0 + 0.3 * k)
    picks = [chooser.choose(100) for _ in range(12)]
    plain = [r for k, r in picks if k == 0]
    assert len(plain) >= 8 and set(plain) == {8}  # backed off: plain rounds in bursts of 8
    assert any(k > 0 for k, _ in picks)  # with probes
    assert chooser.choose(3) in ((0, 3), (2, 1), (1, 1))  # never past the budget
    for _ in range(40):  # everything is accepted again
        k, rounds = chooser.choose(100)
        chooser.update(k, [0] * k + [1], seconds=1.0 + 0.3 * k)
    assert chooser.choose(100) == (8, 1)


def test_k_chooser_with_a_streamer_drafts_as_without_one_one_round_per_sync():
    """A streamer takes one round per host sync (``burst=False``): the choices are those without it, plain bursts
    cut to single rounds. (The engine passed a budget of 1 token instead, which allowed no drafts: 16 plain
    rounds first with a streamer, for the draft model and early exit.)"""
    choosers = [_KChooser(k_max=8, adaptive=True, draft_cost=0.3) for _ in range(2)]
    picks = [[], []]
    for i in range(40):
        accepted = i < 20  # drafts pay, then nothing is accepted
        for chooser, burst, seen in zip(choosers, (True, False), picks):
            k, rounds = chooser.choose(100, burst=burst)
            seen.append((k, rounds))
            hist = [0] * k + [1] if accepted else [1] + [0] * k
            chooser.update(k, hist, seconds=1.0 + 0.3 * k)
    assert picks[1][0][0] > 0 and picks[1][:20] == picks[0][:20]  # drafting from the first round
    assert all(r == 1 for _, r in picks[1]) and any(k == 0 and r > 1 for k, r in picks[0])


def test_k_chooser_drafts_no_more_than_the_budget_can_take():
    """Every draft is accepted: k_max while the budget allows, the largest candidate below the tokens left
    near the end, a plain round with one token left (unless a probe is due, which bounds plain runs)."""
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.03)
    for _ in range(30):
        k, _ = chooser.choose(100)
        chooser.update(k, [0] * k + [1], seconds=1.0 + 0.01 * k)
    assert chooser.choose(100) == (8, 1)
    assert chooser.choose(9) == (8, 1)
    assert chooser.choose(8) == (4, 1)
    assert chooser.choose(2) == (1, 1)
    assert chooser.choose(1) == (0, 1)
    chooser.since_probe = chooser.max_plain_run
    assert chooser.choose(1) == (8, 1)  # the due probe


def test_k_chooser_sees_all_or_nothing_copies():
    """Half the rounds accept nothing, half accept all 16 drafts: the per-position hazard falls to 0 after
    the first draft, so the longest k wins although the mean acceptance rate is only ~50%."""
    chooser = _KChooser(k_max=16, adaptive=True, draft_cost=0.03)
    for i in range(40):
        k, _ = chooser.choose(100)
        chooser.update(k, ([1] + [0] * k) if i % 2 else ([0] * k + [1]), seconds=1.0 + 0.005 * k)
    assert chooser.choose(100) == (16, 1)
    assert chooser.expected_tokens(16) > 6 > 2 > chooser.expected_tokens(1)


def test_k_chooser_fixed_k():
    chooser = _KChooser(k_max=5, adaptive=False, draft_cost=0.3)
    chooser.update(5, [1, 0, 0, 0, 0, 0], seconds=10.0)
    assert chooser.choose(100) == (5, 1)


def test_slowest_rows():
    assert slowest_rows([3, 0, 2, 3], 0.5) == [3, 0, 1, 0]  # 8 rows: the 4 with the fewest accepted
    assert slowest_rows([0, 1, 0, 2], 0.5) == [0, 1, 0, 1]  # ceil(1.5) = 2 rows
    assert slowest_rows([0, 0, 1], 0.01) == [0, 0, 1]  # at least one row
    assert slowest_rows([2, 5, 1], 1.0) == [2, 5, 1]
    assert slowest_rows([0, 0, 0], 0.5) == [0, 0, 0]
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            slowest_rows([1, 1], bad)
    with pytest.raises(ValueError, match=">= 0"):
        slowest_rows([1, -1], 0.5)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_k_chooser_at_batch_8_weighs_the_slower_rows(fraction, monkeypatch):
    """Batch 8, verify rounds cost ~1.8 plain rounds (as bs8 on the H200): half the rows copy every draft, half
    accept none. Counting every row (fraction 1) the mean row accepts half of k and the chooser keeps drafting;
    counting the slower half (the default) it backs off, since the batch runs as long as those rows need."""
    monkeypatch.setattr(draft_length, "BATCH_ROWS_FRACTION", fraction)
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.1)
    picks = []
    for _ in range(60):
        k, rounds = chooser.choose(100)
        picks += [k] * rounds
        hist = [0] * (k + 1)
        hist[0] += 4
        hist[k] += 4
        chooser.update(k, hist, seconds=0.62e-3 if k == 0 else 1.1e-3)
    late = picks[-40:]  # rounds (a plain burst is several)
    if fraction == 1.0:
        assert all(k > 0 for k in late), late
    else:
        assert sum(k == 0 for k in late) >= 32, late  # backed off, with a probe now and then


def test_k_chooser_times_a_plain_round_and_backs_off_when_verify_costs_more():
    """A verify round costs 1.9 plain rounds whatever k (different kernels: batch-1 GEMVs vs a pass over
    k + 1 rows) and about 1.2 tokens come out of one: plain decoding is faster. The chooser must time a
    plain round instead of guessing its cost from the verify rounds, then back off."""
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.03)
    picks = []
    for _ in range(40):
        k, rounds = chooser.choose(100)
        picks += [k] * rounds
        hist = [0] * (k + 1)
        hist[min(k, 0 if len(picks) % 5 else 1)] = 1  # one draft accepted in a fifth of the rounds
        chooser.update(k, hist if k else [1], seconds=1.0 if k == 0 else 1.9 + 0.01 * k)
    assert 0 in chooser.times and chooser.times[0] == 1.0
    later = [chooser.choose(100) for _ in range(10)]
    assert sum(r for k, r in later if k == 0) > 4 * sum(1 for k, _ in later if k > 0), later


def test_k_chooser_scales_unmeasured_verify_rounds_from_verify_rounds():
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.1)
    chooser.times = {0: 1.0, 4: 2.8}
    assert chooser.time(8) == pytest.approx(2.8 * 1.8 / 1.4)  # from k=4, not from the plain round
    assert chooser.time(2) == pytest.approx(2.8 * 1.2 / 1.4)


# --- _GatedChooser (match-gated prompt lookup) --------------------------------------------------------------------


def _counts(**by_class):
    c = [0] * NUM_CLASSES
    for name, v in by_class.items():
        c[int(name[1:])] = v
    return c


def _hists(k, **by_class):
    """Per-class histograms: ``c3=(v, rows)`` = rows of class 3 that accepted v drafts."""
    h = [[0] * (k + 1) for _ in range(NUM_CLASSES)]
    for name, (v, rows) in by_class.items():
        h[int(name[1:])][v] = rows
    return h


def test_gated_chooser_runs_plain_rounds_without_matches():
    """No row matched: plain rounds, in bursts that grow with the plain rounds in a row (1, 1, 1, 1, 2, 2, 3,
    ..., at most 8), one at a time without ``burst``, never past the budget; a round that drafts starts over."""
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    bursts = [chooser.choose(_counts(c0=5))[1] for _ in range(20)]
    assert bursts[:8] == [1, 1, 1, 1, 2, 2, 3, 3] and bursts[-3:] == [8, 8, 8], bursts
    assert chooser.choose(_counts(c0=5)) == (0, 8)
    assert chooser.choose(_counts(c0=1), burst=False) == (0, 1)
    assert chooser.choose(_counts(c0=1), max_remaining=3) == (0, 3)
    chooser.times = {0: 1.0, 1: 1.2, 2: 1.2, 4: 1.2, 8: 1.2}
    for _ in range(20):
        chooser.update(8, _hists(8, c3=(8, 1)), None)
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    assert chooser.choose(_counts(c0=1)) == (0, 1)


def test_gated_chooser_verifies_what_holds_and_skips_what_does_not():
    """3-gram matches are always copied in full, 1-gram matches never hold: the chooser verifies the first and
    runs plain rounds for the second, probing them once per _PROBE_EVERY plain rounds; a verify round costs
    1.7 plain rounds."""
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 8: 1.7, 4: 1.7, 2: 1.7, 1: 1.7}
    for _ in range(30):
        k, rounds = chooser.choose(_counts(c3=1))
        assert k > 0 and rounds == 1
        chooser.update(k, _hists(k, c3=(k, 1)), None)
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    probes, plain = [], 0  # plain rounds before each probe
    while plain < 3 * _PROBE_EVERY:
        k, rounds = chooser.choose(_counts(c1=1))
        if k:
            probes.append(plain)
        plain += rounds if k == 0 else 0
        chooser.update(k, _hists(k, c1=(0, 1)), None)
    gaps = [b - a for a, b in zip([0] + probes, probes)]
    assert 2 <= len(probes) <= 3 and all(_PROBE_EVERY <= g < _PROBE_EVERY + 8 for g in gaps), probes
    assert chooser.choose(_counts(c3=1)) == (8, 1)  # the 3-gram estimate is untouched by the 1-gram rounds


def test_gated_chooser_all_or_nothing_weighs_only_zero_and_k_max(monkeypatch):
    """Rows that accept 2 drafts: the adaptive chooser takes k = 2 where a round of 2 drafts is much cheaper
    than one of 8; with GATED_ALL_OR_NOTHING only 0 and k_max are weighed (and a shorter k where the budget
    is below k_max)."""
    from hf_accel.speculative import draft_length

    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 1: 1.1, 2: 1.1, 4: 1.3, 8: 1.8}
    for _ in range(30):
        chooser.update(8, _hists(8, c3=(2, 1)), None)
    assert chooser.choose(_counts(c3=1)) == (2, 1)
    monkeypatch.setattr(draft_length, "GATED_ALL_OR_NOTHING", True)
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    assert chooser.choose(_counts(c3=1), max_remaining=5) == (4, 1)


def test_gated_chooser_weighs_the_rows_of_a_batch():
    """At batch 4 a round verifies when enough rows matched well: one 3-gram row among three unmatched rows
    adds too little for a verify round that costs twice a plain one, three 3-gram rows add enough."""
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0}
    for _ in range(30):
        chooser.update(8, _hists(8, c3=(2, 1)), None)  # 3-gram rows accept 2 drafts
    assert chooser.expected_tokens(8, _counts(c3=1)) == pytest.approx(3.0, abs=0.2)
    assert chooser.choose(_counts(c0=3, c3=1))[0] == 0
    assert chooser.choose(_counts(c0=1, c3=3))[0] > 0


def test_gated_chooser_prepared_choices_equal_choices_made_on_arrival():
    """The decisions ``prepare`` makes ahead for each single-row class equal what ``choose`` decides from the
    counts themselves, over a random run of rounds (matches that hold or not, plain bursts, probes, budgets
    that run out, several rows, round times changing): two choosers fed the same rounds pick the same."""
    import random

    rng = random.Random(1)
    ahead, plain = _GatedChooser(k_max=15, draft_cost=0.03), _GatedChooser(k_max=15, draft_cost=0.03)
    picks, used = [], 0
    for i in range(600):
        rows = 1 if i % 7 else 3
        counts = [0] * NUM_CLASSES
        for _ in range(rows):
            counts[rng.choice([0, 0, 1, 1, 2, 3, 5, 7])] += 1
        budget = rng.choice([None, 100, 100, 20, 16, 15, 9, 3, 1])
        ahead.prepare(burst=i % 11 != 0)
        prepared = ahead._prepared
        got = ahead.choose(counts, budget, burst=i % 11 != 0)
        want = plain.choose(counts, budget, burst=i % 11 != 0)
        assert got == want, (i, counts, budget)
        used += ahead._prepared is prepared and rows == 1 and (budget is None or budget > 15)
        picks.append(got)
        k = got[0]
        if k:
            hists = [[0] * (k + 1) for _ in range(NUM_CLASSES)]
            for c, n in enumerate(counts):
                if n:
                    hists[c][min(k, rng.choice([0, 1, k, k]) if c > 1 else 0)] += n
            seconds = (0.6 + 0.01 * k) * 1e-3 * rng.uniform(0.9, 1.1)
        else:
            hists, seconds = [[0] for _ in range(NUM_CLASSES)], 0.5e-3 * rng.uniform(0.9, 1.1)
        for ch in (ahead, plain):
            ch.update(k, hists, seconds)
    assert {k for k, _ in picks} >= {0, 15} and any(r > 1 for _, r in picks), picks
    assert used > 200  # most choices at batch 1 with budget left came from the prepared table


def test_gated_chooser_times_a_plain_round_once_a_verify_round_is_timed():
    chooser = _GatedChooser(k_max=4, draft_cost=0.03)
    k, _ = chooser.choose(_counts(c3=1))
    assert k > 0
    chooser.update(k, _hists(k, c3=(k, 1)), seconds=1.8)
    assert chooser.choose(_counts(c3=1)) == (0, 1)  # to time it
    chooser.update(0, _hists(0, c3=(0, 1)), seconds=1.0)
    assert chooser.times == {k: 1.8, 0: 1.0}


def test_gated_chooser_drafts_no_more_than_the_budget_can_take():
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 1: 1.2, 2: 1.2, 4: 1.2, 8: 1.2}
    for _ in range(20):
        chooser.update(8, _hists(8, c3=(8, 1)), None)  # 3-gram matches are copied in full
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    assert chooser.choose(_counts(c3=1), max_remaining=100) == (8, 1)
    assert chooser.choose(_counts(c3=1), max_remaining=5) == (4, 1)  # at most 4 drafts + the target's token
    assert chooser.choose(_counts(c3=1), max_remaining=1) == (0, 1)  # one token left: a plain step
