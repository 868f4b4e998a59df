"""Paged attention kernel (split-KV, GQA packing) vs a float64 reference over scattered block tables.

Triton's interpreter runs the kernel without a GPU. Pools are filled with NaN except the slots that
hold a sequence's tokens, blocks are assigned through ``randperm``, and block-table entries past a
sequence's last block point at a NaN block: any read outside a sequence's tokens shows up as NaN.

Error rule (flash-attn's): max |kernel - ref64| <= 2 * max |torch_same_dtype - ref64| + 1e-5, where
``torch_same_dtype`` is :func:`paged_attention_ref` computed entirely in the test dtype.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton

import hf_accel.kernels.paged_attention as pa
import hf_accel.kernels.paged_attention_torch as pat
from hf_accel.kernels.paged_attention import paged_attention
from hf_accel.kernels.paged_attention_torch import gather_kv, paged_attention_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Triton's interpreter runs tl.dot on bfloat16 operands over their raw uint16 bit patterns
# (triton-lang/triton#11584; "not supported yet" upstream), so bf16 can only be checked on a GPU.
BF16 = pytest.param(
    torch.bfloat16, id="bf16",
    marks=pytest.mark.xfail(INTERPRET, strict=True,
                            reason="Triton interpreter does not support bfloat16 tl.dot (triton-lang/triton#11584)"),
)
FP16 = pytest.param(torch.float16, id="fp16")
FP32 = pytest.param(torch.float32, id="fp32")

HEADS = [(8, 8), (8, 2), (8, 1)]
HEAD_IDS = ["mha8", "gqa8-2", "mqa8-1"]
HEAD_DIM = 32


class Case:
    """Random queries and a scattered paged K/V pool for sequences of ``seq_lens`` tokens."""

    def __init__(self, seq_lens, num_heads, num_kv_heads, q_len, block_size, dtype=torch.float32, *,
                 head_dim=HEAD_DIM, seed=0, spare_blocks=3, hf_layout=False):
        g = torch.Generator().manual_seed(seed)
        batch = len(seq_lens)
        per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(per_seq) + spare_blocks
        perm = torch.randperm(num_blocks, generator=g).tolist()
        poison = perm.pop()  # never assigned: table padding points here
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.value_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.block_table = torch.full((batch, max(per_seq) + 2), poison, dtype=torch.int32)
        for b, n in enumerate(seq_lens):
            ids = [perm.pop(0) for _ in range(per_seq[b])]
            self.block_table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            for pos in range(n):
                blk, off = ids[pos // block_size], pos % block_size
                self.key_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
                self.value_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
        if hf_layout:  # transformers' query: [b, q, h, d] storage seen as [b, h, q, d]
            self.query = torch.randn(batch, q_len, num_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
        else:
            self.query = torch.randn(batch, num_heads, q_len, head_dim, generator=g).to(dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.max_seq_len = max(seq_lens)
        for name in ("key_cache", "value_cache", "block_table", "query", "seq_lens"):
            setattr(self, name, getattr(self, name).to(DEVICE))

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.max_seq_len)

    def check(self, key_mask=None, *, causal=True, sm_scale=None, **kw):
        """Kernel output, checked against float64 with the 2x-PyTorch rule; returns (out, ref64)."""
        q, kc, vc, table, lens, max_len = self.args()
        out = paged_attention(q, kc, vc, table, lens, max_len, key_mask, causal=causal, sm_scale=sm_scale, **kw)
        batch, num_heads, q_len, head_dim = q.shape
        assert out.shape == (batch, q_len, num_heads, head_dim) and out.dtype == q.dtype
        assert torch.isfinite(out).all(), "kernel read a slot outside the sequences (NaN poison)"
        ref = paged_attention_ref(q.double(), kc.double(), vc.double(), table, lens, max_len, key_mask,
                                  causal=causal, sm_scale=sm_scale)
        same = paged_attention_ref(q, kc, vc, table, lens, max_len, key_mask, causal=causal, sm_scale=sm_scale,
                                   compute_dtype=q.dtype)
        err = (out.double() - ref).abs().max().item()
        torch_err = (same.double() - ref).abs().max().item()
        assert err <= 2 * torch_err + 1e-5, (
            f"kernel error {err:.3g} > 2 * PyTorch {q.dtype} error {torch_err:.3g} + 1e-5"
        )
        return out, ref


class SplitSpy:
    """Counts launches of the split-merge kernel (so a forced split really split)."""

    def __init__(self, monkeypatch, name="_merge_splits_kernel"):
        self.grids = []
        kernel = getattr(pa, name)
        spy = self

        class Wrapped:
            def __getitem__(self, grid):
                spy.grids.append(grid)
                return kernel[grid]

        monkeypatch.setattr(pa, name, Wrapped())


def _left_pad_mask(seq_lens, pads, width=None):
    width = width or max(seq_lens)
    mask = torch.zeros(len(seq_lens), width, dtype=torch.bool)
    for b, (n, p) in enumerate(zip(seq_lens, pads)):
        mask[b, p:n] = True
    return mask.to(DEVICE)


def test_interpreter_is_active_without_gpu():
    if not HAS_CUDA:
        assert INTERPRET


# --- fp32 sweep: block sizes, GQA ratios, decode and multi-token queries ------------------------------


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference_scattered_tables(block_size, heads, q_len):
    num_heads, num_kv_heads = heads
    # per-row lengths, none a multiple of the block size; q_len <= every length
    seq_lens = [max(1, q_len), 17, 45] if q_len == 1 else [5, 17, 45]
    case = Case(seq_lens, num_heads, num_kv_heads, q_len, block_size, seed=block_size + q_len + num_kv_heads)
    out, ref = case.check()
    # a seq_len-1 row with one query sees only its own key: the output is that key's value
    if seq_lens[0] == 1:
        v0 = gather_kv(case.value_cache, case.block_table, 1, 0)[:, 0]  # [kv_heads, d]
        group = num_heads // num_kv_heads
        torch.testing.assert_close(out[0, 0], v0.repeat_interleave(group, 0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "heads,q_len,block_size,num_splits",
    [((8, 2), 1, 16, 3), ((8, 1), 3, 32, 2), ((8, 8), 5, 16, 4), ((8, 2), 4, 32, 3)],
    ids=["gqa-decode-b16-s3", "mqa-q3-b32-s2", "mha-q5-b16-s4", "gqa-q4-b32-s3"],
)
def test_forced_splits_match_reference(heads, q_len, block_size, num_splits, monkeypatch):
    num_heads, num_kv_heads = heads
    seq_lens = [q_len + 12, 45, 33]
    case = Case(seq_lens, num_heads, num_kv_heads, q_len, block_size, seed=num_splits)
    spy = SplitSpy(monkeypatch)
    out_split, _ = case.check(num_splits=num_splits, block_n=16)
    assert len(spy.grids) == 1, "num_splits > 1 did not run the split-KV path"
    out_one, _ = case.check(num_splits=1, block_n=16)
    assert len(spy.grids) == 1
    torch.testing.assert_close(out_split, out_one, rtol=1e-5, atol=1e-5)


def test_default_splits_on_long_sequence(monkeypatch):
    """num_splits=None picks 1 on CPU and splits this small grid (4 programs) on a GPU; forcing splits with
    the default tile size still matches."""
    case = Case([300, 129], 8, 2, 1, 16, seed=11)
    spy = SplitSpy(monkeypatch)
    case.check()
    assert len(spy.grids) == (1 if HAS_CUDA else 0)
    case.check(num_splits=3)
    assert len(spy.grids) == (2 if HAS_CUDA else 1)


@pytest.mark.parametrize(
    "heads,q_len,block_size,head_dim",
    [((8, 1), 5, 16, 32), ((16, 1), 5, 16, 32), ((4, 2), 2, 12, 24), ((2, 1), 1, 1, 80)],
    ids=["rows40-one-m-block", "rows80-two-m-blocks", "block12-d24", "block1-d80"],
)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_row_tiles_odd_block_sizes_and_head_dims(heads, q_len, block_size, head_dim, num_splits):
    """Query-row tiling over several programs (q_len * group > 64), block sizes that are not powers
    of 2 (a tile spans several blocks) and head dims that are not powers of 2."""
    case = Case([q_len + 2, 37, 20], *heads, q_len, block_size, head_dim=head_dim, seed=head_dim)
    mask = _left_pad_mask([q_len + 2, 37, 20], [0, 9, 2])
    case.check(mask, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("chunk_tokens", [0, 24, 2048], ids=["ids-per-tile", "chunks-of-24", "chunks-of-2048"])
@pytest.mark.parametrize("block_size,head_dim", [(16, 32), (12, 24), (1, 32), (128, 32)],
                         ids=["b16", "b12-d24", "b1", "b128"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_block_id_chunks(chunk_tokens, block_size, head_dim, q_len):
    """Both ways of finding a key's block: ids loaded per tile, or per chunk of the split and gathered from
    registers. Splits of 112 keys start inside a block of 12 or 128; chunks of 24 tokens end inside a
    16-key tile (block 12) and a split holds several chunks; with block 1 every key has its own block."""
    seq_lens = [300, 37, q_len + 4]
    case = Case(seq_lens, 8, 2, q_len, block_size, head_dim=head_dim, seed=block_size + q_len)
    mask = _left_pad_mask(seq_lens, [5, 0, 1])
    out, _ = case.check(mask, num_splits=3, block_n=16, chunk_tokens=chunk_tokens)
    if chunk_tokens:
        ref, _ = case.check(mask, num_splits=3, block_n=16, chunk_tokens=0)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_tokens", [0, 2048], ids=["ids-per-tile", "chunks-of-2048"])
@pytest.mark.parametrize("num_splits", [9, 11])
def test_unaligned_split_lengths(chunk_tokens, num_splits, monkeypatch):
    """split_multiple=1: splits of ceil(300 / n) keys (34 or 28), starting inside tiles and cache blocks;
    as many splits as asked (whole 16-key tiles would round them to 7 splits of 48, 10 of 32)."""
    seq_lens = [300, 37, 5]
    case = Case(seq_lens, 8, 2, 1, 16, seed=num_splits)
    mask = _left_pad_mask(seq_lens, [5, 0, 1])
    spy = SplitSpy(monkeypatch, "_paged_attention_kernel")
    out, _ = case.check(mask, num_splits=num_splits, block_n=16, chunk_tokens=chunk_tokens, split_multiple=1)
    assert spy.grids[-1][2] == num_splits
    monkeypatch.undo()
    ref, _ = case.check(mask, num_splits=1, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trigger", [True, "after_wait", "after_keys"])
def test_trigger_positions_run_without_pdl(trigger):
    """The trigger is a no-op without PDL (CPU): every position gives the same output."""
    case = Case([70, 9], 4, 2, 1, 16, seed=7)
    out, _ = case.check(num_splits=3, block_n=16, pdl=True, trigger=trigger)
    ref, _ = case.check(num_splits=3, block_n=16)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bad", ["late", 1])
def test_trigger_errors(bad):
    case = Case([5, 9], 4, 2, 1, 16)
    with pytest.raises(ValueError, match="trigger"):
        paged_attention(*case.args(), trigger=bad)


@pytest.mark.parametrize("bad", [0, 2.0, True])
def test_split_multiple_errors(bad):
    case = Case([5, 9], 4, 2, 1, 16)
    with pytest.raises(ValueError, match="split_multiple"):
        paged_attention(*case.args(), split_multiple=bad)


@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_block_m_override_matches_reference(block_m, monkeypatch):
    """Query rows per program set by the caller (the prefill sweeps): 5 positions x 4 heads of a group =
    20 rows per KV head, so 16 gives two programs per KV head (the default, 32, one); causal rows and a
    left-padded key mask as in a prefill."""
    seq_lens = [40, 33]
    case = Case(seq_lens, 8, 2, 5, 16, seed=block_m)
    mask = _left_pad_mask(seq_lens, [0, 6])
    spy = SplitSpy(monkeypatch, "_paged_attention_kernel")
    case.check(mask, num_splits=1, block_n=16, block_m=block_m)
    assert spy.grids == [(-(-20 // block_m), 2 * 2, 1)]


@pytest.mark.parametrize("bad", [8, 24, 2.0, True])
def test_block_m_errors(bad):
    case = Case([5, 9], 4, 2, 1, 16)
    with pytest.raises(ValueError, match="block_m"):
        paged_attention(*case.args(), block_m=bad)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_chunk_tokens_errors(bad):
    case = Case([5, 9], 4, 2, 1, 16)
    with pytest.raises(ValueError, match="chunk_tokens"):
        paged_attention(*case.args(), chunk_tokens=bad)


def test_huge_chunk_is_capped():
    case = Case([40, 9], 4, 2, 1, 1)  # block 1: 10**9 tokens would be 10**9 blocks in registers
    case.check(chunk_tokens=10**9, block_n=16)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the interpreter's max over the NaN row
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_max_seq_len_below_a_row_gives_nan(num_splits):
    """A max_seq_len smaller than a row's length cannot be checked on the host without a sync: that row
    comes out NaN (not attention over a prefix of its keys); the other rows stay right."""
    case = Case([300, 20], 4, 2, 1, 16, seed=3)
    q, kc, vc, table, lens, _ = case.args()
    out = paged_attention(q, kc, vc, table, lens, 64, num_splits=num_splits, block_n=16)
    assert torch.isnan(out[0]).all()
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), table, lens)
    torch.testing.assert_close(out[1].double(), ref[1], rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the interpreter's max over the NaN row
def test_seq_len_past_the_block_table_gives_nan():
    """A seq_lens entry longer than its block table holds: NaN for that row, no read past the table."""
    case = Case([40, 20], 4, 2, 1, 16, seed=4)
    q, kc, vc, table, lens, _ = case.args()
    lens = lens.clone()
    lens[1] = 16 * table.shape[1] + 5
    out = paged_attention(q, kc, vc, table, lens, int(lens.max()), block_n=16)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


@pytest.mark.parametrize("bad", ["out_shape", "out_dtype", "narrow_mask", "splits0", "block_n20", "block_n8"])
def test_launcher_argument_errors(bad):
    case = Case([5, 9], 4, 2, 1, 16)
    kw, mask = {}, None
    if bad == "out_shape":
        kw["out"] = torch.empty(2, 1, 4, 16, device=DEVICE)
    elif bad == "out_dtype":
        kw["out"] = torch.empty(2, 1, 4, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    elif bad == "narrow_mask":
        mask = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    elif bad == "splits0":
        kw["num_splits"] = 0
    else:
        kw["block_n"] = int(bad.removeprefix("block_n"))
    with pytest.raises(ValueError):
        paged_attention(*case.args(), mask, **kw)


#: the op's three implementations: the kernel's launcher, the PyTorch runtime path, the reference
IMPLEMENTATIONS = {"kernel": paged_attention, "sdpa": pat.paged_attention_sdpa, "ref": paged_attention_ref}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad_id", [-1, "num_blocks", 2**31 - 1])
def test_block_id_outside_the_pools_is_refused(bad_id, impl):
    """A block id that a sequence's keys need but that names no block of the pools: ValueError naming the
    entry (the kernel would read outside the pools; the PyTorch paths read a -1 as the last block, silently)."""
    case = Case([40, 20], 4, 2, 1, 16, seed=5)
    q, kc, vc, table, lens, max_len = case.args()
    table = table.clone()
    table[1, 1] = kc.shape[0] if bad_id == "num_blocks" else bad_id  # row 1 reads blocks 0 and 1 (20 keys)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]"):
        IMPLEMENTATIONS[impl](q, kc, vc, table, lens, max_len)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_negative_seq_len_and_narrow_mask_are_refused(impl):
    """A negative ``seq_lens`` entry (the PyTorch runtime path gave a zero row for it) and, for the PyTorch paths, a
    key mask narrower than the longest row (a broadcast error from inside torch)."""
    case = Case([40, 20], 4, 2, 1, 16, seed=5)
    q, kc, vc, table, lens, max_len = case.args()
    bad = lens.clone()
    bad[1] = -3
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        IMPLEMENTATIONS[impl](q, kc, vc, table, bad, max_len)
    narrow = torch.ones(2, 30, dtype=torch.bool, device=q.device)
    with pytest.raises(ValueError, match="30 columns, fewer than"):
        IMPLEMENTATIONS[impl](q, kc, vc, table, lens, max_len, narrow)


def test_reference_of_an_empty_batch_is_empty():
    case = Case([40, 20], 4, 2, 1, 16, seed=5)
    q, kc, vc, table, lens, max_len = case.args()
    out = paged_attention_ref(q[:0], kc, vc, table[:0], lens[:0], max_len)
    assert out.shape == (0, 1, q.shape[1], q.shape[3])


def test_block_ids_past_a_sequence_are_not_checked():
    """Entries past the blocks a sequence's keys fill are never read: any value there is fine."""
    case = Case([40, 20], 4, 2, 1, 16, seed=6)
    case.block_table[1, 2] = -1
    case.block_table[1, 3:] = 2**31 - 1
    case.check()


