"""gemv (one token row; RMSNorm/residual prologue, SwiGLU/bias/float32 epilogues) against its PyTorch
reference (:func:`~hf_accel.kernels.fused_linear.fused_linear_ref`, the same op for any row count)."""

import pytest
import torch
from linear_cases import MODES, linear_inputs, linear_kwargs

from hf_accel.kernels.fused_linear import fused_linear_ref
from hf_accel.kernels.gemv import gemv

# CPU tensors through Triton's interpreter; tests/kernels/test_fused_gpu.py runs the kernels on a GPU.
pytestmark = pytest.mark.interpreter


def _inputs(hidden, out, dtype, seed=0):
    return linear_inputs(1, hidden, out, dtype, seed)


# Widths not multiple of the K tile (333, 97) and output counts not multiple of the row block (50, 7).
@pytest.mark.parametrize("hidden,out,tiles", [(64, 48, {}), (333, 50, {}), (97, 14, dict(block_n=4, block_k=32)),
                                              (128, 7, dict(block_n=2, block_k=16, num_warps=2))])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("single_pass", [False, True])
def test_matches_reference_fp32(hidden, out, tiles, mode, single_pass):
    if "swiglu" in mode and out % 2:
        out += 1
    x, r, w, nw, b = _inputs(hidden, out, torch.float32)
    kw = linear_kwargs(mode, r, nw, b)
    got = gemv(x, w, **kw, **tiles, single_pass=single_pass)
    want = fused_linear_ref(x, w, **kw)
    if "residual" in mode:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# K 333 with 32-column tiles: 2 and 4 preloaded tiles leave a loop with a masked last tile; 8 covers all of K
