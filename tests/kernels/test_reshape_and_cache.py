"""``reshape_and_cache`` (Triton; the interpreter without a GPU) vs its PyTorch reference.

Slots are scattered over the pool (``randperm``), some tokens have slot -1 (skipped), and every slot
not named by the mapping must keep its previous content (a NaN sentinel here).
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_accel.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Triton's interpreter converts float32 -> bfloat16 by truncation (round toward zero) where compiled
# Triton and PyTorch round to nearest even; the interpreter does not support bfloat16 arithmetic
# (Triton debugging guide). PagedCache never converts (its pools have the model's dtype).
FP32_TO_BF16 = pytest.param(
    torch.float32, torch.bfloat16, id="fp32->bf16",
    marks=pytest.mark.xfail(INTERPRET, strict=True,
                            reason="Triton interpreter truncates float32 -> bfloat16 instead of rounding"),
)


def _case(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, src_dtype, cache_dtype, seed,
          *, skip_every=3, slot_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(DEVICE, src_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(DEVICE, src_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if skip_every:
        slots[1::skip_every] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    value_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    return key, value, key_cache, value_cache, slots.to(DEVICE, slot_dtype)


def _written(cache, slots):
    keep = slots >= 0
    s = slots[keep].long()
    return cache[s // cache.shape[1], s % cache.shape[1]]


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,num_blocks,block_size",
    [(7, 2, 16, 3, 16), (20, 1, 32, 5, 4), (9, 3, 24, 2, 32), (1, 8, 8, 1, 1)],
    ids=["h2d16b16", "mqa-d32b4", "h3d24b32-npow2", "single"],
)
@pytest.mark.parametrize(
    "src_dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     pytest.param(torch.float32, torch.float16, id="fp32->fp16"), FP32_TO_BF16],
    ids=["fp32", "fp16", "bf16", "fp32->fp16", "fp32->bf16"],
)
def test_matches_reference_scattered_slots_and_skips(num_tokens, num_kv_heads, head_dim, num_blocks,
                                                     block_size, src_dtype, cache_dtype):
    key, value, kc, vc, slots = _case(num_tokens, num_kv_heads, head_dim, num_blocks, block_size,
                                      src_dtype, cache_dtype, seed=num_tokens)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    # bitwise equal, NaN sentinels of unwritten slots included
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    assert torch.equal(kc.nan_to_num(7.0), kc_ref.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc_ref.nan_to_num(7.0))
    keep = slots >= 0
    assert torch.equal(_written(kc, slots), key[keep].to(cache_dtype))
    assert torch.equal(_written(vc, slots), value[keep].to(cache_dtype))
    # exactly the mapped slots were written; skipped tokens (-1) and all other slots are untouched
    assert int((~kc.isnan()).all(-1).all(-1).sum()) == int(keep.sum())


def test_fp32_to_bf16_within_one_ulp():
    """The conversion case above within one bfloat16 ulp (holds under the interpreter too)."""
    key, value, kc, vc, slots = _case(16, 2, 16, 4, 4, torch.float32, torch.bfloat16, seed=9)
    reshape_and_cache(key, value, kc, vc, slots)
    keep = slots >= 0
    for cache, src in ((kc, key), (vc, value)):
        got = _written(cache, slots).float()
        exact = src[keep]
        ulp = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7)
        assert ((got - exact).abs() <= ulp).all()


def test_all_skipped_and_empty():
    key, value, kc, vc, slots = _case(5, 2, 16, 2, 4, torch.float32, torch.float32, seed=1, skip_every=0)
    slots.fill_(-1)
    reshape_and_cache(key, value, kc, vc, slots)
    assert kc.isnan().all() and vc.isnan().all()
    reshape_and_cache(key[:0], value[:0], kc, vc, slots[:0])
    assert kc.isnan().all()


def test_non_contiguous_inputs_and_int64_slots():
    """Keys as transformers hands them ([batch, heads, q_len, d] transposed to tokens-first views)."""
    g = torch.Generator().manual_seed(3)
    batch, heads, q_len, d = 2, 2, 3, 16
    k4 = torch.randn(batch, heads, q_len, d, generator=g).to(DEVICE)
    v4 = torch.randn(batch, heads, q_len, d, generator=g).to(DEVICE)
    key = k4.permute(0, 2, 1, 3).reshape(batch * q_len, heads, d)  # copy, contiguous
    kview = k4.permute(2, 0, 1, 3)[0]  # [batch, heads, d] non-contiguous view (first token per row)
    vview = v4.permute(2, 0, 1, 3)[0]
    assert not kview.is_contiguous()
    _, _, kc, vc, _ = _case(1, heads, d, 4, 4, torch.float32, torch.float32, seed=0)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.tensor([13, 2], dtype=torch.int64, device=DEVICE)
    reshape_and_cache(kview, vview, kc, vc, slots)
    reshape_and_cache_ref(kview, vview, kc_ref, vc_ref, slots)
    assert torch.equal(kc.nan_to_num(7.0), kc_ref.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc_ref.nan_to_num(7.0))
    assert torch.equal(kc[3, 1], key[0]) and torch.equal(kc[0, 2], key[q_len])


def test_overwrite_keeps_other_slots():
    key, value, kc, vc, slots = _case(6, 2, 8, 3, 4, torch.float32, torch.float32, seed=4, skip_every=0)
    reshape_and_cache(key, value, kc, vc, slots)
    before_k = kc.clone()
    reshape_and_cache(key[:2] * 2, value[:2] * 2, kc, vc, slots[:2])
    s = slots.long()
    assert torch.equal(kc[s[:2] // 4, s[:2] % 4], key[:2] * 2)
    assert torch.equal(kc[s[2:] // 4, s[2:] % 4], before_k[s[2:] // 4, s[2:] % 4])


@pytest.mark.parametrize(
    "bad",
    ["key_dims", "kv_shape", "cache_heads", "slot_len", "slot_dtype"],
)
def test_shape_and_dtype_errors(bad):
    key, value, kc, vc, slots = _case(4, 2, 8, 2, 4, torch.float32, torch.float32, seed=5)
    if bad == "key_dims":
        key = key[None]
    elif bad == "kv_shape":
        value = value[:3]
    elif bad == "cache_heads":
        kc, vc = kc[:, :, :1], vc[:, :, :1]
    elif bad == "slot_len":
        slots = slots[:3]
    else:
        slots = slots.float()
    for fn in (reshape_and_cache, reshape_and_cache_ref):
        with pytest.raises(ValueError):
            fn(key, value, kc, vc, slots)


@pytest.mark.parametrize("q_len", [1, 5])
def test_slot_mapping_matches_reference(q_len):
    """Slots and new lengths of rows at different fill levels, scattered blocks; tokens past the block table
    get slot -1."""
    from hf_accel.kernels.reshape_and_cache import slot_mapping, slot_mapping_ref

    g = torch.Generator().manual_seed(q_len)
    block_size, max_blocks = 4, 6
    table = torch.randperm(40, generator=g)[: 3 * max_blocks].view(3, max_blocks).to(DEVICE, torch.int32)
    # the last row runs off the table
    cache_lens = torch.tensor([0, 9, 4 * max_blocks - 2], dtype=torch.int32, device=DEVICE)
    got = slot_mapping(cache_lens, table, q_len, block_size)
    want = slot_mapping_ref(cache_lens, table, q_len, block_size)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[0][q_len]) == int(table[1, 2]) * block_size + 1  # row 1, token 0: position 9
    assert (got[0][-q_len:] == -1).sum() == max(0, q_len - 2)
    with pytest.raises(ValueError, match="int32"):
        slot_mapping(cache_lens.long(), table, q_len, block_size)
    with pytest.raises(ValueError, match="q_len"):
        slot_mapping(cache_lens, table, 0, block_size)


@pytest.mark.parametrize("which", ["value_cache", "key_cache"])
def test_key_and_value_pools_of_different_layouts(which):
    """Each pool is written through its own strides: a value pool of the right shape in another layout (a permuted
    view) used to be written with the key pool's strides, putting values in the wrong slots."""
    key, value, kc, vc, slots = _case(5, 2, 8, 4, 4, torch.float32, torch.float32, seed=6)
    other = torch.full((8, 2, 4, 4), float("nan"), device=DEVICE).permute(3, 2, 1, 0)  # [4, 4, 2, 8], strided
    if which == "value_cache":
        vc = other
    else:
        kc = other
    kc_ref, vc_ref = kc.clone(memory_format=torch.contiguous_format), vc.clone(memory_format=torch.contiguous_format)
    reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc.nan_to_num(7.0), kc_ref.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), vc_ref.nan_to_num(7.0))


