"""copy_from_host: values land in the destination (CPU here; the non-blocking path in the GPU file), bad sizes raise."""

import pytest
import torch

from hf_accel.engine.transfers import copy_from_host


def test_copies_lists_and_tensors():
    dst = torch.full((8,), -7, dtype=torch.long)
    assert copy_from_host(dst, [2, 5, -1, -1, -1, -1, -1, 3]) is dst
    assert dst.tolist() == [2, 5, -1, -1, -1, -1, -1, 3]
    table = torch.randint(0, 1000, (3, 4), dtype=torch.int32)
    out = torch.zeros(3, 4, dtype=torch.int32)
    copy_from_host(out, table)
    assert torch.equal(out, table)
    part = torch.zeros(8, dtype=torch.long)
    copy_from_host(part[:2], (9, 4))
    assert part.tolist() == [9, 4, 0, 0, 0, 0, 0, 0]


def test_casts_to_the_destination_dtype():
    dst = torch.zeros(3, dtype=torch.int32)
    copy_from_host(dst, torch.tensor([1, 2, 3], dtype=torch.long))
    assert dst.dtype == torch.int32 and dst.tolist() == [1, 2, 3]


def test_empty():
    dst = torch.zeros(0, dtype=torch.long)
    assert copy_from_host(dst, []).numel() == 0


def test_wrong_size_raises():
    with pytest.raises(ValueError, match="3 values for a destination of 2"):
        copy_from_host(torch.zeros(2, dtype=torch.long), [1, 2, 3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_is_ordered_after_queued_work():
    # a long kernel queued first: the copy must land after it (stream order), with the right values
    x = torch.randn(4096, 4096, device="cuda")
    dst = torch.zeros(8, dtype=torch.long, device="cuda")
    for _ in range(5):
        x = x @ x / 64
    dst.fill_(-3)
    copy_from_host(dst, [11, 12, 13, 14, 15, 16, 17, 18])
    assert dst.tolist() == [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refused_inside_a_graph_capture():
    dst = torch.zeros(4, dtype=torch.long, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        with torch.cuda.graph(g):
            copy_from_host(dst, [1, 2, 3, 4])