def test_check_blocks_false_skips_the_host_check(monkeypatch):
    case = Case([40, 20], 4, 2, 1, 16, seed=7)
    calls = []
    monkeypatch.setattr(pa, "_check_block_ids", lambda *a: calls.append(a))
    paged_attention(*case.args(), check_blocks=False)
    assert calls == []
    paged_attention(*case.args())
    assert len(calls) == 1


# --- key mask (left padding), fully masked rows -------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_left_padding_key_mask(q_len, num_splits, monkeypatch):
    seq_lens = [45, 45, 30]
    pads = [0, 20, 7]  # row 1: the whole first split (16 keys) is padding
    case = Case(seq_lens, 8, 2, q_len, 16, seed=q_len)
    mask = _left_pad_mask(seq_lens, pads, width=48)  # wider than max_seq_len is allowed
    spy = SplitSpy(monkeypatch)
    case.check(mask, num_splits=num_splits, block_n=16)
    assert len(spy.grids) == (1 if num_splits > 1 else 0)
    # int mask = bool mask
    out_bool = paged_attention(*case.args(), mask, num_splits=num_splits, block_n=16)
    out_int = paged_attention(*case.args(), mask.to(torch.int32), num_splits=num_splits, block_n=16)
    assert torch.equal(out_bool, out_int)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", [FP32, FP16])