@pytest.mark.parametrize("slot", [16, 1000, -2])
def test_slots_outside_the_pools_are_refused(slot):
    """A slot past the pools (4 blocks of 4: slots 0-15) or below -1 raises before anything is written (the
    kernel used to write past the pool); with ``check_slots=False`` the kernel leaves such a slot unwritten."""
    key, value, kc, vc, slots = _case(3, 2, 8, 4, 4, torch.float32, torch.float32, seed=7, skip_every=0)
    slots[1] = slot
    for fn in (reshape_and_cache, reshape_and_cache_ref):
        with pytest.raises(ValueError, match=r"slots in \[.*\]; the pools have 16 slots"):
            fn(key, value, kc, vc, slots)
    assert kc.isnan().all() and vc.isnan().all()
    if slot > 0:  # the reference too (it raised an IndexError, the key pool written in part)
        for fn in (reshape_and_cache, reshape_and_cache_ref):
            kc.fill_(float("nan"))
            vc.fill_(float("nan"))
            fn(key, value, kc, vc, slots, check_slots=False)
            assert torch.isnan(kc).sum() == kc.numel() - 2 * 2 * 8  # rows 0 and 2 only
            s = slots[[0, 2]].long()
            assert torch.equal(kc[s // 4, s % 4], key[[0, 2]]) and torch.equal(vc[s // 4, s % 4], value[[0, 2]])


def test_slot_mapping_refuses_a_block_size_below_one():
    from hf_accel.kernels.reshape_and_cache import slot_mapping, slot_mapping_ref

    cache_lens = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    for fn in (slot_mapping, slot_mapping_ref):
        with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
            fn(cache_lens, table, 1, 0)


@pytest.mark.parametrize("cached", [-3, -40])
def test_slot_mapping_negative_positions_get_no_slot(cached):
    """A negative ``cache_lens`` entry (a caller error the kernel cannot raise) gives its tokens at negative
    positions slot -1 (nothing is written there) instead of reading the block table before the row's start; the
    tokens it reaches at positions >= 0 get their slots; the reference agrees."""
    from hf_accel.kernels.reshape_and_cache import slot_mapping, slot_mapping_ref

    q_len, block_size = 5, 16
    table = torch.tensor([[7, 2], [5, 9]], dtype=torch.int32, device=DEVICE)
    cache_lens = torch.tensor([4, cached], dtype=torch.int32, device=DEVICE)
    got = slot_mapping(cache_lens, table, q_len, block_size)
    want = slot_mapping_ref(cache_lens, table, q_len, block_size)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    row1 = got[0][q_len:].tolist()
    expect = [5 * block_size + p if p >= 0 else -1 for p in range(cached, cached + q_len)]
    assert row1 == expect


@pytest.mark.parametrize("bad", [dict(q_len=True), dict(q_len=torch.tensor(2)), dict(block_size=2.5),
                                 dict(block_size=True)])
def test_slot_mapping_takes_host_int_counts(bad):
    """q_len / block_size of another type: a ValueError naming it (a bool was taken as 1, a tensor or float failed
    inside the kernel launch)."""
    from hf_accel.kernels.reshape_and_cache import slot_mapping, slot_mapping_ref

    cache_lens = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    args = {"q_len": 2, "block_size": 4, **bad}
    name = next(iter(bad))
    for fn in (slot_mapping, slot_mapping_ref):
        with pytest.raises(ValueError, match=f"{name} must be a host int"):
            fn(cache_lens, table, args["q_len"], args["block_size"])


def test_slot_mapping_with_an_empty_block_table():
    from hf_accel.kernels.reshape_and_cache import slot_mapping, slot_mapping_ref

    cache_lens = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    table = torch.empty(2, 0, dtype=torch.int32, device=DEVICE)
    got, want = slot_mapping(cache_lens, table, 2, 4), slot_mapping_ref(cache_lens, table, 2, 4)
    assert got[0].tolist() == want[0].tolist() == [-1] * 4
    assert torch.equal(got[1], want[1])


def test_slot_mapping_ref_makes_the_kernels_checks():
    """The reference refuses what the kernel's launcher refuses: a block table of another batch (it read row 0
    only and answered for one row) and int64 inputs."""
    from hf_accel.kernels.reshape_and_cache import slot_mapping, slot_mapping_ref

    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    one_row = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    for fn in (slot_mapping, slot_mapping_ref):
        with pytest.raises(ValueError, match="same batch"):
            fn(one_row, table, 2, 4)
        with pytest.raises(ValueError, match="int32"):
            fn(torch.tensor([1, 0], device=DEVICE), table.long(), 2, 4)
