"""gemv_merge_splits (the attention output projection with the split-KV merge as its prologue) against the
merge kernel of paged_attention followed by gemv, and against the PyTorch references, on paged attention
partials of scattered block tables (Triton's interpreter on CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import Case

from hf_accel.kernels.fused_linear import fused_linear_ref
from hf_accel.kernels.gemv import gemv, gemv_merge_splits
from hf_accel.kernels.paged_attention import SplitPartials, paged_attention
from hf_accel.kernels.split_merge import merge_chunk, merge_splits_ref

pytestmark = pytest.mark.interpreter


def _partials(seq_len, num_heads, num_kv_heads, head_dim, splits, seed=0, max_seq_len=None):
    case = Case([seq_len], num_heads, num_kv_heads, 1, 16, head_dim=head_dim, seed=seed)
    args = list(case.args())
    if max_seq_len is not None:
        args[-1] = max_seq_len
    merged = paged_attention(*args, num_splits=splits, split_multiple=1)
    parts = paged_attention(*args, num_splits=splits, split_multiple=1, merge=False)
    return merged, parts


# (num_heads, num_kv_heads, head_dim, splits): GQA 4/2 and MHA, odd split counts, splits > 8 (two chunks at
# 1024 columns: 16 heads x 64), one split past the keys (empty: lse -inf)
@pytest.mark.parametrize("heads,kv_heads,d,splits,seq_len", [
    (4, 2, 16, 3, 97), (4, 4, 32, 5, 150), (16, 4, 64, 16, 300), (2, 1, 16, 7, 40),
])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_merge_kernel_then_gemv_fp32(heads, kv_heads, d, splits, seq_len, bias):
    merged, parts = _partials(seq_len, heads, kv_heads, d, splits, seed=splits)
    assert isinstance(parts, SplitPartials) and parts.out.shape[0] == splits
    g = torch.Generator().manual_seed(d)
    out_features = 37
    w = torch.randn(out_features, heads * d, generator=g) / (heads * d) ** 0.5
    b = torch.randn(out_features, generator=g) if bias else None
    got = gemv_merge_splits(parts.out, parts.lse, w, bias=b)
    want = gemv(merged.view(1, -1), w, bias=b)
    assert got.shape == (1, out_features) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref = fused_linear_ref(merge_splits_ref(parts.out, parts.lse, torch.float32).view(1, -1), w, bias=b)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_chunked_splits_cover_every_split():
    """16 splits over 1024-wide tiles are merged 8 at a time: both chunks must count (a merge of the first
    chunk alone differs)."""
    assert merge_chunk(16, 1024, 64) == (16, 8)
    merged, parts = _partials(300, 16, 4, 64, 16, seed=3)
    w = torch.randn(8, 16 * 64, generator=torch.Generator().manual_seed(1)) / 32
    got = gemv_merge_splits(parts.out, parts.lse, w)
    torch.testing.assert_close(got, gemv(merged.view(1, -1), w), rtol=1e-5, atol=1e-5)
    half = fused_linear_ref(merge_splits_ref(parts.out[:8], parts.lse[:8], torch.float32).view(1, -1), w)
    assert (got - half).abs().max() > 1e-3


def test_splits_past_the_keys_are_empty_and_ignored():
    """A grid sized for more keys than the row holds leaves trailing splits empty (lse -inf): no NaN, same
    result as the merge kernel."""
    merged, parts = _partials(40, 4, 2, 16, 6, seed=5, max_seq_len=96)
    assert bool(torch.isinf(parts.lse[-1]).all())
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    got = gemv_merge_splits(parts.out, parts.lse, w)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, gemv(merged.view(1, -1), w), rtol=1e-5, atol=1e-5)


def test_one_split_returns_the_output_itself():
    case = Case([20], 4, 2, 1, 16)
    out = paged_attention(*case.args(), num_splits=1, merge=False)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 1, 4, 32)


@pytest.mark.parametrize("bad,match", [
    (lambda p, l, w: (p.to(torch.float16), l, w), "float32"),
    (lambda p, l, w: (p, l[:, :, :, :1], w), "num_splits"),
    (lambda p, l, w: (p, l, w[:, :-16]), "weight must be"),
    (lambda p, l, w: (torch.cat([p, p], -1)[..., :16], l, w), "contiguous"),
    (lambda p, l, w: (p[..., :12].contiguous(), l, w[:, :48].contiguous()), "power of two"),
])
def test_bad_input_raises(bad, match):
    _, parts = _partials(50, 4, 2, 16, 3)
    w = torch.randn(6, 64)
    p, l, w2 = bad(parts.out, parts.lse, w)
    with pytest.raises(ValueError, match=match):
        gemv_merge_splits(p, l, w2)
