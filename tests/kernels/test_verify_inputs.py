"""verify_inputs (one-launch inputs of a speculative verify pass) against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from hf_accel.kernels.verify_inputs import verify_inputs, verify_inputs_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU


@pytest.mark.parametrize("k", [0, 1, 4, 15, 32])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("seed", range(2))
def test_matches_reference(seed, batch, k):
    g = torch.Generator().manual_seed(seed)
    cap = 50
    tokens = torch.randint(0, 1000, (batch, cap), generator=g).to(DEV)
    lengths = torch.randint(1, cap, (batch,), generator=g).to(DEV)
    starts = (torch.rand(batch, generator=g) * lengths.cpu()).long().to(DEV)
    wide = torch.randint(0, 1000, (batch, k + 3), generator=g).to(DEV)
    drafts = wide[:, :k]  # a column slice of a wider buffer, as the match-gated rounds pass
    got = verify_inputs(tokens, lengths, starts, drafts)
    want = verify_inputs_ref(tokens, lengths, starts, drafts)
    for a, b, name in zip(got, want, ("ids", "positions", "cache_lens")):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert got[0][:, 0].tolist() == [int(tokens[r, lengths[r] - 1]) for r in range(batch)]


def test_rejects_bad_input():
    t = torch.zeros(2, 8, dtype=torch.long, device=DEV)
    lens = torch.ones(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="verify_inputs"):
        verify_inputs(t, lens, lens, torch.zeros(3, 2, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="verify_inputs"):
        verify_inputs(t, lens.int(), lens, torch.zeros(2, 2, dtype=torch.long, device=DEV))
