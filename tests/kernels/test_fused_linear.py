"""fused_linear (RMSNorm/residual prologue, SwiGLU/bias/float32 epilogues) against its PyTorch reference."""

import pytest
import torch

from linear_cases import MODES, linear_inputs, linear_kwargs

from hf_accel.kernels.fused_linear import fused_linear, fused_linear_ref
from hf_accel.kernels.fused_linear_tiles import MAX_ROWS

# CPU tensors through Triton's interpreter; tests/kernels/test_fused_gpu.py runs the kernels on a GPU.
pytestmark = pytest.mark.interpreter


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


def test_small_layer_tiles():
    # SmolLM2's layer (hidden 576, intermediate 1536) at 16 rows: the small-layer tiles of the PDL sweep (off by
    # default); wide inputs and LM-head-sized outputs keep the others. (block_m, block_n, block_k, warps, stages)
    from hf_accel.kernels.fused_linear_tiles import _tiles

    small = dict(small_tiles=True)
    assert _tiles(16, 960, 576, True, False, None, None, None, None, **small) == (16, 32, 256, 4, 3)  # q/k/v + norm
    assert _tiles(16, 576, 576, False, False, None, None, None, None, **small) == (16, 16, 256, 1, 3)  # o
    assert _tiles(16, 1536, 576, True, True, None, None, None, None, **small) == (16, 32, 128, 2, 3)  # gate/up
    assert _tiles(16, 576, 1536, False, False, None, None, None, None, **small) == (16, 16, 256, 1, 3)  # down
    assert _tiles(16, 2048, 8192, False, False, None, None, None, None, **small) == (16, 32, 256, 4, 5)  # wide
    assert _tiles(16, 49152, 576, True, False, None, None, None, None, **small) == (16, 64, 256, 4, 3)  # LM head
    assert _tiles(20, 576, 576, False, False, 32, 64, 8, 2, **small) == (32, 32, 64, 8, 2)  # overrides win
    assert _tiles(16, 576, 576, False, False, None, None, None, None) == (16, 32, 256, 4, 5)  # the default


@pytest.mark.parametrize("num_warps", [1, 2, 8])
def test_num_warps_override_matches_reference_fp32(num_warps):
    x, r, w, nw, _ = linear_inputs(5, 96, 64, torch.float32, seed=3)
    got, res = fused_linear(x, w, norm_weight=nw, residual=r, swiglu=True, num_warps=num_warps)
    want, want_res = fused_linear_ref(x, w, norm_weight=nw, residual=r, swiglu=True)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for bad in (3, 0, True, 32, "4"):
        with pytest.raises(ValueError, match="num_warps"):
            fused_linear(x, w, num_warps=bad)
    for name, bad in (("block_n", 24), ("block_n", 0), ("block_n", 8), ("block_k", 24), ("block_k", 8)):
        with pytest.raises(ValueError, match=name):
            fused_linear(x, w, **{name: bad})
    for bad in (None, "a", True):
        with pytest.raises(ValueError, match="eps"):
            fused_linear(x, w, norm_weight=nw, eps=bad)
    for bad in (1 << 20, False, 0.0, 48):
        with pytest.raises(ValueError, match="norm_k"):
            fused_linear(x, w, norm_weight=nw, norm_k=bad)


@pytest.mark.parametrize("rows,hidden,block_k", [(3, 96, 16), (16, 80, 32), (2, 40, 64)])
@pytest.mark.parametrize("mode", MODES)
def test_preloaded_first_tile_matches_reference_fp32(rows, hidden, block_k, mode):
    """The first weight tile loaded before the PDL wait (``preload`` without split-K): a loop over the
    remaining tiles (96 / 16), a masked last tile (80 / 32), and one tile covering all of K (40 / 64)."""
    x, r, w, nw, b = linear_inputs(rows, hidden, 48 * (2 if "swiglu" in mode else 1), torch.float32, seed=rows)
    kw = linear_kwargs(mode, r, nw, b)
    want = fused_linear_ref(x, w, **kw)
    got = fused_linear(x, w, block_k=block_k, block_n=16, preload=True, **kw)
    if "residual" in mode:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,hidden,out", [(1, 64, 48), (3, 96, 80), (16, 333, 40), (20, 576, 32), (2, 16, 16),
                                             (32, 96, 48), (17, 64, 16), (71, 96, 32), (128, 64, 16)])
