"""Adaptive draft length: the k of each speculative round (0 = a plain decode step, "backed off") from the
measured acceptance and round times.

:class:`_KChooser` models acceptance per draft position (a hazard per position, censored at the k used)
and picks, one round ahead of the counters, the k with the most expected tokens per second (Leviathan et
al. 2023, §3.1: expected tokens of a round with per-draft acceptance ``a`` and k drafts, ``(1 - a^(k+1)) /
(1 - a)``, here generalised to position-dependent acceptance). :class:`_GatedChooser` does the same per
prompt-lookup match class, knowing the classes of the very round it chooses for.
"""

from __future__ import annotations

import math

from hf_accel.kernels.commit_tokens import NUM_CLASSES

_PROBE_EVERY = 16  # plain rounds between probes while backed off (also the most plain rounds in a row)
_PLAIN_BURST = 8  # plain rounds replayed per host sync while backed off
#: Match-gated plain rounds in bursts (:class:`_GatedChooser`); False: one plain round per host sync.
GATED_PLAIN_BURSTS = True
#: Plain rounds of the ungated chooser (:class:`_KChooser`: batches, early exit, a draft model) go in bursts of up to
#: :data:`_PLAIN_BURST` per queued item in calls of at least this many rows, one round per item below. The host
#: queues an item ahead of the counters it reads, so with bursts up to two bursts (16 rounds, ~0.43 ms each for
#: SmolLM2 at batch 1 on an H100) were on the GPU when it read that every row had finished (an end-of-sequence
#: token), all run for nothing; one round per item leaves at most one round past the end, as the plain path's
#: ``EOS_LAG``, at the price of a counters copy and a host read per round instead of per burst. H100, real SmolLM2
#: bf16, bursts off / on in turns, two runs each (``bench_speculative-ungated-bursts-*-h100-20261206-ce06c99.json``),
#: speedup over the plain path: batch 1, code answers (ending early) early exit 0.96-0.99x / 0.88x, the 8-layer
#: draft 0.89-0.92x / 0.78-0.80x; open-ended answers (all 128 tokens) 0.95-0.96x / 0.99x and 0.89-0.90x /
#: 0.93-0.94x; at batch 8 bursts were ahead by 0.4-2.5% (mean of the runs) in 7 of the 9 proposer x prompt pairs.
#: 1: bursts at every batch size (before 6 December); a number above any batch: never.
UNGATED_PLAIN_BURSTS_FROM_BATCH = 2
#: Draft lengths :class:`_GatedChooser` weighs: False = 0, powers of two below k_max and k_max; True = only
#: 0 and k_max (and, where a row's token budget is below k_max, the longest other one that fits).
GATED_ALL_OR_NOTHING = False
_PLAIN_TIMINGS = 2  # plain rounds a chooser runs to time them (a round that captures a graph is not timed)
_DECAY = 0.9  # weight of the previous rounds in the acceptance estimate
#: Fraction of a batch's active rows whose accepted drafts :meth:`_KChooser.update` counts each round: the
#: ``ceil(fraction x rows)`` rows that accepted the fewest (1.0: every row, the mean row). A batch runs as many
#: rounds as its slowest row needs, so verifying pays only where the slower rows accept too. CPU replay of
#: ``bench_speculative``'s prompts as one batch of 8 (float32, stock's tokens, H200 bs8 round times fixed;
#: ``benchmarks/study_batch_rounds.py``, ``study_batch_rounds-cpu-20261203.json``), speedup of the rounds
#: over plain steps, passages / code / open-ended: every row 1.51x / 1.04x / 0.96x, the slower half 1.61x /
#: 1.14x / 0.97x, the slowest quarter 1.10x / 1.05x / 0.97x. At batch 1 every fraction counts the one row.
BATCH_ROWS_FRACTION = 0.5
_SHRINK = 2.0  # pseudo-rounds of the previous position's hazard in each position's estimate


def _round_time(times: dict, k: int, draft_cost: float) -> float:
    """Round time of draft length ``k``: measured (``times``), else scaled from the nearest measured k of
    the same kind (verify from verify, plain from plain; see :class:`_KChooser`), else the prior
    ``1 + draft_cost * k`` (plain steps)."""
    if k in times:
        return times[k]
    if not times:
        return 1.0 + draft_cost * k
    same = [k0 for k0 in times if (k0 > 0) == (k > 0)]
    k0 = min(same or times, key=lambda k0: abs(k0 - k))
    return times[k0] * (1.0 + draft_cost * k) / (1.0 + draft_cost * k0)


def _record_time(times: dict, k: int, seconds: float | None) -> None:
    if seconds is not None:
        old = times.get(k)
        times[k] = seconds if old is None else 0.7 * old + 0.3 * seconds


