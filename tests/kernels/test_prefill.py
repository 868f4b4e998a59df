"""Prefill (FlashAttention-2) kernel vs a float64 reference: Triton interpreter on CPU, native on a GPU.

Error rule (flash-attn's): max |kernel - ref64| <= 2 * max |torch_same_dtype - ref64| + 1e-5, where
``torch_same_dtype`` is the PyTorch reference computed entirely in the test dtype. Shapes are small
(batch 1-2, a few heads) so the whole file runs in well under two minutes in the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_accel.kernels.prefill import (
    PrefillConfig,
    prefill_attention,
    prefill_attention_ref,
    prefill_attention_varlen,
    prefill_attention_varlen_ref,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The interpreter runs bf16 tl.dot on raw bit patterns (see test_attention.py): bf16 only on a GPU.
BF16 = pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="Triton interpreter does not support bfloat16 tl.dot"))
FP16 = pytest.param(torch.float16, id="fp16")
FP32 = pytest.param(torch.float32, id="fp32")


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, seed):
    """Fresh random q/k/v; q is transformers' transposed view of a [batch, q_len, heads, d] buffer."""
    g = _gen(seed)
    q = torch.randn(batch, q_len, heads, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(DEVICE, dtype)
    return q, k, v


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _check(q, k, v, key_mask=None, *, causal, kv_start=None, config=None, sm_scale=None):
    out, lse = prefill_attention(q, k, v, key_mask, causal=causal, kv_start=kv_start, sm_scale=sm_scale,
                                 return_lse=True, config=config)
    b, h, lq, d = q.shape
    assert out.shape == (b, lq, h, d) and out.dtype == q.dtype
    assert lse.shape == (b, h, lq) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    ref, ref_lse = prefill_attention_ref(q.double(), k.double(), v.double(), key_mask, causal=causal,
                                         kv_start=kv_start, sm_scale=sm_scale, return_lse=True)
    same = prefill_attention_ref(q, k, v, key_mask, causal=causal, kv_start=kv_start, sm_scale=sm_scale,
                                 compute_dtype=q.dtype)
    err, torch_err = _err(out, ref), _err(same, ref)
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.3g} > 2 * PyTorch {q.dtype} error {torch_err:.3g} + 1e-5"
    # log-sum-exp: -inf exactly where the row sees no key, else close (fp32 softmax statistics)
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()), dead.cpu())
    assert torch.equal(out.transpose(1, 2)[dead].cpu(), torch.zeros_like(out.transpose(1, 2)[dead]).cpu())
    if (~dead).any():
        assert _err(lse[~dead], ref_lse[~dead]) <= 1e-3
    return out


def test_interpreter_is_active_without_gpu():
    if HAS_CUDA:
        pytest.skip("a GPU is present: kernels run natively")
    assert INTERPRET


# --- lengths x causal x heads (fp32, the dtype the interpreter computes exactly) --------------------

