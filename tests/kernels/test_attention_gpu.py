"""The attention kernel compiled for a real GPU (not the interpreter) vs the float64 reference.

Skipped without CUDA. Error rule (flash-attn's): |ours - ref64| <= 2 * |torch_same_dtype - ref64| + 1e-5,
where torch_same_dtype is the PyTorch reference computed in the test dtype.
"""

import pytest
import torch

from hf_accel.kernels.attention import attention, attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = [
    # batch, num_heads, num_kv_heads, q_len, kv_len, head_dim, causal
    (2, 4, 4, 1, 97, 64, True),
    (2, 8, 2, 7, 97, 128, True),
    (1, 8, 1, 33, 33, 64, True),
    (3, 9, 3, 128, 128, 64, True),
    (2, 32, 8, 333, 1000, 128, True),
    (1, 8, 2, 97, 97, 80, False),
    (1, 4, 1, 17, 300, 256, True),
    (4, 9, 3, 1, 2048, 64, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_attention_cuda_matches_reference(case, dtype):
    b, h, hkv, lq, lk, d, causal = case
    g = torch.Generator(device="cuda").manual_seed(hash(case) % 2**31)
    q = torch.randn(b, lq, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)  # HF's strided view
    k = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype, generator=g)
    key_mask = torch.ones(b, lk, dtype=torch.bool, device="cuda")
    key_mask[0, : lk // 3] = False  # left padding on row 0
    if b > 1:
        key_mask[-1, :] = False  # a fully masked batch row
    out = attention(q, k, v, key_mask, causal=causal)
    ref = attention_ref(q.double(), k.double(), v.double(), key_mask, causal=causal)
    same_dtype = attention_ref(q, k, v, key_mask, causal=causal, compute_dtype=dtype)
    err = (out.double() - ref).abs().max().item()
    torch_err = (same_dtype.double() - ref).abs().max().item()
    assert torch.isfinite(out).all()
    if b > 1:
        assert (out[-1] == 0).all(), "fully masked rows must be exactly 0"
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.3g} vs PyTorch's own {torch_err:.3g}"


PAGED_CASES = [
    # batch, num_heads, num_kv_heads, q_len, seq_lens, head_dim, block_size, num_splits
    (3, 32, 8, 1, (1, 700, 4097), 128, 16, None),
    (2, 9, 3, 1, (333, 64), 64, 32, 4),
    (2, 8, 1, 5, (17, 2000), 64, 16, None),
    (1, 8, 8, 3, (1000,), 256, 16, 3),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_attention_cuda_matches_reference(case, dtype):
    from hf_accel.kernels.paged_attention import paged_attention
    from hf_accel.kernels.paged_attention_torch import paged_attention_ref

    b, h, hkv, lq, lens, d, bs, splits = case
    g = torch.Generator(device="cuda").manual_seed(hash(case) % 2**31)
    max_blocks = max(-(-n // bs) for n in lens)
    num_blocks = b * max_blocks + 7
    kc = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=dtype, generator=g)
    table = torch.randperm(num_blocks, device="cuda", generator=g)[: b * max_blocks].view(b, max_blocks).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, lq, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    key_mask = torch.ones(b, max(lens), dtype=torch.bool, device="cuda")
    key_mask[-1, : lens[-1] // 4] = False
    out = paged_attention(q, kc, vc, table, seq_lens, max(lens), key_mask, num_splits=splits)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), table, seq_lens, max(lens), key_mask)
    same = paged_attention_ref(q, kc, vc, table, seq_lens, max(lens), key_mask, compute_dtype=dtype)
    err = (out.double() - ref).abs().max().item()
    torch_err = (same.double() - ref).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.3g} vs PyTorch's own {torch_err:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,hkv,d,q_len", [(9, 3, 64, 48), (9, 3, 64, 300), (32, 8, 128, 40), (32, 8, 128, 333),
                                           (4, 1, 256, 200)])
def test_prefill_candidates_of_one_key_give_bitwise_the_same_output(h, hkv, d, q_len, dtype):
    """The tuner may pick any candidate of a key (by timing, which varies between processes): all must give
    bitwise the same output, so greedy tokens do not depend on which one won."""
    from hf_accel.kernels.prefill import prefill_attention
    from hf_accel.kernels.prefill_tuning import bucket, candidate_configs

    g = torch.Generator(device="cuda").manual_seed(q_len + d)
    q = torch.randn(2, h, q_len, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(2, hkv, q_len, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(2, hkv, q_len, d, device="cuda", generator=g).to(dtype)
    mask = torch.ones(2, q_len, dtype=torch.int32, device="cuda")
    mask[1, : q_len // 3] = 0  # left padding on one row
    outs = [prefill_attention(q, k, v, mask, config=cfg) for cfg in candidate_configs(d, bucket(q_len), q.dtype)]
    assert len(outs) >= 2 and all(torch.equal(o, outs[0]) for o in outs[1:])