def slowest_rows(hist: list[int], fraction: float) -> list[int]:
    """The histogram ``hist`` (``hist[v]`` = rows that accepted exactly v drafts) of only the
    ``ceil(fraction x rows)`` rows (at least 1) that accepted the fewest; ``fraction`` in (0, 1].

    Raises:
        ValueError: ``fraction`` outside (0, 1], or a negative count.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if any(c < 0 for c in hist):
        raise ValueError(f"row counts must be >= 0, got {hist}")
    total = sum(hist)
    keep = min(total, max(1, math.ceil(fraction * total)))
    out = [0] * len(hist)
    for v, c in enumerate(hist):
        if keep <= 0:
            break
        out[v] = min(c, keep)
        keep -= out[v]
    return out


def _candidates(k_max: int) -> list[int]:
    ks, k = [0], 1
    while k < k_max:
        ks.append(k)
        k *= 2
    return ks + [k_max]


class _KChooser:
    """Chooses k per round from the measured acceptance and round times.

    Acceptance is modelled per draft position: the hazard ``h(m)`` = P(draft m + 1 is rejected | the
    first m were accepted), estimated from the rounds' histograms of accepted counts (censored at the k
    used; recent rounds weigh more). Drafts copied by prompt lookup tend to be all right or wrong at once
    (the hazard falls along a copied span), which a single per-draft rate would miss. The expected tokens
    of a round with k drafts is ``1 + sum_{m=1..k} prod_{i<m} (1 - h(i))``.

    Round times are measured (CUDA events, per k). A k not measured yet is scaled from the nearest measured
    k of the same kind (a verify round from a verify round, with the prior ``draft_cost`` per drafted
    token), never a verify round from a plain one: the two run different kernels (at batch 1 the plain
    step's one-row GEMVs are much cheaper than a verify pass over k + 1 rows). So once a verify round has
    been timed, one plain round is run to time it too, before backing off is weighed on a guess.

    Never more than :attr:`max_plain_run` plain rounds in a row: the window that catches a draft model's
    cache up after plain rounds is sized by it."""

    prior_hazard = 1.0 / 3.0  # before any round is seen
    max_plain_run = _PROBE_EVERY
    shrink = _SHRINK
    decay = _DECAY

    def __init__(self, k_max: int, adaptive: bool, draft_cost: float):
        self.k_max = k_max
        self.adaptive = adaptive
        self.ks = _candidates(k_max) if adaptive else [k_max]
        self.draft_cost = draft_cost  # prior: extra time per drafted token, as a fraction of a plain step
        self.trials = [0.0] * k_max
        self.fails = [0.0] * k_max
        self.times: dict[int, float] = {}
        self.since_probe = 0
        self.plain_timings = 0  # plain rounds run to time them (at most _PLAIN_TIMINGS)
        self._curve = None  # ((prior, shrink), expected tokens for k = 0..k_max), reset by every update

    def expected_tokens(self, k: int) -> float:
        """Expected tokens committed by a round with ``k`` drafts (0 <= k <= k_max)."""
        return self.expected_curve()[k]

    def expected_curve(self) -> list[float]:
        """:meth:`expected_tokens` for k = 0 .. k_max, computed once per update (the host chooses a k per
        round, so this is on the path between two rounds)."""
        key = (self.prior_hazard, self.shrink)
        if self._curve is None or self._curve[0] != key:
            curve, total, survive, hazard = [1.0], 1.0, 1.0, self.prior_hazard
            for m in range(self.k_max):
                # shrunk towards the previous position's hazard (the prior before any data), so positions never
                # examined yet inherit what the last examined one showed
                hazard = (self.fails[m] + self.shrink * hazard) / (self.trials[m] + self.shrink)
                survive *= 1.0 - hazard
                total += survive
                curve.append(total)
            self._curve = (key, curve)
        return self._curve[1]

    def time(self, k: int) -> float:
        return _round_time(self.times, k, self.draft_cost)

    def _best(self, ks) -> int:
        return max(ks, key=lambda k: self.expected_tokens(k) / self.time(k))

    def choose(self, max_remaining: int, burst: bool = True) -> tuple[int, int]:
        """(k, rounds): the draft length of the next rounds and how many to run before the next host sync
        (several plain rounds back to back while backed off, only with ``burst`` (a streamer takes one round per
        sync), at most ``max_remaining``, and never past the next probe: so at most ``max_plain_run`` plain rounds
        between two rounds with k > 0). Adaptive choices never draft more than a row could commit besides the
        target's token: k < ``max_remaining`` (a budget of one token left runs a plain round, unless a probe is
        due)."""
        if not self.adaptive:
            return self.k_max, 1
        if (0 in self.ks and 0 not in self.times and any(k > 0 for k in self.times)
                and self.plain_timings < _PLAIN_TIMINGS and self.since_probe < self.max_plain_run):
            self.plain_timings += 1
            self.since_probe += 1
            return 0, 1
        ks = [k for k in self.ks if k < max_remaining]
        if len(ks) < 2:
            if self.since_probe < self.max_plain_run:
                self.since_probe += 1
                return 0, 1
            ks = self.ks  # a due probe (a draft model's catch-up window bounds the plain rounds in a row)
        best = self._best(ks)
        if best > 0:
            return best, 1
        if self.since_probe >= self.max_plain_run:
            self.since_probe = 0
            return self._best(ks[1:]), 1
        rounds = max(1, min(_PLAIN_BURST if burst else 1, max_remaining, self.max_plain_run - self.since_probe))
        self.since_probe += rounds
        return 0, rounds

    def update(self, k: int, accepted_hist: list[int], seconds: float | None) -> None:
        """``accepted_hist[v]``: rows that accepted exactly v of the round's k drafts; the acceptance model
        counts the slowest :data:`BATCH_ROWS_FRACTION` of them (:func:`slowest_rows`)."""
        self.update_acceptance(k, slowest_rows(accepted_hist, BATCH_ROWS_FRACTION))
        _record_time(self.times, k, seconds)

    def update_acceptance(self, k: int, accepted_hist: list[int]) -> None:
        """The hazard counts of :meth:`update` (``accepted_hist`` as there)."""
        if k > 0 and any(accepted_hist):
            self._curve = None
            self.trials = [self.decay * t for t in self.trials]
            self.fails = [self.decay * f for f in self.fails]
            for v, c in enumerate(accepted_hist[: k + 1]):
                if c:
                    for m in range(min(v, k - 1) + 1):
                        self.trials[m] += c
                    if v < k:
                        self.fails[v] += c


class _GatedChooser:
    """Prompt lookup's k per round, chosen knowing which rows matched what in that very round.

    The lookup of round r + 1 runs at the end of round r, inside its graph, and counts the active rows per
    *match class* c: the length of the n-gram the row matched (0: none; clamped to ``NUM_CLASSES - 1``).
    The host reads the counts with the round's counters and only then launches round r + 1 (no round in
    flight meanwhile). Acceptance is modelled per class (one :class:`_KChooser` hazard model each, with a
    prior that falls with n): on SmolLM2's grounded prompts a 1-gram match was followed by a rejected first
    draft 73-97% of the time, a 3-gram match 0-50% (float32 greedy outputs, CPU). Round times per k are
    shared by the classes (:func:`_round_time`). Each round takes the k with the most expected tokens per
    second, summed over the rows: a row of class c adds ``expected_tokens(k)`` of class c, a row without a
    match 1. So ``k = 0``, a plain round, whenever no row matched, or where verifying does not pay.

    Plain rounds run in bursts that grow with the plain rounds in a row so far (one round per sync for the
    first four, two for the next four, ..., at most :data:`_PLAIN_BURST`): the host waits for every choice,
    so a long stretch without usable matches (open-ended text) would otherwise pay the host's turnaround
    every token, while a short one should not hide the next match for long. Each round of a burst still
    looks up the next one's drafts; the choice after the burst sees the last round's classes.

    A class that occurred in :data:`_PROBE_EVERY` plain rounds in a row is drafted once (a probe), so its
    estimate can recover; once a verify round has been timed, :data:`_PLAIN_TIMINGS` plain rounds are run to
    time them (as :class:`_KChooser` does) where none has been timed yet."""

    priors = {1: 0.7, 2: 0.45}  # first-draft rejection before any round is seen; 0.3 for longer matches
    default_prior = 0.3

    def __init__(self, k_max: int, draft_cost: float):
        self.k_max = k_max
        self.ks = _candidates(k_max)
        self.draft_cost = draft_cost
        self._version = 0  # changes with every choice and update (and with the round times assigned)
        self._prepared = None  # (version, burst, [(k, rounds, effect) for a single row of each class])
        self.times: dict[int, float] = {}
        self.classes = []
        for c in range(NUM_CLASSES):
            est = _KChooser(k_max, True, draft_cost)
            est.prior_hazard = self.priors.get(c, self.default_prior)
            self.classes.append(est)
        self.skipped = [0] * NUM_CLASSES  # plain rounds in a row in which the class occurred
        self.plain_timings = 0
        self.plain_run = 0  # plain rounds since the last round that drafted
        # the budget above which it does not limit a choice: more than every k, at least a full plain burst
        self._budget_free = max(max(self.ks), _PLAIN_BURST - 1)

    @property
    def times(self) -> dict:
        return self._times

    @times.setter
    def times(self, value: dict) -> None:
        self._times = value
        self._version += 1

    def time(self, k: int) -> float:
        return _round_time(self.times, k, self.draft_cost)

    def expected_tokens(self, k: int, counts: list[int]) -> float:
        """Expected tokens committed by a round with k drafts over rows with these class counts."""
        if k == 0:
            return float(sum(counts))
        return counts[0] + sum(n * self.classes[c].expected_curve()[k] for c, n in enumerate(counts) if c and n)

    def _best(self, ks, counts) -> int:
        curves = [(n, self.classes[c].expected_curve()) for c, n in enumerate(counts) if c and n]
        rows = float(sum(counts))

        def value(k):
            e = rows if k == 0 else counts[0] + sum(n * curve[k] for n, curve in curves)
            return e / self.time(k)
        return max(ks, key=value)

    def choose(self, counts: list[int], max_remaining: int | None = None, burst: bool = True) -> tuple[int, int]:
        """(k, rounds): the draft length of the next round from its class counts (``counts[c]``: active rows
        of class c), and how many rounds of it to queue before the next host sync (more than one only for
        plain rounds, and only with ``burst``). With ``max_remaining`` (the largest token budget left in a
        row) never more drafts than a row can commit besides the target's token, nor plain rounds past the
        budget.

        Uses the decision :meth:`prepare` made for a single row of that class where it still holds (nothing
        changed the estimates since, and the budget does not limit the choice)."""
        prepared = self._prepared
        if (prepared is not None and prepared[0] == self._version and prepared[1] == burst
                and (max_remaining is None or max_remaining > self._budget_free) and sum(counts) == 1):
            k, rounds, effect = prepared[2][counts.index(1)]
        else:
            k, rounds, effect = self._decide(counts, max_remaining, burst)
        self._apply(effect, rounds)
        return k, rounds

    def prepare(self, burst: bool = True) -> None:
        """Make :meth:`choose`'s decision for one row of each class now (batch 1), so that the choice after the
        next round's counts arrive is a lookup: the engine calls this while a round runs on the GPU, and the
        GPU waits for the host's choice between match-gated rounds."""
        one = [0] * NUM_CLASSES
        table = []
        for c in range(NUM_CLASSES):
            one[c] = 1
            table.append(self._decide(one, None, burst))
            one[c] = 0
        self._prepared = (self._version, burst, table)

    def _decide(self, counts: list[int], max_remaining: int | None, burst: bool):
        """:meth:`choose` without changing the chooser: (k, rounds, effect) where ``effect`` (applied by
        :meth:`_apply`) is ``("timing", ())``, ``("plain", ())``, ``("skip", matched)`` or ``("draft", matched)``."""
        matched = tuple(c for c in range(1, NUM_CLASSES) if counts[c])
        ks = self.ks if max_remaining is None else [k for k in self.ks if k < max_remaining]
        if GATED_ALL_OR_NOTHING and len(ks) > 2:
            ks = [0, ks[-1]]
        if not matched or len(ks) < 2:
            return 0, self._burst(max_remaining, burst), ("plain", ())
        if 0 not in self.times and any(k > 0 for k in self.times) and self.plain_timings < _PLAIN_TIMINGS:
            return 0, 1, ("timing", ())
        best = self._best(ks, counts)
        if best == 0:
            skipped = max(self.skipped[c] for c in matched)
            if skipped < _PROBE_EVERY:  # a burst that ends at the probe at the latest
                return 0, min(self._burst(max_remaining, burst), _PROBE_EVERY - skipped), ("skip", matched)
            best = self._best(ks[1:], counts)
        return best, 1, ("draft", matched)

    def _apply(self, effect, rounds: int) -> None:
        kind, matched = effect
        self._version += 1
        if kind == "draft":
            for c in matched:
                self.skipped[c] = 0
            self.plain_run = 0
            return
        if kind == "timing":
            self.plain_timings += 1
        elif kind == "skip":
            for c in matched:
                self.skipped[c] += rounds
        self.plain_run += rounds

    def _burst(self, max_remaining: int | None, burst: bool) -> int:
        n = min(_PLAIN_BURST, 1 + self.plain_run // 4) if burst and GATED_PLAIN_BURSTS else 1
        return n if max_remaining is None else max(1, min(n, max_remaining))

    def update(self, k: int, class_hists: list[list[int]], seconds: float | None) -> None:
        """``class_hists[c][v]``: rows of class c that accepted exactly v of the round's k drafts."""
        if k > 0:
            for c in range(1, NUM_CLASSES):
                self.classes[c].update_acceptance(k, class_hists[c])
                self.classes[c].expected_curve()  # now (the engine updates after the next launch), not in choose
        _record_time(self.times, k, seconds)
        self._version += 1
