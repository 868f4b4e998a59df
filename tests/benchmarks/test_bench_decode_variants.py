"""``bench_decode.py --variants``: settings of the paged-attention module's constants, parsed and applied
only for the timed call."""

from __future__ import annotations

import pytest

import hf_accel.kernels.paged_attention as pa
from tests.benchmarks.bench_module import load_bench


def test_variants_parse_none_ints_and_strings():
    bench = load_bench("bench_decode")
    assert bench.parse_variants("MERGE_WARPS=None;MERGE_WARPS=1,MERGE_PDL_TRIGGER=after_wait") == [
        {"MERGE_WARPS": None}, {"MERGE_WARPS": 1, "MERGE_PDL_TRIGGER": "after_wait"}]
    assert bench.parse_variants(None) == [] and bench.parse_variants("") == []


@pytest.mark.parametrize("text", ["MERGE_WARPZ=1", "MERGE_WARPS", "merge_warps=1", "MERGE_WARPS=1,triton=2"])
def test_variants_reject_unknown_names_and_items_without_a_value(text):
    bench = load_bench("bench_decode")
    with pytest.raises(ValueError, match="--variants item"):
        bench.parse_variants(text)


def test_timed_with_sets_the_constants_for_the_call_only_even_when_it_raises():
    bench = load_bench("bench_decode")
    before = (pa.MERGE_WARPS, pa.MERGE_PDL_TRIGGER)
    seen = bench.timed_with({"MERGE_WARPS": None, "MERGE_PDL_TRIGGER": "after_keys"},
                            lambda: (pa.MERGE_WARPS, pa.MERGE_PDL_TRIGGER))
    assert seen == (None, "after_keys")
    assert (pa.MERGE_WARPS, pa.MERGE_PDL_TRIGGER) == before

    def boom():
        assert pa.MERGE_WARPS == 2
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        bench.timed_with({"MERGE_WARPS": 2}, boom)
    assert (pa.MERGE_WARPS, pa.MERGE_PDL_TRIGGER) == before
