"""Fixtures shared by the speculative-decoding tests."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models: one intra-op thread (the root conftest's ``one_thread``)."""
