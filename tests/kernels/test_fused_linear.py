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


# The norm prologue in steps of 512 columns (the whole padded row of K 333), of 32 columns (11 steps) and of
# the K tile (0, the default).
@pytest.mark.parametrize("norm_k", [512, 32, 0])
@pytest.mark.parametrize("rows", [3, 20])
def test_norm_prologue_steps_match_reference_fp32(rows, norm_k):
    x, r, w, nw, _ = linear_inputs(rows, 333, 24, torch.float32, seed=7)
    got, res = fused_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, norm_k=norm_k)
    want, want_res = fused_linear_ref(x, w, norm_weight=nw, eps=1e-5, residual=r)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="norm_k"):
        fused_linear(x, w, norm_weight=nw, norm_k=48)


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


@pytest.mark.parametrize("rows,hidden,out,split_k,preload", [(1, 64, 48, 4, False), (3, 96, 80, 3, True),
                                                              (16, 80, 16, 2, False), (5, 333, 40, 5, True)])
@pytest.mark.parametrize("mode", MODES)
def test_split_k_matches_reference_fp32(rows, hidden, out, split_k, mode, preload):
    """Split-K (partials reduced by the last program of each output tile to arrive) against the reference,
    with the arrival counters left at zero (the same counters serve the next call)."""
    x, r, w, nw, b = linear_inputs(rows, hidden, out * (2 if "swiglu" in mode else 1), torch.float32, seed=split_k)
    kw = linear_kwargs(mode, r, nw, b)
    counters = torch.zeros(16, dtype=torch.int32)
    want = fused_linear_ref(x, w, **kw)
    for _ in range(2):
        got = fused_linear(x, w, split_k=split_k, counters=counters, block_k=16, block_n=16, preload=preload, **kw)
        assert int(counters.abs().sum()) == 0, "arrival counters not reset"
        if "residual" in mode:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
            got_y, want_y = got[0], want[0]
        else:
            got_y, want_y = got, want
        torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-5)


def test_split_k_sums_every_split():
    # One split's share missing would still be close for small weights: make the shares distinct and large.
    x = torch.ones(2, 64)
    w = torch.zeros(16, 64)
    for s in range(4):
        w[:, 16 * s: 16 * (s + 1)] = 10.0 ** s
    got = fused_linear(x, w, split_k=4, block_k=16, block_n=16)
    torch.testing.assert_close(got, torch.full((2, 16), 16 * 1111.0))


def test_split_k_bad_arguments_raise():
    x, _, w, _, _ = linear_inputs(2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="split_k must be"):
        fused_linear(x, w, split_k=0)
    with pytest.raises(ValueError, match="counters must be"):
        fused_linear(x, w, split_k=2, block_k=16, block_n=16, counters=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="counters must be"):
        fused_linear(x, w, split_k=2, block_k=16, block_n=16, counters=torch.zeros(4))