@pytest.mark.parametrize("mode", MODES)
def test_whole_k_matches_reference_fp32(rows, hidden, out, mode):
    """The whole-K path (no K loop): K a power of two (64: one chunk), 96 = 64 + 32, 333 = 256 + a masked
    128-column chunk, 576 = 512 + 64; more than 16 rows run as blocks of 16 (a third grid dimension; 17: one row
    in the second, 71: 7 in the fifth, 128: eight full blocks); 48 / 80 / 40 outputs end in a partial 16-output
    tile."""
    x, r, w, nw, b = linear_inputs(rows, hidden, out * (2 if "swiglu" in mode else 1), torch.float32, seed=hidden)
    kw = linear_kwargs(mode, r, nw, b)
    want = fused_linear_ref(x, w, **kw)
    got = fused_linear(x, w, whole_k=True, **kw)
    if "residual" in mode:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_whole_k_chunks_and_bad_arguments():
    from hf_accel.kernels.fused_linear_tiles import WHOLE_K_MAX, whole_k_chunks

    assert [whole_k_chunks(k) for k in (576, 1536, 4096, 333, 40, 16)] == \
        [(512, 64), (1024, 512), (4096, 0), (256, 128), (32, 16), (16, 0)]
    for k in range(16, 300):
        a, b = whole_k_chunks(k)
        assert a + b >= k and a >= 16 and (b == 0 or b >= 16)
    x, _, w, _, _ = linear_inputs(2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="split_k"):
        fused_linear(x, w, whole_k=True, split_k=2)
    xw, _, ww, _, _ = linear_inputs(1, WHOLE_K_MAX + 16, 16, torch.float32)
    with pytest.raises(ValueError, match=f"whole_k takes 16 to {WHOLE_K_MAX} input features"):
        fused_linear(xw, ww, whole_k=True)
    from hf_accel.kernels.fused_linear_tiles import WHOLE_K_MAX_ROWS, max_rows

    assert max_rows(True) == WHOLE_K_MAX_ROWS > max_rows(False) == MAX_ROWS
    with pytest.raises(ValueError, match=f"at most {WHOLE_K_MAX_ROWS} rows with whole_k"):
        fused_linear(torch.zeros(WHOLE_K_MAX_ROWS + 1, 64), w, whole_k=True)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows, got {MAX_ROWS + 1}"):
        fused_linear(torch.zeros(MAX_ROWS + 1, 64), w)


@pytest.mark.parametrize("k", [2, 8, 12])
def test_inputs_narrower_than_16_take_the_k_loop_and_whole_k_refuses_them(k):
    """The whole-K path's first column chunk is a full tl.dot K of 16, loaded without a column mask: narrower
    inputs read past each row (wrong outputs) and wrote past the residual output (heap corruption on CPU). It
    refuses them; whole_k_fits says so (the decode step then keeps the K loop, which masks its columns)."""
    from hf_accel.kernels.fused_linear_tiles import whole_k_chunks, whole_k_fits

    x, r, w, nw, _ = linear_inputs(3, k, 48, torch.float32)
    assert not whole_k_fits(k, torch.float32, "cpu")
    with pytest.raises(ValueError, match="whole_k takes 16 to"):
        fused_linear(x, w, whole_k=True)
    with pytest.raises(ValueError, match="at least 16"):
        whole_k_chunks(k)
    got = fused_linear(x, w, norm_weight=nw, residual=r)
    want = fused_linear_ref(x, w, norm_weight=nw, residual=r)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("rows,preload,whole_k", [(1, False, False), (5, False, False), (16, False, False),
                                                  (5, True, False), (3, False, True), (16, False, True),
                                                  (27, False, True), (50, False, True)])
