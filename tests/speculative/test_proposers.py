"""Prompt lookup (hf_accel.speculative.proposers.prompt_lookup) against a plain-Python reference."""

from __future__ import annotations

import time

import pytest
import torch

from hf_accel.speculative.proposers import prompt_lookup


def lookup_ref(row: list[int], start: int, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The tokens after the first earlier occurrence of the longest matching suffix n-gram."""
    length = len(row)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length - n < start:
            continue
        suffix = row[length - n:]
        for s in range(start, length - n):
            if row[s: s + n] == suffix:
                return row[s + n: s + n + k]
    return []


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 8])
def test_matches_reference(seed, k):
    g = torch.Generator().manual_seed(seed)
    batch, cap = 5, 40
    vocab = 4 + seed  # small vocabularies: many matches of every length
    tokens = torch.randint(1, vocab, (batch, cap), generator=g)
    lengths = torch.randint(2, cap + 1, (batch,), generator=g)
    starts = torch.minimum(torch.randint(0, 6, (batch,), generator=g), lengths - 1)
    for b in range(batch):
        tokens[b, : starts[b]] = 0  # left padding (never matched)
        tokens[b, lengths[b]:] = 99  # past the committed tokens (never read)
    drafts, valid = prompt_lookup(tokens, lengths, starts, k, max_ngram=3, min_ngram=1)
    for b in range(batch):
        row = tokens[b, : lengths[b]].tolist()
        want = lookup_ref(row, int(starts[b]), k, 3, 1)
        got = drafts[b][valid[b]].tolist()
        assert got == want, (b, row, int(starts[b]))
        assert valid[b].tolist() == [True] * len(want) + [False] * (k - len(want))  # a prefix


def test_prefers_longer_ngrams_and_the_first_occurrence():
    #      0  1  2  3  4  5  6  7  8  9  10 11
    row = [7, 4, 6, 7, 1, 6, 7, 2, 7, 3, 6, 7]
    tokens = torch.tensor([row + [0] * 4])
    lengths, starts = torch.tensor([len(row)]), torch.tensor([0])
    drafts, valid = prompt_lookup(tokens, lengths, starts, 2, max_ngram=2, min_ngram=1)
    assert drafts[0][valid[0]].tolist() == [1, 6]  # "6 7" first at 2-3, followed by 1 6
    drafts, valid = prompt_lookup(tokens, lengths, starts, 2, max_ngram=1, min_ngram=1)
    assert drafts[0][valid[0]].tolist() == [4, 6]  # "7" first at 0
    drafts, valid = prompt_lookup(tokens, lengths, torch.tensor([1]), 2, max_ngram=1, min_ngram=1)
    assert drafts[0][valid[0]].tolist() == [1, 6]  # position 0 is padding: "7" first at 3


def test_no_match_gives_no_draft():
    tokens = torch.tensor([[1, 2, 3, 4, 5, 0, 0]])
    drafts, valid = prompt_lookup(tokens, torch.tensor([5]), torch.tensor([0]), 4)
    assert not valid.any()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 5, 8])
def test_kernel_matches_reference(seed, k):
    from hf_accel.kernels.ngram_lookup import ngram_lookup, ngram_lookup_ref

    g = torch.Generator().manual_seed(seed)
    batch, cap = 4, 37 + 20 * seed  # capacities that are not powers of two
    tokens = torch.randint(1, 4 + seed, (batch, cap), generator=g)
    lengths = torch.randint(2, cap + 1, (batch,), generator=g)
    starts = torch.minimum(torch.randint(0, 6, (batch,), generator=g), lengths - 1)
    for max_ngram, min_ngram in ((3, 1), (2, 2), (4, 2)):
        want = ngram_lookup_ref(tokens, lengths, starts, k, max_ngram, min_ngram, with_ngram=True)
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU
        got = [t.cpu() for t in ngram_lookup(tokens.to(dev), lengths.to(dev), starts.to(dev), k, max_ngram, min_ngram,
                                             with_ngram=True)]
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (max_ngram, min_ngram)
        assert torch.equal(got[2], want[2]), (max_ngram, min_ngram)
        assert torch.equal(want[2], _brute_ngram(tokens, lengths, starts, max_ngram, min_ngram)), (max_ngram, min_ngram)


def _brute_ngram(tokens, lengths, starts, max_ngram, min_ngram):
    """The longest n in [min_ngram, max_ngram] whose last n committed tokens occur earlier in the row (not in
    its padding, followed by a committed token); 0 if none."""
    out = []
    for row, length, start in zip(tokens.tolist(), lengths.tolist(), starts.tolist()):
        best = 0
        for n in range(max_ngram, min_ngram - 1, -1):
            suffix = row[length - n:length]
            if length - n >= start and any(row[s:s + n] == suffix for s in range(start, length - n)):
                best = n
                break
        out.append(best)
    return torch.tensor(out)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_lookup_into_buffers(use_kernel):
    """``out=``: the drafts, valid masks and matched n written into the given buffers, as the reference."""
    from hf_accel.kernels.ngram_lookup import ngram_lookup_ref

    dev = "cuda" if use_kernel and torch.cuda.is_available() else "cpu"  # the kernel's CPU path: interpreter
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 5, (3, 29), generator=g).to(dev)
    lengths, starts = torch.tensor([29, 17, 9], device=dev), torch.tensor([0, 2, 1], device=dev)
    bufs = (torch.full((3, 5), -7, dtype=torch.long, device=dev), torch.zeros(3, 5, dtype=torch.bool, device=dev),
            torch.full((3,), -7, dtype=torch.long, device=dev))
    got = prompt_lookup(tokens, lengths, starts, 5, use_kernel=use_kernel, out=bufs)
    want = ngram_lookup_ref(tokens, lengths, starts, 5, with_ngram=True)
    assert all(a is b for a, b in zip(got, bufs))
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


@pytest.mark.parametrize("seed", range(6))
def test_kernel_class_counts_match_torch_path(seed):
    """``class_counts`` (batch 1): the lookup launch writes the row's class counts as the zero fill + scatter-add
    of the active row gave them, and clamps the matched n to the last class, as ``clamp_`` did."""
    from hf_accel.kernels.ngram_lookup import ngram_lookup, ngram_lookup_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU
    g = torch.Generator().manual_seed(seed)
    cap = 41
    tokens = torch.randint(1, 3 + seed % 3, (1, cap), generator=g)
    lengths = torch.randint(12, cap + 1, (1,), generator=g)
    starts = torch.randint(0, 3, (1,), generator=g)
    for max_ngram, num_classes, active in ((3, 8, True), (6, 4, True), (6, 4, False), (2, 2, True)):
        drafts, valid, ngram = ngram_lookup_ref(tokens, lengths, starts, 5, max_ngram, 1, with_ngram=True)
        want_ngram = ngram.clamp(max=num_classes - 1)
        want = torch.zeros(num_classes, dtype=torch.long).scatter_add_(0, want_ngram, torch.tensor([int(active)]))
        counts = torch.full((num_classes,), -5, dtype=torch.long, device=dev)
        bufs = (torch.empty(1, 5, dtype=torch.long, device=dev), torch.empty(1, 5, dtype=torch.bool, device=dev),
                torch.empty(1, dtype=torch.long, device=dev))
        ngram_lookup(tokens.to(dev), lengths.to(dev), starts.to(dev), 5, max_ngram, 1, out=bufs, class_counts=counts,
                     active=torch.tensor([active], device=dev))
        assert torch.equal(counts.cpu(), want), (max_ngram, num_classes, active, ngram)
        assert torch.equal(bufs[2].cpu(), want_ngram) and torch.equal(bufs[0].cpu(), drafts)
        assert torch.equal(bufs[1].cpu(), valid)


def test_kernel_class_counts_bad_arguments():
    from hf_accel.kernels.ngram_lookup import ngram_lookup

    tokens, lengths, starts = torch.randint(1, 4, (2, 20)), torch.tensor([20, 15]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="batch 1"):
        ngram_lookup(tokens, lengths, starts, 3, class_counts=torch.zeros(4, dtype=torch.long),
                     active=torch.ones(2, dtype=torch.bool))
    for counts in (torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.int32)):
        with pytest.raises(ValueError, match="class_counts must be"):
            ngram_lookup(tokens[:1], lengths[:1], starts[:1], 3, class_counts=counts, active=torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs active"):
        ngram_lookup(tokens[:1], lengths[:1], starts[:1], 3, class_counts=torch.zeros(4, dtype=torch.long))


class _LargestTensor(torch.overrides.TorchFunctionMode):
    """Records the most elements of any tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("use_kernel", [False, True])
def test_lookup_work_follows_committed_tokens_not_capacity(use_kernel):
    """A row's capacity is prompt + max_new_tokens, which a caller may set to millions: a round compares only the
    committed tokens (the PyTorch path made [batch, capacity, n] comparisons every round, 737 ms a round on CPU
    at max_new_tokens=10**7), with the drafts of a small buffer. The size check covers the PyTorch path; the
    kernel (Triton's interpreter on CPU) makes no torch tensors: for it the time is checked, with a wide margin (its
    scan of the whole capacity took ~40 s on a 2-core CPU before it stopped at the row's length, ~0.5 s since)."""
    g = torch.Generator().manual_seed(0)
    committed = torch.randint(1, 5, (2, 60), generator=g)
    lengths, starts = torch.tensor([60, 45]), torch.tensor([0, 3])
    small = torch.zeros(2, 64, dtype=torch.long)
    small[:, :60] = committed
    want = prompt_lookup(small, lengths, starts, 5, use_kernel=use_kernel)
    huge = torch.zeros(2, 2_000_000, dtype=torch.long)
    huge[:, :60] = committed
    dev = "cuda" if use_kernel and torch.cuda.is_available() else "cpu"  # the kernel: Triton's interpreter on CPU
    huge, lengths, starts = huge.to(dev), lengths.to(dev), starts.to(dev)
    start = time.perf_counter()
    with _LargestTensor() as seen:
        got = prompt_lookup(huge, lengths, starts, 5, use_kernel=use_kernel)
    seconds = time.perf_counter() - start
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert seen.most <= 2 * 64 * 3, seen.most  # nothing of the capacity's size (2 x 2e6) was made
    if use_kernel and dev == "cpu":  # the interpreter runs each scanned block in Python: ~0.5 s now, ~40 s before
        assert seconds < 15, seconds


@pytest.mark.parametrize("use_kernel", [False, True])
def test_lookup_of_a_row_whose_padding_spans_whole_scan_blocks(use_kernel):
    """The kernel's scan starts at the block holding the row's first real token: a left padding of more than one
    1024-token block, with a match inside the padding (never used) and one after it."""
    cap, start, length = 2100, 1100, 2000
    tokens = torch.full((1, cap), 3, dtype=torch.long)
    tokens[0, :start] = 0
    tokens[0, 5:8] = torch.tensor([7, 8, 9])  # in the padding: not a match
    tokens[0, 1500:1504] = torch.tensor([7, 8, 1, 2])
    tokens[0, length - 2:length] = torch.tensor([7, 8])
    dev = "cuda" if use_kernel and torch.cuda.is_available() else "cpu"  # the kernel: Triton's interpreter on CPU
    drafts, valid = prompt_lookup(tokens.to(dev), torch.tensor([length], device=dev), torch.tensor([start], device=dev),
                                  3, max_ngram=2, use_kernel=use_kernel)
    assert drafts[0][valid[0]].tolist() == [1, 2, 3]
