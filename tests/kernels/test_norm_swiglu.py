"""RMSNorm (+ residual) and SwiGLU kernels of the fused decode step against their PyTorch references, float32.

Runs under Triton's interpreter on the CPU and compiled on a GPU (tests/kernels/test_fused_gpu.py checks the
half-precision dtypes there with an ulp rule). Shapes not multiples of the kernels' blocks (576 = SmolLM2's hidden
size, 1536 its intermediate size) and strided rows.
"""

from __future__ import annotations

import pytest
import torch

from hf_accel.kernels.rms_norm import rms_norm, rms_norm_ref
from hf_accel.kernels.swiglu import swiglu, swiglu_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [576, 64])
def test_rms_norm_equals_reference(hidden, residual):
    x, w = _randn(3, hidden, seed=0) * 3, _randn(hidden, seed=1)
    r = _randn(3, hidden, seed=2) if residual else None
    out = rms_norm(x, w, 1e-5, r)
    ref = rms_norm_ref(x, w, 1e-5, r)
    if residual:
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(out[1], ref[1])  # the residual sum x + r, as torch adds it
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # against the definition, in float64: w * (s / sqrt(mean(s^2) + eps)), s = x (+ r)
    s = (x + r if residual else x).double()
    want = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close((out[0] if residual else out).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cols", [1536, 100])
def test_swiglu_equals_reference(cols):
    both = _randn(4, 2 * cols, seed=3) * 4  # gate and up as views into one tensor (strided rows)
    gate, up = both[:, :cols], both[:, cols:]
    out = swiglu(gate, up)
    torch.testing.assert_close(out, swiglu_ref(gate, up), rtol=1e-5, atol=1e-5)
    g64, u64 = gate.double(), up.double()
    torch.testing.assert_close(out.double(), g64 * torch.sigmoid(g64) * u64, rtol=1e-5, atol=1e-5)
