"""Fused decode-step kernels compiled for a GPU vs their PyTorch references (transformers' ops).

bf16 must agree to within one rounding of the output (the kernels round where transformers rounds);
fp32 to 1e-5 relative. Skipped without CUDA (the CPU suite checks them under the interpreter).
"""

import pytest
import torch

from hf_accel.kernels.rms_norm import rms_norm, rms_norm_ref
from hf_accel.kernels.rope_cache import rope_and_cache, rope_and_cache_ref
from hf_accel.kernels.swiglu import swiglu, swiglu_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ulp_close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:  # at most one bf16/fp16 rounding step apart
        eps = torch.finfo(dtype).eps
        assert ((a.float() - b.float()).abs() <= eps * b.float().abs() * 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_residual(dtype):
    x, r = torch.randn(5, 576, device="cuda", dtype=dtype), torch.randn(5, 576, device="cuda", dtype=dtype)
    w = torch.randn(576, device="cuda", dtype=dtype)
    y, s = rms_norm(x, w, 1e-5, r)
    y_ref, s_ref = rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(s, s_ref), "residual sum must round exactly like torch"
    _ulp_close(y, y_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(dtype):
    g, u = torch.randn(4, 1536, device="cuda", dtype=dtype), torch.randn(4, 1536, device="cuda", dtype=dtype)
    _ulp_close(swiglu(g, u), swiglu_ref(g, u), dtype)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache(dtype, qk_norm):
    b, h, hkv, d = 3, 9, 3, 64
    q = torch.randn(b, h * d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv * d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv * d, device="cuda", dtype=dtype)
    ang = torch.rand(b, d // 2, device="cuda") * 100
    cos = torch.cat([ang.cos()] * 2, -1).to(dtype)
    sin = torch.cat([ang.sin()] * 2, -1).to(dtype)
    kc = torch.randn(12, 16, hkv, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([3, 40, -1], dtype=torch.int32, device="cuda")
    w = torch.randn(d, device="cuda", dtype=dtype) if qk_norm else None
    out = rope_and_cache(q, k, v, cos, sin, kc, vc, slots, w, w, 1e-6)
    ref = rope_and_cache_ref(q, k, v, cos, sin, kc2, vc2, slots, w, w, 1e-6)
    _ulp_close(out, ref, dtype)
    _ulp_close(kc, kc2, dtype)
    assert torch.equal(vc, vc2)
