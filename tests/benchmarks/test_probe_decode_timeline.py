"""``benchmarks/probe_decode_timeline.py`` edits copies of the decode kernels' source: every edit must still match
the kernels as they are (one place each), and the stamped copies must keep the originals' parameters plus
``Stamps``."""

from __future__ import annotations

import inspect

import pytest

from tests.benchmarks.bench_module import load_bench


def test_stamped_kernels_build_from_the_current_source():
    probe = load_bench("probe_decode_timeline")
    mod = probe.stamped_module()
    import hf_accel.kernels.paged_attention as pa

    bench_decode = probe.bench_decode
    for stamped, original in ((mod._paged_attention_kernel, pa._paged_attention_kernel),
                              (mod._merge_splits_kernel, pa._merge_splits_kernel),
                              (mod._read_kv_kernel, bench_decode._read_kv_kernel)):
        assert "Stamps" in stamped.arg_names
        assert [a for a in stamped.arg_names if a != "Stamps"] == original.arg_names
        assert "_record(Stamps" in inspect.getsource(stamped.fn)
    assert mod.STAMP_BUFFERS == [None, None, None]


def test_an_edit_that_no_longer_matches_stops_the_probe():
    probe = load_bench("probe_decode_timeline")
    with pytest.raises(SystemExit, match="expected one 'no such line'"):
        probe._edit("kernel source", "no such line", "x")
