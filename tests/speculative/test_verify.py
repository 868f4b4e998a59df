"""Greedy acceptance and rejection sampling (hf_accel.speculative.verify) on synthetic distributions."""

from __future__ import annotations

import pytest
import torch
from stat_tests import goodness_of_fit_p

from hf_accel.speculative.verify import greedy_accept, rejection_sample, sample

P_MIN = 1e-3
VOCAB = 12
DRAWS = 40000


def test_greedy_accept_counts_the_matching_prefix():
    g = torch.Generator().manual_seed(0)
    b, k = 6, 4
    logits = torch.randn(b, k + 1, VOCAB, generator=g)
    best = logits.argmax(-1)
    drafts = torch.randint(0, VOCAB, (b, k), generator=g)
    matches = torch.tensor([0, 1, 2, 4, 4, 3])
    for row, m in enumerate(matches.tolist()):
        drafts[row, :m] = best[row, :m]
        if m < k:
            drafts[row, m] = (best[row, m] + 1) % VOCAB  # the first mismatch
    valid = torch.ones(b, k, dtype=torch.bool)
    valid[4, 2:] = False  # row 4: only two drafts proposed
    out, n = greedy_accept(drafts, valid, logits)
    assert n.tolist() == [0, 1, 2, 4, 2, 3]
    assert torch.equal(out, best)


def test_sample_draws_from_probs():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(VOCAB, generator=g), 0)
    p[3] = 0
    p /= p.sum()
    torch.manual_seed(2)
    draws = sample(p.expand(DRAWS, VOCAB).contiguous())
    assert (draws != 3).all()
    assert goodness_of_fit_p(draws, p) > P_MIN


def _dists(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, VOCAB, generator=g) * 1.5, -1)  # target at positions 0, 1, 2
    q = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, -1)  # draft at positions 0, 1
    return p, q


def _committed(out, n):
    """(first committed token [rows], second committed token of rows that accepted the first draft)."""
    return out[:, 0], out[n >= 1, 1]


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "point-mass"])
def test_rejection_sampling_keeps_the_target_distribution(point_mass):
    """The committed tokens are distributed as p, whatever q is (Leviathan et al. 2023, Theorem 1): the first
    token ~ p_0, and the token after an accepted first draft ~ p_1 (p does not depend on the prefix here)."""
    p, q = _dists(3)
    torch.manual_seed(4)
    if point_mass:  # prompt lookup: fixed drafts (the likeliest under p, so acceptance is often tested)
        drafts = p[:2].argmax(-1).expand(DRAWS, 2).contiguous()
        draft_probs = None
    else:
        drafts = torch.stack([sample(q[0].expand(DRAWS, VOCAB).contiguous()),
                              sample(q[1].expand(DRAWS, VOCAB).contiguous())], 1)
        draft_probs = q.expand(DRAWS, 2, VOCAB).contiguous()
    valid = torch.ones(DRAWS, 2, dtype=torch.bool)
    out, n = rejection_sample(drafts, valid, draft_probs, p.expand(DRAWS, 3, VOCAB).contiguous())
    first, second = _committed(out, n)
    assert 0.05 < (n >= 1).float().mean() < 0.95  # both branches (accept / resample) are exercised
    assert goodness_of_fit_p(first, p[0]) > P_MIN
    assert goodness_of_fit_p(second, p[1]) > P_MIN
    # all accepted: the bonus token comes from p_2
    assert goodness_of_fit_p(out[n == 2, 2], p[2]) > P_MIN


def test_rejection_sampling_test_has_power():
    """Committing the draft unconditionally (no rejection) gives q, and the test sees it."""
    p, q = _dists(3)
    torch.manual_seed(5)
    drafts = sample(q[0].expand(DRAWS, VOCAB).contiguous())
    assert goodness_of_fit_p(drafts, p[0]) < P_MIN


def test_invalid_draft_positions_sample_from_the_target():
    p, _ = _dists(6)
    torch.manual_seed(7)
    drafts = torch.zeros(DRAWS, 2, dtype=torch.long)
    valid = torch.zeros(DRAWS, 2, dtype=torch.bool)
    out, n = rejection_sample(drafts, valid, None, p.expand(DRAWS, 3, VOCAB).contiguous())
    assert (n == 0).all()
    assert goodness_of_fit_p(out[:, 0], p[0]) > P_MIN


def test_identical_draft_and_target_accept_everything():
    p, _ = _dists(8)
    q = p[:2].expand(500, 2, VOCAB).contiguous()
    torch.manual_seed(9)
    drafts = torch.stack([sample(q[:, 0]), sample(q[:, 1])], 1)
    out, n = rejection_sample(drafts, torch.ones(500, 2, dtype=torch.bool), q, p.expand(500, 3, VOCAB).contiguous())
    assert (n == 2).all() and torch.equal(out[:, :2], drafts)


def test_nothing_drafted_samples_from_the_first_position():
    p, _ = _dists(10)
    torch.manual_seed(11)
    empty = torch.zeros(DRAWS, 0, dtype=torch.long)
    out, n = rejection_sample(empty, empty.bool(), None, p[:1].expand(DRAWS, 1, VOCAB).contiguous())
    assert out.shape == (DRAWS, 1) and (n == 0).all()
    assert goodness_of_fit_p(out[:, 0], p[0]) > P_MIN
