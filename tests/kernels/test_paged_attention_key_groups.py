"""The key-groups variant of the paged attention kernel (``hf_accel.kernels.paged_attention.KEY_GROUPS``): each tile
of ``block_n`` keys as ``KEY_GROUPS`` groups with their own softmax state, merged after the tile loop. Same cases as
``test_paged_attention.py`` (float64 reference, NaN-poisoned pools, scattered block tables), with a spy that the
variant's kernel ran, and that the launches it does not serve still take the tile kernel."""

from __future__ import annotations

import pytest
import torch

import hf_accel.kernels.paged_attention as pa
from tests.kernels.test_paged_attention import BF16, FP16, FP32, HEADS, HEAD_IDS, Case, SplitSpy, _left_pad_mask

GROUPED = "_paged_attention_key_groups_kernel"
TILE = "_paged_attention_kernel"


@pytest.fixture
def key_groups(monkeypatch):
    """Sets ``KEY_GROUPS`` and spies on both kernels: returns {kernel name: [grids launched]}."""

    def set_groups(groups):
        monkeypatch.setattr(pa, "KEY_GROUPS", groups)
        return {GROUPED: SplitSpy(monkeypatch, GROUPED).grids, TILE: SplitSpy(monkeypatch, TILE).grids}

    return set_groups


@pytest.mark.parametrize("groups,block_n", [(4, 64), (2, 32)], ids=["4x16", "2x16"])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [16, 12, 1])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_matches_reference(key_groups, groups, block_n, q_len, heads, block_size, num_splits):
    """Lengths that are not multiples of the block size or the tile, left padding (key mask), GQA ratios, decode
    and several queries (causal), splits starting inside blocks (block 12)."""
    launched = key_groups(groups)
    seq_lens = [q_len + 2, 150, 37]
    case = Case(seq_lens, *heads, q_len, block_size, seed=block_size * 7 + q_len + groups)
    mask = _left_pad_mask(seq_lens, [0, 9, 2])
    case.check(mask, num_splits=num_splits, block_n=block_n)
    case.check(num_splits=num_splits, block_n=block_n)
    assert len(launched[GROUPED]) == 2 and not launched[TILE]


@pytest.mark.parametrize("chunk_tokens", [24, 2048], ids=["chunks-of-24", "chunks-of-2048"])
def test_chunks_that_end_inside_a_tile(key_groups, chunk_tokens):
    launched = key_groups(4)
    seq_lens = [300, 37, 5]
    case = Case(seq_lens, 8, 2, 1, 12, seed=chunk_tokens)
    out, _ = case.check(num_splits=3, chunk_tokens=chunk_tokens)
    assert launched[GROUPED] and not launched[TILE]
    pa.KEY_GROUPS = None
    ref, _ = case.check(num_splits=3, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_dtypes(key_groups, dtype):
    launched = key_groups(4)
    case = Case([70, 130], 8, 2, 1, 16, dtype, seed=3)
    case.check(num_splits=2)
    assert launched[GROUPED]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_fully_masked_row_is_zero(key_groups, num_splits):
    key_groups(4)
    seq_lens = [45, 17]
    case = Case(seq_lens, 8, 2, 2, 16, seed=5)
    mask = _left_pad_mask(seq_lens, [0, 17])  # row 1 sees nothing
    out, _ = case.check(mask, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert (out[0].abs().sum(-1) > 0).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the interpreter's max over the NaN row
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_max_seq_len_below_a_row_gives_nan(key_groups, num_splits):
    launched = key_groups(4)
    case = Case([300, 20], 4, 2, 1, 16, seed=3)
    q, kc, vc, table, lens, _ = case.args()
    out = pa.paged_attention(q, kc, vc, table, lens, 64, num_splits=num_splits)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()
    assert launched[GROUPED] and not launched[TILE]


def test_non_causal_and_scale(key_groups):
    key_groups(4)
    case = Case([33, 70], 8, 2, 3, 16, seed=4)
    case.check(causal=False, sm_scale=0.3, num_splits=2)


@pytest.mark.parametrize("launch", ["block_n16", "ids-per-tile", "merge_counters", "preload_kv", "after_keys",
                                    "off"])
def test_launches_it_does_not_serve_take_the_tile_kernel(key_groups, launch):
    launched = key_groups(None if launch == "off" else 4)
    case = Case([70, 37], 8, 2, 1, 16, seed=2)
    kw = {"block_n16": dict(block_n=16), "ids-per-tile": dict(chunk_tokens=0), "after_keys": dict(trigger="after_keys"),
          "merge_counters": dict(merge_counters=torch.zeros(4, dtype=torch.int32, device=case.query.device)),
          "preload_kv": dict(preload_kv=True), "off": {}}[launch]
    case.check(num_splits=2, **kw, pdl=launch == "after_keys")
    # the trigger positions only exist with PDL (Hopper): elsewhere "after_keys" is ignored and the variant runs
    tile = launch != "after_keys" or pa.use_pdl(True, case.query)
    assert (bool(launched[TILE]), bool(launched[GROUPED])) == (tile, not tile)