def test_fully_masked_row_is_zero(dtype, num_splits):
    seq_lens = [45, 17]
    case = Case(seq_lens, 8, 2, 2, 16, dtype, seed=5)
    mask = _left_pad_mask(seq_lens, [0, 17])  # row 1 sees nothing
    out, ref = case.check(mask, num_splits=num_splits, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert (out[0].abs().sum(-1) > 0).all()


def test_non_causal_and_scale():
    case = Case([17, 33], 8, 2, 3, 16, seed=6)
    case.check(causal=False)
    case.check(causal=False, sm_scale=0.3, num_splits=2, block_n=16)


# --- dtypes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_dtypes_error_rule(dtype, q_len, num_splits):
    seq_lens = [q_len + 4, 45, 38]
    case = Case(seq_lens, 8, 2, q_len, 16, dtype, seed=7 + q_len)
    mask = _left_pad_mask(seq_lens, [0, 3, 10])
    case.check(mask, num_splits=num_splits, block_n=16)


# --- layouts, out buffer, errors --------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 2], ids=["one-split", "two-splits"])
def test_transformers_query_layout_and_out_buffer(num_splits):
    case = Case([20, 37], 8, 2, 2, 16, hf_layout=True, seed=8)
    assert not case.query.is_contiguous()
    out, _ = case.check(num_splits=num_splits, block_n=16)
    # a non-contiguous out buffer ([b, h, q, d] storage seen as [b, q, h, d]) is filled in place
    buf = torch.full((2, 8, 2, HEAD_DIM), float("nan"), device=DEVICE).transpose(1, 2)
    got = paged_attention(*case.args(), num_splits=num_splits, block_n=16, out=buf)
    assert got is buf
    assert torch.equal(buf, out)


@pytest.mark.parametrize("bad", [10.0, torch.tensor(10), -1, True, None])
def test_max_seq_len_must_be_a_host_int(bad):
    case = Case([5, 9], 4, 2, 1, 16)
    q, kc, vc, table, lens, _ = case.args()
    with pytest.raises(ValueError, match="max_seq_len must be a host int >= 0"):
        paged_attention(q, kc, vc, table, lens, bad)


def test_max_seq_len_takes_any_integer_type():
    import numpy as np

    case = Case([5, 9], 4, 2, 1, 16)
    q, kc, vc, table, lens, max_len = case.args()
    assert torch.equal(paged_attention(q, kc, vc, table, lens, np.int64(max_len)),
                       paged_attention(q, kc, vc, table, lens, max_len))


def test_empty_batch_or_query():
    case = Case([5], 4, 2, 1, 16)
    q, kc, vc, table, lens, max_len = case.args()
    out = paged_attention(q[:, :, :0], kc, vc, table, lens, max_len)
    assert out.shape == (1, 0, 4, HEAD_DIM)


@pytest.mark.parametrize("bad", ["heads", "dtype", "table_dtype", "lens_shape", "mask_rows", "head_dim"])
def test_argument_errors(bad):
    case = Case([5, 9], 4, 2, 1, 16)
    q, kc, vc, table, lens, max_len = case.args()
    mask = None
    if bad == "heads":
        q = q[:, :3]
    elif bad == "dtype":
        q = q.half()
    elif bad == "table_dtype":
        table = table.long()
    elif bad == "lens_shape":
        lens = lens[:1]
    elif bad == "mask_rows":
        mask = torch.ones(1, 9, dtype=torch.bool, device=DEVICE)
    else:
        kc, vc = kc[..., :16], vc[..., :16]
    with pytest.raises(ValueError):
        paged_attention(q, kc, vc, table, lens, max_len, mask)



@pytest.mark.parametrize(
    "heads,q_len,block_size,num_splits",
    [((8, 2), 1, 16, 3), ((9, 3), 1, 16, 3), ((8, 1), 3, 32, 2), ((16, 1), 5, 16, 4)],
    ids=["gqa-decode-s3", "group3-decode-s3", "mqa-q3-s2", "rows80-two-m-blocks-s4"],
)
@pytest.mark.parametrize("merge_tile", [None, "two-rows"], ids=["default-tile", "two-rows-per-load"])
def test_fused_merge_matches_merge_kernel(heads, q_len, block_size, num_splits, merge_tile, monkeypatch):
    """Splits merged by the last split program to arrive (merge_counters): no merge kernel launched, the
    output equal to the merge kernel's within fp32 summation order, and the counters left at zero for the
    next launch (run twice on the same counters). ``two-rows-per-load``: the merge loads two query rows'
    partials at a time (``MERGE_TILE_ELEMENTS`` lowered), so a row block is merged in several groups, the
    last ones partly or wholly past the last query row."""
    if merge_tile:
        block_d = max(16, triton.next_power_of_2(HEAD_DIM))
        monkeypatch.setattr(pa, "MERGE_TILE_ELEMENTS", 2 * triton.next_power_of_2(num_splits) * block_d)
    num_heads, num_kv_heads = heads
    case = Case([q_len + 12, 45, 33], num_heads, num_kv_heads, q_len, block_size, seed=7 + num_splits)
    want, _ = case.check(num_splits=num_splits, block_n=16)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    spy = SplitSpy(monkeypatch)
    for _ in range(2):
        got, _ = case.check(num_splits=num_splits, block_n=16, merge_counters=counters)
        assert not spy.grids, "the merge kernel ran although the attention kernel merges"
        assert int(counters.abs().sum()) == 0, "arrival counters not reset"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fused_merge_counters_checked():
    case = Case([40], 8, 2, 1, 16)
    with pytest.raises(ValueError, match="merge_counters must be"):
        paged_attention(*case.args(), num_splits=2, merge_counters=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="merge_counters must be"):
        paged_attention(*case.args(), num_splits=2, merge_counters=torch.zeros(8, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("q_len,num_splits", [(1, 1), (1, 3), (4, 2), (5, 4)])
def test_preload_kv_matches_reference(q_len, num_splits):
    """The first tile's old K/V loaded ahead (``preload_kv``), the new tokens' rows loaded after: same
    attention as the reference, with splits starting inside and outside the new tokens."""
    case = Case([q_len + 12, 45, 33], 8, 2, q_len, 16, seed=3 + q_len)
    mask = _left_pad_mask([q_len + 12, 45, 33], [0, 3, 0])
    case.check(mask, num_splits=num_splits, block_n=16, preload_kv=True)
    case.check(num_splits=num_splits, block_n=16, preload_kv=True)


# --- the PyTorch runtime path for CPU tensors -----------------------------------------------------------


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("seq_lens", [[45], [5, 17, 45], [17, 17]], ids=["one-row", "ragged", "equal"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "left-padded"])
def test_sdpa_path_matches_reference(seq_lens, heads, q_len, masked):
    """paged_attention_sdpa (CPU runtime path) vs the float64 reference on scattered, NaN-poisoned pools:
    ragged rows (slots past a row's length never leak in), left padding, GQA/MQA, multi-token causal rows."""
    num_heads, num_kv_heads = heads
    case = Case(seq_lens, num_heads, num_kv_heads, q_len, 16, dtype=torch.float64, seed=len(seq_lens) + q_len)
    q, kc, vc, table, lens, max_len = case.args()
    mask = _left_pad_mask(seq_lens, [min(3, n - q_len) for n in seq_lens]) if masked else None
    ref = paged_attention_ref(q, kc, vc, table, lens, max_len, mask)
    got = pat.paged_attention_sdpa(q.cpu(), kc.cpu(), vc.cpu(), table.cpu(), lens.cpu(), max_len,
                                  None if mask is None else mask.cpu())
    assert got.shape == ref.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref.cpu(), rtol=1e-10, atol=1e-10)


def test_sdpa_path_one_row_in_consecutive_blocks_reads_a_view(monkeypatch):
    """One row in consecutive blocks (the block manager's usual layout for a single sequence) is read as a
    view of the pool, not gathered; the result still equals the reference, also for a fully masked row."""
    g = torch.Generator().manual_seed(7)
    kc, vc = (torch.randn(6, 4, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64, generator=g)
    table = torch.tensor([[1, 2, 3, 0]], dtype=torch.int32)
    lens = torch.tensor([10], dtype=torch.int32)
    gathered = []
    real_gather = pat._gather_rows

    def spy(cache, block_table, length):
        out = real_gather(cache, block_table, length)
        gathered.append(out.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr())
        return out
    monkeypatch.setattr(pat, "_gather_rows", spy)
    got = pat.paged_attention_sdpa(q, kc, vc, table, lens, 10)
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, table, lens, 10), rtol=1e-12, atol=1e-12)
    assert gathered == [True, True]
    none = torch.zeros(1, 10, dtype=torch.bool)
    assert torch.equal(pat.paged_attention_sdpa(q, kc, vc, table, lens, 10, none), torch.zeros(1, 1, 4, 8,
                                                                                              dtype=torch.float64))


@pytest.mark.parametrize("num_splits,block_d,want", [(32, 128, 1), (3, 64, 1), (64, 128, 2), (128, 128, 4),
                                                     (4096, 256, 8)])
def test_merge_warps(num_splits, block_d, want):
    """The split-merge kernel runs on the fewest warps that hold its [splits, head_dim] tile at
    MERGE_WARP_ELEMENTS per warp (one for the decode shapes), at most 8."""
    assert pa.merge_warps(num_splits, block_d) == want


@pytest.mark.parametrize("warps", [4, None])
@pytest.mark.parametrize("position", [None, "after_wait", "after_keys"])
def test_merge_pdl_trigger_positions(position, warps, monkeypatch):
    """With MERGE_PDL_TRIGGER, launches without ``pdl`` still launch the merge kernel with PDL where available
    (Hopper); wherever the attention kernel lets it launch, and on however many warps, it waits for the partials:
    the output is bit-identical to the launch without PDL on as many warps (other warp counts sum the splits in
    another order: equal to within rounding)."""
    case = Case([300, 9, 129], 8, 2, 1, 16, seed=11)
    default, _ = case.check(num_splits=5, block_n=16)
    monkeypatch.setattr(pa, "MERGE_WARPS", warps)
    ref, _ = case.check(num_splits=5, block_n=16)
    torch.testing.assert_close(ref, default, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(pa, "MERGE_PDL_TRIGGER", position)
    spy = SplitSpy(monkeypatch)
    out, _ = case.check(num_splits=5, block_n=16)
    assert len(spy.grids) == 1
    assert torch.equal(out, ref)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs and PDL need a GPU")
@pytest.mark.parametrize("warps", [4, None])
@pytest.mark.parametrize("position", [None, "after_wait", "after_keys"])
def test_merge_pdl_back_to_back_in_a_cuda_graph(position, warps, monkeypatch):
    """Twelve split launches captured back to back in one CUDA graph (a call's partials may reuse memory the
    previous call freed): every output equals its eager launch. A merge kernel that read the partials before
    the attention kernel finished, or an attention kernel that overwrote them while the previous merge read
    them, would differ."""
    monkeypatch.setattr(pa, "MERGE_PDL_TRIGGER", position)
    monkeypatch.setattr(pa, "MERGE_WARPS", warps)
    g = torch.Generator(device="cuda").manual_seed(3)
    block, kv_heads, heads, d, seq = 16, 8, 32, 128, 8192
    nb = seq // block
    kc = torch.randn(nb, block, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nb, block, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(nb, device="cuda", generator=g).view(1, nb).int()
    lens = torch.full((1,), seq, dtype=torch.int32, device="cuda")
    queries = [torch.randn(1, heads, 1, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(12)]
    want = [paged_attention(q, kc, vc, table, lens, seq, num_splits=32) for q in queries]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        paged_attention(queries[0], kc, vc, table, lens, seq, num_splits=32, check_blocks=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [paged_attention(q, kc, vc, table, lens, seq, num_splits=32, check_blocks=False) for q in queries]
    for _ in range(3):
        for out in outs:
            out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for out, ref in zip(outs, want):
            assert torch.equal(out, ref)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("empty", ["num_kv_heads", "block_size"])
def test_pools_with_an_empty_dimension_are_refused(impl, empty):
    """Pools with 0 KV heads or a block size of 0: a ValueError naming the dimension (was a ZeroDivisionError from
    the argument checks, from all three implementations)."""
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    shape = [4, 0, 2, 16] if empty == "block_size" else [4, 4, 0, 16]
    kc, vc = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=f"{empty} must be >= 1"):
        IMPLEMENTATIONS[impl](q, kc, vc, table, lens, 3)