LENS = [1, 17, 97, 128, 333]
# (q_len, kv_len) pairs covering every length on both axes: prefill (q == kv), chunked prefill
# (q < kv, bottom-right), q > kv (the first rows see nothing under causality -> 0).
PAIRS = [(1, 1), (17, 17), (97, 97), (128, 128), (333, 333), (1, 333), (17, 128), (97, 333),
         (128, 17), (333, 97)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("q_len,kv_len", PAIRS)
def test_lengths_fp32(q_len, kv_len, causal):
    q, k, v = _qkv(1, 2, 1, q_len, kv_len, 64, torch.float32, seed=q_len * 1009 + kv_len)
    _check(q, k, v, causal=causal)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gqa(heads, causal):
    h, hkv = heads
    q, k, v = _qkv(1, h, hkv, 40, 97, 64, torch.float32, seed=h * 10 + hkv)
    _check(q, k, v, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_head_dims_and_dtypes(head_dim, dtype):
    q, k, v = _qkv(1, 2, 1, 97, 128, head_dim, dtype, seed=head_dim)
    _check(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("q_len,kv_len", [(17, 17), (97, 333), (128, 128)])
def test_half_precision(q_len, kv_len, dtype):
    q, k, v = _qkv(2, 4, 2, q_len, kv_len, 64, dtype, seed=q_len + kv_len)
    _check(q, k, v, causal=True)
    _check(q, k, v, causal=False)


def test_custom_scale_is_used():
    q, k, v = _qkv(1, 2, 1, 17, 33, 64, torch.float32, seed=3)
    a = _check(q, k, v, causal=True, sm_scale=0.3)
    assert _err(a, prefill_attention(q, k, v, causal=True)) > 1e-3


def test_contiguous_bhld_layout():
    q, k, v = _qkv(1, 4, 2, 33, 65, 64, torch.float32, seed=4)
    _check(q.contiguous(), k.contiguous(), v, causal=True)


# --- padding, masks, start offsets --------------------------------------------------------------


def _left_pad(batch, kv_len, pads):
    mask = torch.ones(batch, kv_len, dtype=torch.bool, device=DEVICE)
    for b, p in enumerate(pads):
        mask[b, :p] = False
    return mask


@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("q_len,kv_len", [(97, 97), (17, 128), (1, 333)])
def test_left_padding_key_mask(q_len, kv_len, dtype):
    q, k, v = _qkv(2, 4, 2, q_len, kv_len, 64, dtype, seed=q_len * 7 + kv_len)
    mask = _left_pad(2, kv_len, [0, kv_len // 3 + 5])
    out = _check(q, k, v, mask, causal=True)
    # all keys visible through the same masked launch (on a GPU the tuner picks a tile per masked / unmasked
    # key, and another tile sums in another order): row 0, unpadded, must come out bitwise the same
    unmasked = prefill_attention(q, k, v, torch.ones_like(mask), causal=True)
    assert _err(out[1], unmasked[1]) > 1e-2  # the mask matters
    torch.testing.assert_close(out[0], unmasked[0], atol=0, rtol=0)


@pytest.mark.parametrize("q_len,kv_len", [(97, 97), (17, 128)])
def test_left_padding_start_offsets_equal_mask(q_len, kv_len):
    """Start offsets (only the boundary block masked) give the same answer as the key mask."""
    q, k, v = _qkv(2, 4, 1, q_len, kv_len, 64, torch.float32, seed=q_len + 5)
    pads = [7, kv_len // 2 + 3]
    start = torch.tensor(pads, dtype=torch.int32, device=DEVICE)
    by_start = _check(q, k, v, causal=True, kv_start=start)
    by_mask = prefill_attention(q, k, v, _left_pad(2, kv_len, pads), causal=True)
    torch.testing.assert_close(by_start, by_mask, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_arbitrary_key_mask(causal):
    q, k, v = _qkv(2, 4, 2, 33, 97, 64, torch.float32, seed=31)
    mask = (torch.rand(2, 97, generator=_gen(32)) > 0.5).to(DEVICE)
    _check(q, k, v, mask.to(torch.int32), causal=causal)


@pytest.mark.parametrize("dtype", [FP32, FP16])
def test_fully_masked_rows_are_zero(dtype):
    # row 1: every key masked; row 0: left padding, so its first causal queries see nothing.
    q, k, v = _qkv(2, 4, 2, 40, 40, 64, dtype, seed=51)
    mask = torch.ones(2, 40, dtype=torch.bool, device=DEVICE)
    mask[0, :20] = False
    mask[1] = False
    out = _check(q, k, v, mask, causal=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :20], torch.zeros_like(out[0, :20]))
    assert (out[0, 20:] != 0).any()


# --- packed variable-length batches ----------------------------------------------------------------


def _varlen(q_lens, kv_lens, heads, kv_heads, head_dim, dtype, seed):
    g = _gen(seed)
    tq, tk = sum(q_lens), sum(kv_lens)
    q = torch.randn(tq, heads, head_dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(tk, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(tk, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lens", [
    ([17, 97, 1, 128], [17, 97, 1, 128]),      # plain prefill of a pack
    ([1, 17, 33], [97, 128, 333]),             # chunked prefill: q < kv per sequence
    ([0, 40, 5], [0, 40, 70]),                 # an empty sequence in the pack
], ids=["prefill", "chunked", "empty-seq"])
def test_varlen(lens, causal, dtype):
    q_lens, kv_lens = lens
    q, k, v, cu_q, cu_k = _varlen(q_lens, kv_lens, 4, 2, 64, dtype, seed=sum(q_lens) + sum(kv_lens))
    out, lse = prefill_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens), causal=causal,
                                        return_lse=True)
    ref, ref_lse = prefill_attention_varlen_ref(q.double(), k.double(), v.double(), cu_q.cpu(), cu_k.cpu(),
                                                causal=causal, return_lse=True)
    same = prefill_attention_varlen_ref(q, k, v, cu_q.cpu(), cu_k.cpu(), causal=causal, compute_dtype=q.dtype)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert torch.isfinite(out).all()
    assert _err(out, ref) <= 2 * _err(same, ref) + 1e-5
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), finite.cpu())
    # each sequence equals the dense kernel on that sequence alone
    b = 1
    qs, qe, ks, ke = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
    dense = prefill_attention(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                              v[ks:ke].transpose(0, 1)[None], causal=causal)
    torch.testing.assert_close(out[qs:qe], dense[0], atol=1e-6 if dtype == torch.float32 else 2e-3, rtol=0)


@pytest.mark.parametrize("bad", [4.0, torch.tensor(6), -1, True])
def test_varlen_max_seqlen_must_be_a_host_int(bad):
    q, k, v = torch.randn(7, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be a host int >= 0"):
        prefill_attention_varlen(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_q, cu_k, bad, 5)


@pytest.mark.parametrize(("cu_q", "cu_k", "max_q", "match"), [
    ([0, 3, 9], [0, 4, 9], 6,
     r"cu_seqlens_q must rise from 0 to the 7 rows of the packed query tensor; got \[0, 3, 9\]"),
    ([0, 3, 7], [0, 4, 10], 6, r"cu_seqlens_k must rise from 0 to the 9 rows of the packed key/value tensor"),
    ([1, 3, 7], [0, 4, 9], 6, "cu_seqlens_q must rise from 0"),
    ([0, 3, 7], [0, 6, 5], 6, "cu_seqlens_k must rise from 0"),
    ([0, 1, 7], [0, 4, 9], 5, r"max_seqlen_q=5 is shorter than a sequence of cu_seqlens_q \(6 tokens\)"),
])
def test_varlen_offsets_checked(cu_q, cu_k, max_q, match):
    """Offsets that do not describe the packed tensors would make the kernel read and write past them: a
    ValueError instead (they once wrote past the output and aborted the process)."""
    q, k, v = torch.randn(7, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    with pytest.raises(ValueError, match=match):
        prefill_attention_varlen(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), torch.tensor(cu_q, dtype=torch.int32),
                                 torch.tensor(cu_k, dtype=torch.int32), max_q, 5)


# --- launch variants (persistent grid, tile shapes, row-tile order) -------------------------------


@pytest.mark.parametrize("config", [
    PrefillConfig(32, 16, 4, 1, use_tma=False, persistent=True),
    PrefillConfig(16, 32, 4, 1, use_tma=False, reverse_m=False),
    PrefillConfig(64, 64, 4, 1, use_tma=False),
], ids=lambda c: c.short())
def test_launch_variants(config):
    q, k, v = _qkv(2, 4, 2, 97, 128, 64, torch.float32, seed=config.block_m + config.block_n)
    _check(q, k, v, causal=True, config=config)
    mask = _left_pad(2, 128, [0, 50])
    _check(q, k, v, mask, causal=True, config=config)


def test_bad_inputs_raise():
    q, k, v = _qkv(1, 4, 3, 8, 8, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention(q, k, v)
    q, k, v = _qkv(1, 4, 2, 8, 8, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="key_mask"):
        prefill_attention(q, k, v, torch.ones(1, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="dtypes differ"):
        prefill_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(*_qkv(1, 2, 1, 4, 4, 320, torch.float32, seed=0))
