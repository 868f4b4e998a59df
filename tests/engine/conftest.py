"""Fixtures shared by the fast-decode-path tests."""

import pytest

from hf_accel.engine.decode_step import DecodeStep


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models: one intra-op thread (the root conftest's ``one_thread``)."""


@pytest.fixture
def decode_steps(monkeypatch):
    """Records every decode step of the fast path: the ``fused`` flag of the DecodeStep that ran."""
    calls: list[bool] = []
    original = DecodeStep._forward

    def counting(self):
        calls.append(self.fused)
        return original(self)

    monkeypatch.setattr(DecodeStep, "_forward", counting)
    return calls
