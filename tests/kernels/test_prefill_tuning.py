"""The prefill tuner's choice logic (hf_accel.kernels.prefill_tuning.tune), which runs only on a GPU, driven on the CPU
with a stand-in launch whose cost per config is known and ``torch.cuda.synchronize`` made a no-op."""

import time

import pytest
import torch

from hf_accel.kernels import prefill_tuning as pt


@pytest.fixture
def tuner(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(pt, "TUNED", {})
    return pt


def _launch_costing(costs: dict, failing=(), calls=None):
    """A launch that sleeps ``costs[cfg]`` seconds and raises for configs in ``failing`` (as an out-of-resources
    compile would)."""

    def launch(q4, cfg):
        if calls is not None:
            calls.append(cfg)
        if cfg in failing:
            raise RuntimeError("out of resources")
        time.sleep(costs[cfg])

    return launch


def _key(q_bucket=4096, dtype=torch.bfloat16):
    return (128, dtype, True, False, False, q_bucket, 4096)


def test_keeps_the_fastest_candidate_and_records_it(tuner):
    args = {"q4": torch.empty(1, dtype=torch.bfloat16)}
    cands = tuner.candidate_configs(128, 4096, torch.bfloat16)
    assert len(cands) >= 2
    fastest = cands[-1]
    costs = {c: (0.0002 if c == fastest else 0.002) for c in cands}
    got = tuner.tune(_launch_costing(costs), args, _key(), 128, 4096)
    assert got == fastest
    assert tuner.tuned_configs() == {_key(): fastest}


def test_skips_configs_that_fail_and_raises_when_none_runs(tuner):
    args = {"q4": torch.empty(1, dtype=torch.bfloat16)}
    cands = tuner.candidate_configs(128, 4096, torch.bfloat16)
    costs = {c: 0.0001 for c in cands}  # the failing ones would be the fastest
    survivor = cands[-1]
    got = tuner.tune(_launch_costing(costs, failing=set(cands[:-1])), args, _key(), 128, 4096)
    assert got == survivor
    with pytest.raises(RuntimeError, match="no prefill configuration compiled"):
        tuner.tune(_launch_costing(costs, failing=set(cands)), args, _key(q_bucket=8192), 128, 8192)
    assert _key(q_bucket=8192) not in tuner.tuned_configs()


def test_searches_the_query_bucket_and_dtype_of_its_key(tuner):
    """The tuner times exactly the candidates of its key's dtype and bucket (float32 inputs have their own list)."""
    for dtype, bucket in ((torch.bfloat16, 32), (torch.float32, 4096)):
        calls = []
        cands = tuner.candidate_configs(128, bucket, dtype)
        tuner.tune(_launch_costing({c: 0.0 for c in cands}, calls=calls), {"q4": torch.empty(1, dtype=dtype)},
                   _key(bucket, dtype), 128, bucket)
        assert set(calls) == set(cands)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("bucket", [16, 64, 128, 4096, 16384])
def test_candidates_of_one_key_share_the_key_tile_and_warps(head_dim, bucket, dtype):
    """Candidates whose outputs could differ (another tile shape or warp count) must not share a key: the tuner's
    timing-dependent choice would then change bf16 outputs from process to process."""
    cands = pt.candidate_configs(head_dim, bucket, dtype)
    assert len(cands) >= 2
    assert len({(c.block_m, c.block_n, c.num_warps) for c in cands}) == 1, [c.short() for c in cands]