# (and is capped at what K needs); K 64 caps every count at 2 tiles.
@pytest.mark.parametrize("hidden,out", [(333, 50), (64, 14)])
@pytest.mark.parametrize("preload", [2, 4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_preloaded_tiles_match_reference_fp32(hidden, out, preload, mode):
    if "swiglu" in mode and out % 2:
        out += 1
    x, r, w, nw, b = _inputs(hidden, out, torch.float32, seed=5)
    kw = linear_kwargs(mode, r, nw, b)
    got = gemv(x, w, **kw, block_n=4, block_k=32, preload_tiles=preload)
    want = fused_linear_ref(x, w, **kw)
    if "residual" in mode:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# The norm prologue over the whole row (default), in 32-column steps (norm_k=32: 11 steps of K 333), and in
# the K tiles (0).
@pytest.mark.parametrize("norm_k", [None, 32, 0])
def test_norm_prologue_steps_match_reference_fp32(norm_k):
    x, r, w, nw, _ = _inputs(333, 20, torch.float32, seed=6)
    got, res = gemv(x, w, norm_weight=nw, eps=1e-5, residual=r, block_k=64, norm_k=norm_k)
    want, want_res = fused_linear_ref(x, w, norm_weight=nw, eps=1e-5, residual=r)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# Widths of one tile (64), above 1024 (1500: one 2048-wide tile only with single_pass) and above 2048 (2100:
# K tiles either way); the single read of the row is used where the norm's row fits the preloaded columns.
@pytest.mark.parametrize("hidden", [64, 1500, 2100])
def test_single_pass_norm_matches_reference_and_the_default_fp32(hidden):
    from hf_accel.kernels.gemv import _launch_tiles, _single_pass

    x, r, w, nw, _ = _inputs(hidden, 12, torch.float32, seed=7)
    got, res = gemv(x, w, norm_weight=nw, eps=1e-5, residual=r, swiglu=True, single_pass=True)
    base, base_res = gemv(x, w, norm_weight=nw, eps=1e-5, residual=r, swiglu=True)
    want, want_res = fused_linear_ref(x, w, norm_weight=nw, eps=1e-5, residual=r, swiglu=True)
    assert torch.equal(res, want_res) and torch.equal(base_res, want_res)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-5)
    _, block_k, _ = _launch_tiles(w.shape[0], hidden, 1e-5, None, None, None, whole_row=True)
    assert _single_pass(True, nw, hidden, block_k, 1, None) == (hidden <= 2048)
    assert not _single_pass(False, nw, hidden, block_k, 1, None) and not _single_pass(True, nw, hidden, block_k, 1, 0)


def test_half_rounding_close_to_reference():
    x, r, w, nw, _ = _inputs(128, 64, torch.float16, seed=1)
    got, res = gemv(x, w, norm_weight=nw, eps=1e-6, residual=r, swiglu=True, block_k=32)
    want, want_res = fused_linear_ref(x, w, norm_weight=nw, eps=1e-6, residual=r, swiglu=True)
    assert torch.equal(res, want_res)
    # Same roundings, different fp32 summation order: at most an ulp or so apart.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -9, atol=2e-3)


def test_wrong_norm_or_residual_is_detected():
    x, r, w, nw, _ = _inputs(64, 32, torch.float32, seed=2)
    got = gemv(x, w, norm_weight=nw, residual=r)[0]
    assert not torch.allclose(got, fused_linear_ref(x, w, norm_weight=nw))
    assert not torch.allclose(got, fused_linear_ref(x + r, w))


def test_pdl_is_ignored_off_gpu():
    x, r, w, nw, _ = _inputs(64, 32, torch.float32, seed=3)
    torch.testing.assert_close(gemv(x, w, pdl=True), fused_linear_ref(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, nw, r: gemv(torch.cat([x, x]), w), "one row"),
    (lambda x, w, nw, r: gemv(x, w[:, :-1]), "weight"),
    (lambda x, w, nw, r: gemv(x, w.double()), "dtypes differ"),
    (lambda x, w, nw, r: gemv(x, w, residual=r), "residual needs norm_weight"),
    (lambda x, w, nw, r: gemv(x, w, norm_weight=nw[:-1]), "norm_weight"),
    (lambda x, w, nw, r: gemv(x, w, swiglu=True), "even"),
    (lambda x, w, nw, r: gemv(x, w, block_n=3), "power of two"),
    (lambda x, w, nw, r: gemv(x, w, block_n=0), "power of two"),
    (lambda x, w, nw, r: gemv(x, w, block_n=4.0), "power of two"),
    (lambda x, w, nw, r: gemv(x, w, num_warps=3), "power of two"),
    (lambda x, w, nw, r: gemv(x, w, block_n=256, block_k=8192), "at most 65536"),
    (lambda x, w, nw, r: gemv(x, w, preload_tiles=3), "preload_tiles"),
    (lambda x, w, nw, r: gemv(x, w, norm_weight=nw, norm_k=24), "norm_k"),
    (lambda x, w, nw, r: gemv(x, w, norm_weight=nw, norm_k=16384), "norm_k"),
    (lambda x, w, nw, r: gemv(x, w, preload_tiles=0), "preload_tiles"),
    (lambda x, w, nw, r: gemv(x, w, norm_weight=nw, eps=torch.tensor(1e-6)), "eps"),
    (lambda x, w, nw, r: gemv(x, w, bias=torch.ones(33, dtype=torch.float64)), "dtypes differ"),
    (lambda x, w, nw, r: gemv(x[:, :0], w[:, :0]), "0 input features"),
    (lambda x, w, nw, r: gemv(x.double(), w.double()), "unsupported dtype"),
    (lambda x, w, nw, r: gemv(x, w.t().contiguous().t()), "contiguous"),
    (lambda x, w, nw, r: gemv(x, w, norm_weight=torch.stack([nw, nw], 1)[:, 0]), "contiguous"),
    (lambda x, w, nw, r: gemv(x, w, bias=torch.ones(33, 2)[:, 0]), "contiguous"),
    (lambda x, w, nw, r: gemv(x, w, norm_weight=nw, single_pass=1), "single_pass"),
])
def test_bad_input_raises(bad, match):
    x, r, w, nw, _ = _inputs(64, 33, torch.float32, seed=4)
    with pytest.raises(ValueError, match=match):
        bad(x, w, nw, r)


def test_no_output_features_give_an_empty_row():
    x, _, w, _, _ = _inputs(64, 3, torch.float32)
    assert gemv(x, w[:0]).shape == (1, 0)


def test_tiles_the_gpu_refuses_are_refused_under_the_interpreter_too():
    """The default rows per program differ (wider under the interpreter); the tile checks use the GPU's."""
    x, _, w, _, _ = _inputs(20000, 3, torch.float32)
    for tiles in (dict(block_k=4096, preload_tiles=8), dict(block_k=8192, preload_tiles=8)):
        with pytest.raises(ValueError, match="at most 65536"):
            gemv(x, w, **tiles)


def test_too_many_preloaded_values_raise():
    x, w = torch.zeros(1, 4096), torch.zeros(8, 4096)
    with pytest.raises(ValueError, match="preload_tiles"):
        gemv(x, w, block_n=64, block_k=512, preload_tiles=4)


