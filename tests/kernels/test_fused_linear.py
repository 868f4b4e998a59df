"""fused_linear (RMSNorm/residual prologue, SwiGLU/bias/float32 epilogues) against its PyTorch reference."""

import pytest
import torch

from linear_cases import MODES, linear_inputs, linear_kwargs

from hf_accel.kernels.fused_linear import MAX_ROWS, fused_linear, fused_linear_ref


@pytest.mark.parametrize("rows,hidden,out", [(1, 64, 48), (3, 96, 80), (16, 40, 16), (20, 333, 40)])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_fp32(rows, hidden, out, mode):
    x, r, w, nw, b = linear_inputs(rows, hidden, out, torch.float32)
    kw = linear_kwargs(mode, r, nw, b)
    got = fused_linear(x, w, **kw)
    want = fused_linear_ref(x, w, **kw)
    if "residual" in mode:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_half_rounding_close_to_reference():
    # float16: Triton's interpreter truncates float32 -> bfloat16 and cannot run bfloat16 tl.dot, so the
    # bfloat16 case is in test_fused_gpu.py.
    x, r, w, nw, _ = linear_inputs(4, 128, 64, torch.float16, seed=1)
    got, res = fused_linear(x, w, norm_weight=nw, eps=1e-6, residual=r, swiglu=True)
    want, want_res = fused_linear_ref(x, w, norm_weight=nw, eps=1e-6, residual=r, swiglu=True)
    assert torch.equal(res, want_res)
    # Same roundings, different fp32 summation order: at most an ulp or so apart.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -9, atol=2e-3)


def test_wrong_norm_or_residual_is_detected():
    # The reference check above would fail if the kernel skipped the norm or the residual: make sure.
    x, r, w, nw, _ = linear_inputs(2, 64, 32, torch.float32, seed=2)
    got = fused_linear(x, w, norm_weight=nw, residual=r)[0]
    assert not torch.allclose(got, fused_linear_ref(x, w, norm_weight=nw))
    assert not torch.allclose(got, fused_linear_ref(x + r, w))


def test_bad_inputs_raise():
    x, r, w, nw, b = linear_inputs(2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="at most"):
        fused_linear(torch.zeros(MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="residual needs norm_weight"):
        fused_linear(x, w, residual=r)
    with pytest.raises(ValueError, match="dtypes differ"):
        fused_linear(x, w.double())
    with pytest.raises(ValueError, match="bias is not supported with swiglu"):
        fused_linear(x, w, swiglu=True, bias=b)
    with pytest.raises(ValueError, match="x must be"):
        fused_linear(x, w[:, :32])
    # Strided bias / norm weight: the kernel reads them as contiguous vectors, so they must be refused.
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        fused_linear(x, w, bias=torch.stack([b, b], 1)[:, 0])
    with pytest.raises(ValueError, match="norm_weight must be a contiguous"):
        fused_linear(x, w, norm_weight=torch.stack([nw, nw], 1)[:, 0])
