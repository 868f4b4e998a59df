"""Which inputs fused_linear's whole-K path takes on a GPU (whole_k_fits), checked with the GPU's shared memory
per block faked, so it runs anywhere; the launches themselves are in test_fused_gpu.py."""

import pytest
import torch

from hf_accel.kernels import fused_linear_tiles as fl

H200 = 232448  # bytes of shared memory per block (opt-in)
CUDA = torch.device("cuda", 0)


@pytest.fixture
def shared_memory(monkeypatch):
    def set_bytes(n):
        monkeypatch.setattr(fl, "_shared_memory_per_block", lambda index: n)

    return set_bytes


def test_cpu_takes_any_dtype_up_to_the_widest_input():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert fl.whole_k_fits(fl.WHOLE_K_MAX, dtype, "cpu")
        assert not fl.whole_k_fits(fl.WHOLE_K_MAX + 1, dtype, "cpu")


def test_16_bit_on_a_gpu_with_the_h200s_shared_memory(shared_memory):
    shared_memory(H200)
    for dtype in (torch.float16, torch.bfloat16):
        assert fl.whole_k_fits(4096, dtype, CUDA, 64)
        assert not fl.whole_k_fits(4097, dtype, CUDA)
    shared_memory(101376)  # a GPU with less shared memory per block: not where the path was tested
    assert not fl.whole_k_fits(576, torch.bfloat16, CUDA)


def test_float32_on_a_gpu_while_its_tiles_fit(shared_memory):
    """The H200 failure: (32 + 16) x 1536 x 4 = 294,912 bytes; K 576 with 64 weight rows (SwiGLU's gate/up):
    (64 + 16) x 576 x 4 = 184,320 bytes, which ran."""
    shared_memory(H200)
    assert not fl.whole_k_fits(1536, torch.float32, CUDA, 32)
    assert fl.whole_k_fits(576, torch.float32, CUDA, 64)
    assert fl.whole_k_fits(256, torch.float32, CUDA, 64)  # the tiny models of test_fast_generate_gpu.py
    assert not fl.whole_k_fits(576, torch.float32, CUDA, 128)  # (128 + 16) x 576 x 4 = 331,776
    assert not fl.whole_k_fits(64, torch.float64, CUDA)


def test_decode_step_keeps_the_k_loop_where_whole_k_does_not_fit(shared_memory, monkeypatch):
    """_split_linear asks whole_k_fits with the call's own tensors: float32 K 1536 on a (faked) H200 takes the
    K loop, K 576 the whole-K path."""
    from hf_accel.engine import decode_step

    shared_memory(H200)
    seen = []
    monkeypatch.setattr(decode_step, "fused_linear", lambda x, w, **kw: seen.append(kw.get("whole_k", False)))
    step = decode_step.DecodeStep.__new__(decode_step.DecodeStep)
    step.sms, step.linear_counters = 132, None

    class FakeCuda:  # a float32 tensor that says it is on a GPU
        def __init__(self, *shape):
            self.shape, self.dtype, self.device = shape, torch.float32, CUDA

    step._split_linear(FakeCuda(16, 1536), FakeCuda(576, 1536))
    step._split_linear(FakeCuda(16, 576), FakeCuda(3072, 576), swiglu=True)
    assert seen == [False, True]