def _rope_case(dtype, heads, kv_heads, d, hidden, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = (heads + 2 * kv_heads) * d
    x, r, w, nw, b = linear_inputs(1, hidden, rows, dtype, seed)
    ang = torch.rand(1, d // 2, generator=g) * 50
    cos = torch.cat([ang.cos()] * 2, -1).to(dtype)
    sin = torch.cat([ang.sin()] * 2, -1).to(dtype)
    kc = torch.randn(6, 4, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(6, 4, kv_heads, d, generator=g).to(dtype)
    return x, r, w, nw, (b if bias else None), cos, sin, kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,hidden,bias", [(3, 1, 16, 96, False), (4, 2, 8, 333, True)])
@pytest.mark.parametrize("slot,preload,single_pass", [(13, 1, False), (-1, 1, False), (13, 2, False), (13, 1, True)])
@pytest.mark.parametrize("rows", ["interpreter", 2])
def test_gemv_rope_is_gemv_then_rope_and_cache(dtype, heads, kv_heads, d, hidden, bias, slot, preload, single_pass,
                                               rows, monkeypatch):
    """Q/K/V GEMV with RoPE + cache write as its epilogue: bitwise gemv followed by rope_and_cache (same
    roundings), the cache untouched elsewhere (and everywhere for slot -1), the residual sum returned. Rows
    per program: the interpreter's (a whole half head) or the GPU's 2 (several programs per head)."""
    from hf_accel.kernels import gemv as gemv_module
    from hf_accel.kernels.gemv import gemv_rope
    from hf_accel.kernels.rope_cache import rope_and_cache

    if rows == 2:
        monkeypatch.setattr(gemv_module, "interpreter_rows", lambda *args, **kwargs: 2)

    x, r, w, nw, b, cos, sin, kc, vc = _rope_case(dtype, heads, kv_heads, d, hidden, bias, seed=d + slot)
    slots = torch.tensor([slot], dtype=torch.int32)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    tiles = {} if preload == 1 else dict(block_k=32, preload_tiles=preload)  # preloaded tiles + a loop
    tiles["single_pass"] = single_pass
    qkv, res = gemv(x, w, bias=b, norm_weight=nw, eps=1e-5, residual=r, **tiles)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    want_q = rope_and_cache(q, k, v, cos, sin, kc1, vc1, slots)
    got_q, got_res = gemv_rope(x, w, cos, sin, kc2, vc2, slots, heads, bias=b, norm_weight=nw, eps=1e-5, residual=r,
                               **tiles)
    assert torch.equal(got_res, res)
    assert torch.equal(got_q, want_q.reshape(1, -1))
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
    changed = (kc1 != kc).any(-1).any(-1)
    if slot < 0:
        assert not changed.any()
    else:
        assert changed.sum() == 1 and changed[slot // 4, slot % 4]
        assert not torch.equal(got_q, q), "q was not rotated"


def test_interpreter_rows():
    """Rows per program under the interpreter: as few programs as the tile limit allows; with ``divide``, a
    power of two dividing the rows (a RoPE half head), never below the GPU's 2."""
    from hf_accel.kernels.gemv import interpreter_rows

    assert interpreter_rows(48, 64) == 64 and interpreter_rows(1000, 16) == 256 and interpreter_rows(7, 16) == 8
    assert interpreter_rows(4096, 2048) == 4 and interpreter_rows(50, 8192) == 1 and interpreter_rows(0, 64) == 1
    assert interpreter_rows(32, 64, divide=True) == 32 and interpreter_rows(40, 64, divide=True) == 8
    assert interpreter_rows(12, 64, divide=True) == 4 and interpreter_rows(64, 4096, divide=True) == 2


def test_gemv_rope_bad_inputs_raise():
    from hf_accel.kernels.gemv import gemv_rope

    x, r, w, nw, b, cos, sin, kc, vc = _rope_case(torch.float32, 3, 1, 16, 64, False)
    slots = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="weight rows"):
        gemv_rope(x, w, cos, sin, kc, vc, slots, 4)
    with pytest.raises(ValueError, match="cos/sin"):
        gemv_rope(x, w, cos[:, :8], sin[:, :8], kc, vc, slots, 3)
    with pytest.raises(ValueError, match="slot_mapping"):
        gemv_rope(x, w, cos, sin, kc, vc, slots.long(), 3)
    with pytest.raises(ValueError, match="dtypes differ"):
        gemv_rope(x, w, cos.half(), sin.half(), kc, vc, slots, 3)
    with pytest.raises(ValueError, match="block_k must be"):
        gemv_rope(x, w, cos, sin, kc, vc, slots, 3, block_k=48)
    with pytest.raises(ValueError, match="eps must be"):
        gemv_rope(x, w, cos, sin, kc, vc, slots, 3, eps=torch.tensor(1e-6))
