"""Fused decode-step kernels compiled for a GPU vs their PyTorch references (transformers' ops).

Error rule, per element: |kernel - float64 reference| <= |PyTorch in the same dtype - float64 reference|
+ 1 ulp of the output dtype at that value (+1e-6): the kernel may round once more than PyTorch (it keeps
fp32 between fused ops where PyTorch rounds, or the reverse), never more. A max-over-tensor rule
(2x PyTorch's max error) failed on the H200 for bf16 RoPE + q/k-norm: 0.0248 vs 2 x 0.0122, one bf16
ulp at |x| in [2, 4). The residual sum must be bitwise equal to torch's. Skipped without CUDA.
"""

import pytest
import torch

from hf_accel.kernels.rms_norm import rms_norm, rms_norm_ref
from hf_accel.kernels.rope_cache import rope_and_cache, rope_and_cache_ref
from hf_accel.kernels.swiglu import swiglu, swiglu_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ulp(ref64, dtype):
    mag = ref64.abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(dtype).eps


def _check(out, same_dtype, ref64, scale=None):
    """``scale``: magnitude whose ulp bounds one rounding (default |ref|); for RoPE the size of the two
    products ``|x cos| + |rot(x) sin|``, since a sum that cancels keeps the rounding error of its terms."""
    err = (out.double() - ref64).abs()
    torch_err = (same_dtype.double() - ref64).abs()
    bound = torch_err + _ulp(ref64 if scale is None else scale, out.dtype) + 1e-6
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (
        f"kernel error {err.flatten()[worst].item():.3g} at |ref| {ref64.abs().flatten()[worst].item():.3g} vs "
        f"PyTorch's own {torch_err.flatten()[worst].item():.3g} + 1 ulp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_residual(dtype):
    x, r = torch.randn(5, 576, device="cuda", dtype=dtype), torch.randn(5, 576, device="cuda", dtype=dtype)
    w = torch.randn(576, device="cuda", dtype=dtype)
    y, s = rms_norm(x, w, 1e-5, r)
    y_ref, s_ref = rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(s, s_ref), "residual sum must round exactly like torch"
    _check(y, y_ref, rms_norm_ref(s_ref.double(), w.double(), 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(dtype):
    g, u = torch.randn(4, 1536, device="cuda", dtype=dtype), torch.randn(4, 1536, device="cuda", dtype=dtype)
    _check(swiglu(g, u), swiglu_ref(g, u), swiglu_ref(g.double(), u.double()))


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
    kc64, vc64 = kc2.double(), vc2.double()
    ref64 = rope_and_cache_ref(q.double(), k.double(), v.double(), cos.double(), sin.double(), kc64, vc64, slots,
                               None if w is None else w.double(), None if w is None else w.double(), 1e-6)
    # Rounding scale: |x cos| + |rot(x) sin| of the (normed) float64 inputs, per element for q and the
    # largest one for the cache (its written slots are scattered).
    def terms(x, heads):
        x = x.double().view(b, heads, d)
        if w is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        c, s_ = cos.double().abs()[:, None], sin.double().abs()[:, None]
        return x.abs() * c + torch.cat(x.abs().chunk(2, -1)[::-1], -1) * s_

    _check(out, ref, ref64, terms(q, h).view_as(ref64).maximum(ref64.abs()))
    _check(kc, kc2, kc64, torch.full_like(kc64, terms(k, hkv).max().item()).maximum(kc64.abs()))
    assert torch.equal(vc, vc2)


def _check_linear_bf16(fn, rows, hidden, out, mode):
    """``fn`` (fused_linear or gemv) in bf16 against transformers' ops in bf16 and float64: the residual sum
    exact, the output within PyTorch's own bf16 error + the extra roundings of a different summation order."""
    from hf_accel.kernels.fused_linear import fused_linear_ref

    torch.manual_seed(rows + hidden + out)
    dt = torch.bfloat16
    x = torch.randn(rows, hidden, device="cuda", dtype=dt)
    r = torch.randn(rows, hidden, device="cuda", dtype=dt)
    w = (torch.randn(out, hidden, device="cuda") / hidden**0.5).to(dt)
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dt)
    b = torch.randn(out, device="cuda", dtype=dt)
    kw = {}
    if mode.startswith("norm"):
        kw.update(norm_weight=nw, eps=1e-5, residual=r)
    if "swiglu" in mode:
        kw["swiglu"] = True
    if mode == "bias_f32":
        kw.update(bias=b, out_dtype=torch.float32)
    got = fn(x, w, **kw)
    same = fused_linear_ref(x, w, **kw)
    kw64 = {k: (v.double() if torch.is_tensor(v) else v) for k, v in kw.items()}
    kw64.pop("out_dtype", None)
    ref64 = fused_linear_ref(x.double(), w.double(), **kw64)
    if "residual" in kw:
        assert torch.equal(got[1], same[1]), "residual sum must round exactly like torch"
        got, same, ref64 = got[0], same[0], ref64[0]
    assert got.dtype == same.dtype and got.shape == same.shape
    # Both round the same intermediates; an fp32 sum in another order can move each rounding by an ulp.
    err = (got.double() - ref64).abs()
    bound = (same.double() - ref64).abs() + 4 * _ulp(ref64, dt) + 1e-3
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert (got.double() - same.double()).abs().mean() < 0.02 * same.double().abs().mean()


MODES = ["plain", "norm_residual", "norm_residual_swiglu", "bias_f32"]


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,hidden,out", [(1, 576, 960), (7, 576, 3072), (16, 4096, 1024), (1, 1536, 576)])
def test_fused_linear_bf16(rows, hidden, out, mode, split_k):
    from hf_accel.kernels.fused_linear import fused_linear

    _check_linear_bf16(lambda x, w, **kw: fused_linear(x, w, split_k=split_k, pdl=True, **kw), rows, hidden, out,
                       mode)


def test_fused_linear_whole_k_float32_beyond_shared_memory_raises():
    """float32 over all of K 1536 does not fit the H200's shared memory (whole_k_fits): a clear ValueError
    instead of Triton's OutOfResources; K 576 runs and matches the reference."""
    from hf_accel.kernels.fused_linear import fused_linear, fused_linear_ref
    from hf_accel.kernels.fused_linear_tiles import whole_k_fits

    g = torch.Generator(device="cuda").manual_seed(0)
    x, w = torch.randn(4, 1536, device="cuda", generator=g), torch.randn(64, 1536, device="cuda", generator=g)
    if whole_k_fits(1536, torch.float32, "cuda"):
        pytest.skip("this GPU's shared memory holds float32 K 1536")
    with pytest.raises(ValueError, match="whole_k does not fit 1536 input features of torch.float32"):
        fused_linear(x, w, whole_k=True)
    x, w = x[:, :576].contiguous(), w[:, :576].contiguous() / 24
    torch.testing.assert_close(fused_linear(x, w, whole_k=True), fused_linear_ref(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,hidden,out", [(2, 576, 960), (16, 576, 3072), (16, 1536, 576), (5, 4096, 1024),
                                             (16, 576, 49152), (32, 1536, 576), (19, 576, 3072), (64, 576, 3072),
                                             (128, 1536, 576)])
def test_fused_linear_whole_k_bf16(rows, hidden, out, mode):
    from hf_accel.kernels.fused_linear import fused_linear

    _check_linear_bf16(lambda x, w, **kw: fused_linear(x, w, whole_k=True, pdl=True, **kw), rows, hidden, out, mode)


@pytest.mark.parametrize("single_pass", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden,out", [(576, 960), (1536, 576), (4096, 6144), (14336, 4096), (4096, 128256)])
def test_gemv_bf16(hidden, out, mode, pdl, single_pass):
    from hf_accel.kernels.gemv import gemv

    _check_linear_bf16(lambda x, w, **kw: gemv(x, w, pdl=pdl, single_pass=single_pass, **kw), 1, hidden, out, mode)


@pytest.mark.parametrize("trigger", [True, "after_keys"])
@pytest.mark.parametrize("rows", [1, 4])
def test_pdl_chain_in_a_cuda_graph_is_bitwise_the_plain_chain(rows, trigger):
    """A chain of dependent matmuls (each reads the previous output; norm + residual, SwiGLU: gemv at 1 row,
    split-K fused_linear at 4) plus RoPE + cache write and split-KV paged attention merged in the kernel,
    captured in a CUDA graph and replayed: launched with PDL (attention triggering its dependents) it must
    give bitwise the results of plain launches (same kernels; a missing wait or a counter left non-zero would
    show), and the in-kernel merge must agree with the merge kernel."""
    from hf_accel.kernels.fused_linear import fused_linear
    from hf_accel.kernels.gemv import gemv as gemv1
    from hf_accel.kernels.paged_attention import paged_attention
    from hf_accel.kernels.rope_cache import rope_and_cache

    torch.manual_seed(0)
    dt, hidden, inter, heads, kv_heads, d = torch.bfloat16, 1024, 2816, 8, 2, 128
    layers = [dict(qkv=(torch.randn((heads + 2 * kv_heads) * d, hidden, device="cuda") / 32).to(dt),
                   o=(torch.randn(hidden, heads * d, device="cuda") / 32).to(dt),
                   gu=(torch.randn(2 * inter, hidden, device="cuda") / 32).to(dt),
                   down=(torch.randn(hidden, inter, device="cuda") / 53).to(dt),
                   n1=(1 + 0.1 * torch.randn(hidden, device="cuda")).to(dt),
                   n2=(1 + 0.1 * torch.randn(hidden, device="cuda")).to(dt)) for _ in range(4)]
    blocks, block_size, ctx = 64, 16, 700
    kc = torch.randn(blocks, block_size, kv_heads, d, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32)[None]
    seq_lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    slots = torch.tensor([int(table[0, (ctx - 1) // block_size]) * block_size + (ctx - 1) % block_size],
                         device="cuda", dtype=torch.int32)
    cos, sin = torch.rand(rows, d, device="cuda", dtype=dt), torch.rand(rows, d, device="cuda", dtype=dt)
    x0 = torch.randn(rows, hidden, device="cuda", dtype=dt)
    slots = slots - torch.arange(rows - 1, -1, -1, device="cuda", dtype=torch.int32)  # one block: slot offsets 8..11
    lin_counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    merge_counters = torch.zeros(kv_heads, dtype=torch.int32, device="cuda")

    def gemv(x, w, **kw):
        if rows == 1:
            return gemv1(x, w, **kw)
        return fused_linear(x, w, split_k=3, counters=lin_counters, **kw)

    def run(pdl, fused_merge=True):
        res, delta = x0, None
        for ly in layers:
            if delta is None:
                qkv = gemv(res, ly["qkv"], norm_weight=ly["n1"], eps=1e-5, pdl=pdl)
            else:
                qkv, res = gemv(delta, ly["qkv"], norm_weight=ly["n1"], eps=1e-5, residual=res, pdl=pdl)
            q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
            q = rope_and_cache(q, k, v, cos, sin, kc, vc, slots, pdl=pdl)
            o = paged_attention(q.view(1, rows, heads, d).transpose(1, 2), kc, vc, table, seq_lens, blocks * block_size,
                                num_splits=8, pdl=pdl, merge_counters=merge_counters if fused_merge else None,
                                trigger=trigger)
            delta = gemv(o.view(rows, heads * d), ly["o"], pdl=pdl)
            a, res = gemv(delta, ly["gu"], norm_weight=ly["n2"], eps=1e-5, residual=res, swiglu=True, pdl=pdl)
            delta = gemv(a, ly["down"], pdl=pdl)
        return delta, res

    outs = {}
    kc0, vc0 = kc.clone(), vc.clone()
    for pdl, fused_merge in ((False, True), (True, True), (False, False)):
        run(pdl, fused_merge)  # compile
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = run(pdl, fused_merge)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        outs[pdl, fused_merge] = [t.clone() for t in out] + [kc.clone()]
        kc.copy_(kc0)
        vc.copy_(vc0)
        assert int(lin_counters.abs().sum()) == 0 and int(merge_counters.abs().sum()) == 0
    for a, b in zip(outs[False, True], outs[True, True]):
        assert torch.equal(a, b)
    for a, b in zip(outs[False, True], outs[False, False]):  # fp32 merge in another order, then 4 layers
        assert (a.float() - b.float()).abs().mean() <= 0.01 * b.float().abs().mean()


@pytest.mark.parametrize("single_pass", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("heads,kv_heads,d,hidden", [(9, 3, 64, 576), (32, 8, 128, 4096)])
def test_gemv_rope_bf16_is_gemv_then_rope_and_cache(heads, kv_heads, d, hidden, pdl, single_pass):
    """Compiled for the GPU in bf16: the fused Q/K/V + RoPE + cache-write GEMV gives bitwise the results
    of gemv followed by rope_and_cache."""
    from hf_accel.kernels.gemv import gemv, gemv_rope

    torch.manual_seed(d)
    dt = torch.bfloat16
    x, r = torch.randn(1, hidden, device="cuda", dtype=dt), torch.randn(1, hidden, device="cuda", dtype=dt)
    w = (torch.randn((heads + 2 * kv_heads) * d, hidden, device="cuda") / hidden**0.5).to(dt)
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dt)
    ang = torch.rand(1, d // 2, device="cuda") * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
    kc = torch.randn(8, 16, kv_heads, d, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    slots = torch.tensor([37], dtype=torch.int32, device="cuda")
    qkv, res = gemv(x, w, norm_weight=nw, eps=1e-5, residual=r, pdl=pdl, single_pass=single_pass)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    want = rope_and_cache(q, k, v, cos, sin, kc1, vc1, slots, pdl=pdl)
    got, got_res = gemv_rope(x, w, cos, sin, kc2, vc2, slots, heads, norm_weight=nw, eps=1e-5, residual=r, pdl=pdl,
                             single_pass=single_pass)
    torch.cuda.synchronize()
    assert torch.equal(got_res, res) and torch.equal(got, want.reshape(1, -1))
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1) and not torch.equal(kc1, kc)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("rows", [2, 16, 20, 32, 128])
@pytest.mark.parametrize("heads,kv_heads,d,hidden", [(9, 3, 64, 576), (14, 2, 64, 896)])
def test_fused_linear_rope_bf16_is_fused_linear_then_rope_and_cache(heads, kv_heads, d, hidden, rows, pdl):
    """Compiled for the GPU in bf16: the several-row Q/K/V + RoPE + cache-write fused_linear matches
    fused_linear followed by rope_and_cache within 2 bf16 ulps (the same roundings; the products may sum
    in another order), every row's K/V in its slot, the residual sum bitwise."""
    from hf_accel.kernels.fused_linear import fused_linear, fused_linear_rope

    torch.manual_seed(rows + d)
    dt = torch.bfloat16
    x, r = torch.randn(rows, hidden, device="cuda", dtype=dt), torch.randn(rows, hidden, device="cuda", dtype=dt)
    w = (torch.randn((heads + 2 * kv_heads) * d, hidden, device="cuda") / hidden**0.5).to(dt)
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dt)
    ang = torch.rand(rows, d // 2, device="cuda") * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
    kc = torch.randn(8, 16, kv_heads, d, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    slots = torch.randperm(128, device="cuda")[:rows].to(torch.int32)
    qkv, res = fused_linear(x, w, norm_weight=nw, eps=1e-5, residual=r, pdl=pdl, whole_k=rows > 32)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    want = rope_and_cache(q, k, v, cos, sin, kc1, vc1, slots, pdl=pdl).reshape(rows, -1)
    got, got_res = fused_linear_rope(x, w, cos, sin, kc2, vc2, slots, heads, norm_weight=nw, eps=1e-5, residual=r,
                                     pdl=pdl, whole_k=rows > 32)  # more than 32 rows: the whole-K path only
    torch.cuda.synchronize()
    assert torch.equal(got_res, res)
    for a, b in ((got, want), (kc2, kc1), (vc2, vc1)):
        err = (a.double() - b.double()).abs()
        assert bool((err <= 2 * _ulp(b.double(), dt) + 1e-6).all()), float(err.max())
    written = (kc2 != kc).any(-1).any(-1)
    assert int(written.sum()) == rows
