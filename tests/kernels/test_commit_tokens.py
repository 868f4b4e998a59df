"""commit_tokens (one-launch commit of a speculative verify step) against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from hf_accel.kernels.commit_tokens import commit_tokens, commit_tokens_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU


def _state(seed, batch, k, vocab=6):
    g = torch.Generator().manual_seed(seed)
    cap = 40
    out = torch.randint(0, vocab, (batch, k + 1), generator=g)
    drafts = out[:, :k].clone()
    # mismatch at a random position per row (or none)
    cut = torch.randint(0, k + 1, (batch,), generator=g)
    for b in range(batch):
        if cut[b] < k:
            drafts[b, cut[b]] = (drafts[b, cut[b]] + 1) % vocab
    valid = torch.arange(k)[None, :] < torch.randint(0, k + 1, (batch,), generator=g)[:, None]
    tokens = torch.randint(0, vocab, (batch, cap), generator=g)
    lengths = torch.randint(3, cap - k - 1, (batch,), generator=g)
    remaining = torch.randint(0, k + 3, (batch,), generator=g)
    active = (torch.rand(batch, generator=g) < 0.8) & (remaining > 0)
    eos = torch.full((8,), -1, dtype=torch.long)
    eos[:2] = torch.tensor([1, 4])
    n = torch.minimum(cut, valid.sum(1))
    info = torch.full((6 + k,), 99, dtype=torch.long)
    totals = torch.tensor([5, 3, 2])
    return out, n, drafts, valid, tokens, lengths, remaining, active, eos, info, totals


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(seed, batch, k, greedy):
    a = [t.to(DEV) for t in _state(seed, batch, k)]
    b = [t.cpu().clone() for t in a]
    if greedy:
        a[1] = b[1] = None
    commit_tokens(*a, count_step=k > 0)
    commit_tokens_ref(*b, count_step=k > 0)
    names = ["tokens", "lengths", "remaining", "active", "eos", "info", "totals"]
    for name, x, y in zip(names, a[4:], b[4:]):
        assert torch.equal(x.cpu(), y), (name, x, y)


def test_commits_the_accepted_prefix_and_stops_at_eos():
    out = torch.tensor([[7, 8, 1, 9], [7, 8, 9, 6]], device=DEV)
    drafts = torch.tensor([[7, 8, 1], [7, 5, 9]], device=DEV)
    valid = torch.ones(2, 3, dtype=torch.bool, device=DEV)
    tokens = torch.zeros(2, 12, dtype=torch.long, device=DEV)
    lengths = torch.tensor([2, 3], device=DEV)
    remaining = torch.tensor([10, 10], device=DEV)
    active = torch.tensor([True, True], device=DEV)
    eos = torch.tensor([1, -1], device=DEV)
    info, totals = torch.zeros(9, dtype=torch.long, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV)
    commit_tokens(out, None, drafts, valid, tokens, lengths, remaining, active, eos, info, totals, count_step=True)
    # row 0: all three drafts accepted, EOS (1) at position 2 ends it; row 1: one accepted, then 8
    assert tokens[0, 2:6].tolist() == [7, 8, 1, 0] and tokens[1, 3:6].tolist() == [7, 8, 0]
    assert lengths.tolist() == [5, 5] and remaining.tolist() == [7, 8] and active.tolist() == [False, True]
    assert info.tolist() == [1, 4, 5, 6, 8, 0, 1, 0, 1] and totals.tolist() == [6, 4, 2]


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("k", [0, 3, 8])
@pytest.mark.parametrize("seed", range(3))
def test_class_histograms_match_reference_and_sum_to_the_histogram(seed, k, greedy):
    from hf_accel.kernels.commit_tokens import INFO_CLASS_HIST, INFO_SIZE, MAX_DRAFT, NUM_CLASSES

    batch = 6
    state = list(_state(seed, batch, k))
    state[9] = torch.full((INFO_SIZE,), 99, dtype=torch.long)
    g = torch.Generator().manual_seed(100 + seed)
    classes = torch.randint(0, NUM_CLASSES, (batch,), generator=g)
    was_active = state[7].clone()
    a = [t.to(DEV) for t in state]
    b = [t.cpu().clone() for t in a]
    if greedy:
        a[1] = b[1] = None
    commit_tokens(*a, count_step=k > 0, classes=classes.to(DEV))
    commit_tokens_ref(*b, count_step=k > 0, classes=classes)
    for name, x, y in zip(["tokens", "lengths", "remaining", "active", "eos", "info", "totals"], a[4:], b[4:]):
        assert torch.equal(x.cpu(), y), name
    info = b[9]
    hists = info[INFO_CLASS_HIST:].view(NUM_CLASSES, MAX_DRAFT + 1)[:, : k + 1]
    assert torch.equal(hists.sum(0), info[5: 6 + k])  # every active row in exactly one class
    for c in range(NUM_CLASSES):  # rows of class c (active at the step), by accepted count
        assert int(hists[c].sum()) == int((was_active & (classes == c)).sum()), c


def test_classes_need_room_in_info():
    state = list(_state(0, 2, 3))
    with pytest.raises(ValueError, match="info needs"):
        commit_tokens_ref(*state, count_step=True, classes=torch.zeros(2, dtype=torch.long))


def test_takes_column_slices_of_wider_drafts():
    """Drafts and valid masks sliced out of wider buffers (the first k of k_max columns) commit as copies do."""
    out, n, drafts, valid, *rest = _state(4, 5, 3)
    wide_d = torch.cat([drafts, torch.full((5, 2), 7)], dim=1)
    wide_v = torch.cat([valid, torch.ones(5, 2, dtype=torch.bool)], dim=1)
    a = [t.to(DEV) for t in (out, wide_d, wide_v, *rest)]
    b = [t.cpu().clone() for t in (out, drafts, valid, *rest)]
    commit_tokens(a[0], None, a[1][:, :3], a[2][:, :3], *a[3:], count_step=True)
    commit_tokens_ref(b[0], None, *b[1:], count_step=True)
    for x, y in zip(a[3:], b[3:]):
        assert torch.equal(x.cpu(), y)


@pytest.mark.parametrize("ref", [False, True])
def test_totals_count_what_was_committed(ref):
    """Row 0 accepts all 3 drafts but has a budget of 2 tokens, row 1 accepts 2 and stops at an EOS after the
    first: drafts that could be committed 2 + 1, accepted of them 2 + 1, tokens committed 2 + 1."""
    fn = commit_tokens_ref if ref else commit_tokens
    dev = "cpu" if ref else DEV
    out = torch.tensor([[7, 8, 9, 6], [5, 1, 4, 6]], device=dev)
    drafts = torch.tensor([[7, 8, 9], [5, 1, 3]], device=dev)
    valid = torch.ones(2, 3, dtype=torch.bool, device=dev)
    tokens = torch.zeros(2, 12, dtype=torch.long, device=dev)
    lengths, remaining = torch.tensor([2, 3], device=dev), torch.tensor([2, 10], device=dev)
    active = torch.tensor([True, True], device=dev)
    eos = torch.tensor([5, -1], device=dev)
    info, totals = torch.zeros(9, dtype=torch.long, device=dev), torch.zeros(4, dtype=torch.long, device=dev)
    fn(out, None, drafts, valid, tokens, lengths, remaining, active, eos, info, totals, count_step=True)
    assert lengths.tolist() == [4, 4] and active.tolist() == [False, False]
    assert totals.tolist() == [3, 3, 2, 3]
    assert info[1].item() == 5  # the acceptance counters still see what matched (3 + 2)


@pytest.mark.parametrize("ref", [False, True])
def test_rounds_are_counted_per_k_while_a_row_is_active(ref):
    from hf_accel.kernels.commit_tokens import TOTALS_SIZE

    fn = commit_tokens_ref if ref else commit_tokens
    dev = "cpu" if ref else DEV
    g = torch.Generator().manual_seed(3)
    totals = torch.zeros(TOTALS_SIZE, dtype=torch.long, device=dev)
    tokens = torch.zeros(2, 40, dtype=torch.long, device=dev)
    lengths, remaining = torch.tensor([2, 3], device=dev), torch.tensor([6, 1], device=dev)
    active = torch.tensor([True, True], device=dev)
    eos = torch.tensor([-1], device=dev)
    for k in (2, 0, 2, 2, 0, 0):  # row 1 finishes in the first round, row 0 runs out of budget in the third
        out = torch.randint(3, 9, (2, k + 1), generator=g).to(dev)
        drafts = out[:, :k].clone()  # all accepted
        valid = torch.ones(2, k, dtype=torch.bool, device=dev)
        info = torch.zeros(6 + k, dtype=torch.long, device=dev)
        fn(out, None, drafts, valid, tokens, lengths, remaining, active, eos, info, totals, count_step=k > 0)
    assert totals[4:].tolist()[:3] == [1, 0, 2] and totals[7:].sum() == 0  # k=0: 1 round, k=2: 2 rounds
    assert lengths.tolist() == [8, 4] and not active.any()
