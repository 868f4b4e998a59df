"""fill_from_host writes the values then the pad, in stream order on CUDA; bad shapes raise. (EOS ids that change
between generate calls: test_fast_greedy_eos.py and the speculative GPU tests.)"""

import pytest
import torch

from hf_accel.engine.transfers import fill_from_host


def test_values_then_pad():
    dst = torch.full((8,), 123, dtype=torch.long)
    assert fill_from_host(dst, [2, 5], -1) is dst
    assert dst.tolist() == [2, 5, -1, -1, -1, -1, -1, -1]
    fill_from_host(dst, (7,), -1)  # fewer values than before: the old ones are overwritten by the pad
    assert dst.tolist() == [7, -1, -1, -1, -1, -1, -1, -1]
    fill_from_host(dst, [], -1)
    assert dst.tolist() == [-1] * 8
    full = list(range(10, 18))
    assert fill_from_host(dst, full, -1).tolist() == full


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="3 values for a destination of shape \\(2,\\)"):
        fill_from_host(torch.zeros(2, dtype=torch.long), [1, 2, 3], -1)
    with pytest.raises(ValueError, match="1-D"):
        fill_from_host(torch.zeros(2, 2, dtype=torch.long), [1], -1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fill_is_ordered_after_queued_work():
    # a long kernel queued first, then a write that would race it if it were not stream-ordered
    x = torch.randn(4096, 4096, device="cuda")
    dst = torch.zeros(8, dtype=torch.long, device="cuda")
    for _ in range(5):
        x = x @ x / 64
    dst.fill_(-3)
    fill_from_host(dst, [11, 12], -1)
    assert dst.tolist() == [11, 12, -1, -1, -1, -1, -1, -1]