@pytest.mark.parametrize("heads,kv_heads,d,hidden,bias", [(3, 1, 32, 96, False), (2, 1, 64, 80, True)])
def test_fused_linear_rope_is_fused_linear_then_rope_and_cache_fp32(rows, preload, whole_k, heads, kv_heads, d,
                                                                     hidden, bias):
    """Q/K/V projection of several rows with RoPE + cache write as its epilogue: fused_linear followed by
    rope_and_cache_ref; each row's K/V lands in its own slot (-1: none), the rest of the cache untouched.
    With ``preload`` the first of several 16-column weight tiles is loaded before the PDL wait; with
    ``whole_k`` all of K (96 = 64 + 32, 80 = 64 + a masked 16-column chunk) before it."""
    from hf_accel.kernels.fused_linear import fused_linear_rope
    from hf_accel.kernels.rope_cache import rope_and_cache_ref

    g = torch.Generator().manual_seed(rows + d)
    out = (heads + 2 * kv_heads) * d
    x, r, w, nw, b = linear_inputs(rows, hidden, out, torch.float32, seed=rows)
    b = b if bias else None
    ang = torch.rand(rows, d // 2, generator=g) * 50
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    blocks = 8 if rows <= 32 else 16
    kc = torch.randn(blocks, 4, kv_heads, d, generator=g)
    vc = torch.randn(blocks, 4, kv_heads, d, generator=g)
    slots = torch.randperm(blocks * 4, generator=g)[:rows].to(torch.int32)
    slots[rows // 2] = -1
    qkv, want_res = fused_linear_ref(x, w, bias=b, norm_weight=nw, eps=1e-5, residual=r)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want_q = rope_and_cache_ref(q, k, v, cos, sin, kc1, vc1, slots)
    tiles = dict(block_k=16, preload=True) if preload else ({"whole_k": True} if whole_k else {})
    got_q, got_res = fused_linear_rope(x, w, cos, sin, kc2, vc2, slots, heads, bias=b, norm_weight=nw, eps=1e-5,
                                       residual=r, **tiles)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got_q, want_q.reshape(rows, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc2, kc1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc2, vc1, rtol=1e-5, atol=1e-5)
    written = (kc2 != kc).any(-1).any(-1)
    assert written.sum() == rows - 1  # every row's slot but the -1 one
    for s in slots.tolist():
        if s >= 0:
            assert written[s // 4, s % 4]
    assert not torch.allclose(got_q, q), "q was not rotated"


def test_fused_linear_rope_bad_inputs_raise():
    from hf_accel.kernels.fused_linear import fused_linear_rope

    x, _, w, _, _ = linear_inputs(3, 64, 5 * 32, torch.float32)
    cos = sin = torch.ones(3, 32)
    kc = vc = torch.zeros(4, 4, 1, 32)
    slots = torch.zeros(3, dtype=torch.int32)
    fused_linear_rope(x, w, cos, sin, kc, vc, slots, 3)  # valid
    with pytest.raises(ValueError, match="weight rows"):
        fused_linear_rope(x, w, cos, sin, kc, vc, slots, 4)
    with pytest.raises(ValueError, match="head_dim 32 .* multiple of 32"):
        fused_linear_rope(x, w, cos, sin, kc, vc, slots, 3, block_n=32)  # head_dim / 2 = 16
    for bad in (8, 24, 0):
        with pytest.raises(ValueError, match="block_n"):
            fused_linear_rope(x, w, cos, sin, kc, vc, slots, 3, block_n=bad)
    for bad in (-1, 0, 2.0, True):
        with pytest.raises(ValueError, match="num_heads"):
            fused_linear_rope(x, w, cos, sin, kc, vc, slots, bad)
    with pytest.raises(ValueError, match="value_cache"):
        fused_linear_rope(x, w, cos, sin, kc, vc.half(), slots, 3)
    w16 = w[: 4 * 16]  # head_dim 16 caches: 2 + 2 x 1 heads
    with pytest.raises(ValueError, match="head_dim 16"):
        fused_linear_rope(x, w16, cos[:, :16], sin[:, :16], kc[..., :16], vc[..., :16], slots, 2)
    with pytest.raises(ValueError, match="cos/sin"):
        fused_linear_rope(x, w, cos[:2], sin[:2], kc, vc, slots, 3)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_linear_rope(x, w, cos, sin, kc, vc, slots.long(), 3)
    with pytest.raises(ValueError, match="dtypes"):
        fused_linear_rope(x, w, cos.half(), sin.half(), kc, vc, slots, 3)
