"""Fixtures shared by the fast-decode-path tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The CPU decode step runs one small softmax per row and layer; with several intra-op threads on a
    busy shared machine each of those waits for a time slice. One thread keeps these tests fast."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
