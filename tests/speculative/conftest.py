"""Fixtures shared by the speculative-decoding tests."""

import pytest

from hf_accel.speculative.draft_length import _GatedChooser, _KChooser


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models: one intra-op thread (the root conftest's ``one_thread``)."""


@pytest.fixture
def alternating_k(monkeypatch):
    """The chooser alternates one verify step with k = 3 and a burst of three plain rounds."""
    calls = []

    def choose(self, max_remaining, burst=True):
        calls.append(len(calls))
        return (3, 1) if len(calls) % 2 else (0, 3)

    def choose_gated(self, counts, max_remaining=None, burst=True):  # match-gated prompt lookup: the same
        return choose(self, max_remaining)

    monkeypatch.setattr(_KChooser, "choose", choose)
    monkeypatch.setattr(_GatedChooser, "choose", choose_gated)
    return calls


@pytest.fixture
def verify_on_match(monkeypatch):
    """The match-gated chooser verifies k_max drafts whenever a row matched, else runs a plain round; the
    class counts it was given are recorded."""
    seen = []

    def choose(self, counts, max_remaining=None, burst=True):
        seen.append(list(counts))
        return (self.k_max, 1) if any(counts[1:]) else (0, 1)

    monkeypatch.setattr(_GatedChooser, "choose", choose)
    return seen
