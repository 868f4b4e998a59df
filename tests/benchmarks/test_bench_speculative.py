"""CPU smoke test of ``benchmarks/bench_speculative.py --tiny`` (tiny random fp32 Llama, token-id prompts)."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest

import hf_accel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_speculative.py"
HAS_SPECULATIVE = hasattr(hf_accel, "SpeculativeConfig") and hasattr(hf_accel, "speculative_stats")
SPECULATIVE = ("ours-prompt_lookup", "ours-early_exit", "ours-draft_model")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_speculative", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bench, tmp_path, monkeypatch, *args):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--tiny", "--batch-sizes", "1,2", *args]) == 0
    files = list(tmp_path.glob("bench_speculative-tiny-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _rows(data, provider, metric, bs=None):
    return [r for r in data["rows"] if r["provider"] == provider and r["metric"] == metric
            and (bs is None or r["shape"]["bs"] == bs)]


def test_tiny_stock_and_ours(bench, tmp_path, monkeypatch):
    """The non-speculative providers: runs before the speculative API exists."""
    data = _run(bench, tmp_path, monkeypatch, "--providers", "hf-greedy,hf-prompt-lookup,ours")
    assert data["meta"]["tiny"] is True
    assert not [r for r in data["rows"] if r["metric"] == "error"]
    categories = data["meta"]["categories"]
    for provider in ("hf-greedy", "hf-prompt-lookup", "ours"):
        assert len(_rows(data, provider, "tokens_per_s", bs=1)) == len(categories)
    assert len(_rows(data, "hf-prompt-lookup", "skipped", bs=2)) == len(categories)
    assert not _rows(data, "hf-prompt-lookup", "tokens_per_s", bs=2)
    for r in _rows(data, "ours", "speedup_vs_ours"):
        assert r["value"] == pytest.approx(1.0)
    assert all(r["value"] > 0 for r in _rows(data, "ours", "new_tokens"))


def test_tiny_without_out_never_writes_results_dir(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert bench.main(["--tiny", "--batch-sizes", "1", "--categories", "open-ended", "--providers", "ours"]) == 0
    written = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert len(written) == 1
    path = Path(written[0])
    assert path.is_file() and path.name.startswith("bench_speculative-tiny-")
    assert tmp_path in path.parents


@pytest.mark.skipif(not HAS_SPECULATIVE, reason="hf_accel has no speculative decoding yet (SpeculativeConfig)")
def test_tiny_speculative_providers_are_lossless(bench, tmp_path, monkeypatch):
    data = _run(bench, tmp_path, monkeypatch)
    errors = [r for r in data["rows"] if r["metric"] == "error"]
    assert not errors, errors
    categories = data["meta"]["categories"]
    for provider in ("hf-greedy", "hf-prompt-lookup", "ours", *SPECULATIVE):
        assert len(_rows(data, provider, "tokens_per_s", bs=1)) == len(categories), provider
    for provider in SPECULATIVE:
        for bs in (1, 2):
            assert len(_rows(data, provider, "tokens_per_s", bs=bs)) == len(categories), (provider, bs)
            assert len(_rows(data, provider, "speedup_vs_ours", bs=bs)) == len(categories), (provider, bs)
        assert [r["value"] for r in _rows(data, provider, "speculative_active", bs=1)] == [1] * len(categories)
        rates = _rows(data, provider, "acceptance_rate", bs=1)
        # None: nothing was drafted in a pass (prompt lookup finding no n-gram match)
        assert len(rates) == len(categories), rates
        assert all(r["value"] is None or 0.0 <= r["value"] <= 1.0 for r in rates), rates
        assert len(_rows(data, provider, "mean_accepted_per_step", bs=1)) == len(categories)
        # fp32, weights far from ties: speculative greedy must reproduce the plain fast path exactly
        identical = _rows(data, provider, "greedy_identical", bs=1)
        assert [r["value"] for r in identical] == [1] * len(categories), (provider, identical)
    assert all(r["shape"]["draft"] == "tiny-llama-first-2-layers" for r in data["rows"])
