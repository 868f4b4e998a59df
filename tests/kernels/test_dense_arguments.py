"""Launchers refuse arguments their kernels would index wrongly: 1-D arguments and output buffers that are strided
views (the kernels index them densely), ``cos``/``sin`` tables of different row strides, one q/k norm weight
without the other, an ``argmax_rows`` output of the wrong size, a non-positive ``sm_scale`` for the prefill kernels.
Each used to give silently wrong values (or write out of bounds); the references took the same views correctly."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _strided(t):
    """The values of ``t`` as a view with stride 2 along dim 0."""
    big = torch.zeros((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    big[::2] = t
    return big[::2]


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32, device=DEVICE)


def test_slot_mapping_and_reshape_and_cache():
    from hf_accel.kernels.reshape_and_cache import reshape_and_cache, slot_mapping

    key = torch.randn(3, 2, 4, device=DEVICE)
    kc, vc = torch.zeros(4, 2, 2, 4, device=DEVICE), torch.zeros(4, 2, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="reshape_and_cache: slot_mapping must be contiguous"):
        reshape_and_cache(key, key, kc, vc, _strided(_i32(5, 1, 3)))
    table = torch.arange(12, dtype=torch.int32, device=DEVICE).view(3, 4)
    with pytest.raises(ValueError, match="slot_mapping: cache_lens must be contiguous"):
        slot_mapping(_strided(_i32(3, 7, 0)), table, 2, 4)


def test_paged_attention_seq_lens():
    from hf_accel.kernels.paged_attention import paged_attention

    q = torch.randn(3, 2, 1, 16, device=DEVICE)
    kc, vc = torch.randn(10, 4, 1, 16, device=DEVICE), torch.randn(10, 4, 1, 16, device=DEVICE)
    table = torch.randperm(10)[:9].view(3, 3).to(DEVICE, torch.int32)
    with pytest.raises(ValueError, match="paged_attention: seq_lens must be contiguous"):
        paged_attention(q, kc, vc, table, _strided(_i32(5, 12, 2)), 12)


def test_rms_norm_weight():
    from hf_accel.kernels.rms_norm import rms_norm

    with pytest.raises(ValueError, match="rms_norm: weight must be contiguous"):
        rms_norm(torch.randn(3, 8, device=DEVICE), _strided(torch.rand(8, device=DEVICE)), 1e-6)


def test_rope_and_cache_tables_norms_and_slots():
    from hf_accel.kernels.rope_cache import rope_and_cache

    b, h, hkv, d = 3, 4, 2, 16
    q, k = torch.randn(b, h * d, device=DEVICE), torch.randn(b, hkv * d, device=DEVICE)
    cos, sin = torch.rand(b, d, device=DEVICE), torch.rand(b, d, device=DEVICE)
    kc, vc = torch.zeros(4, 4, hkv, d, device=DEVICE), torch.zeros(4, 4, hkv, d, device=DEVICE)
    slots, w = _i32(0, 5, 9), torch.rand(d, device=DEVICE)
    with pytest.raises(ValueError, match="cos and sin must have one row stride; got 32 and 16"):
        rope_and_cache(q, k, k, torch.rand(b, 2 * d, device=DEVICE)[:, :d], sin, kc, vc, slots)
    with pytest.raises(ValueError, match="give both q_norm_weight and k_norm_weight, or neither"):
        rope_and_cache(q, k, k, cos, sin, kc, vc, slots, w)
    with pytest.raises(ValueError, match="rope_and_cache: k_norm_weight must be contiguous"):
        rope_and_cache(q, k, k, cos, sin, kc, vc, slots, w, _strided(w))
    with pytest.raises(ValueError, match="rope_and_cache: slot_mapping must be contiguous"):
        rope_and_cache(q, k, k, cos, sin, kc, vc, _strided(slots))


def test_commit_tokens_and_ngram_lookup_state():
    from hf_accel.kernels.commit_tokens import commit_tokens
    from hf_accel.kernels.ngram_lookup import ngram_lookup

    b, k = 3, 2
    out = torch.tensor([[5, 6, 7], [1, 2, 3], [4, 4, 4]], device=DEVICE)
    state = dict(tokens=torch.zeros(b, 12, dtype=torch.long, device=DEVICE),
                 lengths=torch.tensor([2, 4, 6], device=DEVICE), remaining=torch.tensor([9, 9, 9], device=DEVICE),
                 active=torch.ones(b, dtype=torch.bool, device=DEVICE))
    info, totals = torch.zeros(6 + k, dtype=torch.long, device=DEVICE), torch.zeros(3, dtype=torch.long, device=DEVICE)
    for name in ("lengths", "remaining", "active"):
        args = dict(state, **{name: _strided(state[name])})
        with pytest.raises(ValueError, match=f"commit_tokens: {name} must be contiguous"):
            commit_tokens(out, None, out[:, :k].clone(), torch.ones(b, k, dtype=torch.bool, device=DEVICE),
                          args["tokens"], args["lengths"], args["remaining"], args["active"],
                          torch.tensor([-1], device=DEVICE), info, totals, True)
    tokens = torch.randint(3, 20, (2, 16), device=DEVICE)
    lengths, starts = torch.tensor([10, 12], device=DEVICE), torch.tensor([0, 0], device=DEVICE)
    with pytest.raises(ValueError, match="ngram_lookup: lengths must be contiguous"):
        ngram_lookup(tokens, _strided(lengths), starts, 4)
    with pytest.raises(ValueError, match="ngram_lookup: starts must be contiguous"):
        ngram_lookup(tokens, lengths, _strided(starts), 4)


def test_argmax_outputs():
    from hf_accel.kernels.argmax import argmax_rows

    x = torch.randn(3, 50, device=DEVICE)
    with pytest.raises(ValueError, match="argmax_rows: out must be contiguous"):
        argmax_rows(x, out=torch.zeros(6, dtype=torch.int64, device=DEVICE)[::2])
    for bad in (torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match=r"argmax_rows: out must be a \[3\] int64 tensor"):
            argmax_rows(x, out=bad)
    assert torch.equal(argmax_rows(x, out=torch.empty(3, dtype=torch.int64, device=DEVICE)), x.argmax(dim=-1))


@pytest.mark.parametrize("scale", [-1.0, 0.0, float("nan")])
def test_prefill_sm_scale_must_be_positive(scale):
    from hf_accel.kernels.prefill import prefill_attention, prefill_attention_varlen

    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sm_scale must be > 0"):
        prefill_attention(q, q, q, sm_scale=scale)
    flat = torch.randn(8, 2, 16, device=DEVICE)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="sm_scale must be > 0"):
        prefill_attention_varlen(flat, flat, flat, cu, cu, 8, 8, sm_scale=scale)
