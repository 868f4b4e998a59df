"""``benchmarks/analyze_host_gaps.py`` on a hand-made trace: the GPU's idle time is charged to the innermost host
event and Python function running then, and nothing else."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "analyze_host_gaps.py"


def _module():
    spec = importlib.util.spec_from_file_location("analyze_host_gaps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EVENTS = [
    {"cat": "python_function", "name": "outer", "ts": 0, "dur": 100, "tid": 1},
    {"cat": "python_function", "name": "inner", "ts": 10, "dur": 30, "tid": 1},
    {"cat": "cpu_op", "name": "aten::add", "ts": 15, "dur": 5, "tid": 1},
    {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, "dur": 5, "tid": 1},
    {"cat": "python_function", "name": "other_thread", "ts": 0, "dur": 10, "tid": 2},
    {"cat": "kernel", "name": "k1", "ts": 0, "dur": 12, "tid": 7},
    {"cat": "kernel", "name": "k2", "ts": 60, "dur": 10, "tid": 7},
    {"cat": "gpu_memcpy", "name": "copy", "ts": 65, "dur": 10, "tid": 8},  # overlaps k2: one busy interval
    {"cat": "kernel", "name": "k3", "ts": 90, "dur": 10, "tid": 7},
]


def test_idle_time_is_charged_to_the_innermost_host_event(tmp_path, capsys):
    m = _module()
    busy = m.busy_intervals(EVENTS)
    assert busy == [(0, 12), (60, 75), (90, 100)]
    segments = m.leaf_segments(EVENTS, m.main_thread(EVENTS))
    # the main thread's time cut at every event boundary, each piece charged to the innermost event
    assert [(a, b, name) for a, b, name, _ in segments] == [
        (0, 10, "outer"), (10, 15, "inner"), (15, 20, "aten::add"), (20, 40, "inner"), (40, 50, "outer"),
        (50, 55, "cudaLaunchKernel"), (55, 100, "outer")]
    assert {py for *_, py in segments} == {"outer", "inner"}  # an aten op or runtime call: its Python caller
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    m.analyze(str(trace), top=10, min_gap=0.0)
    out = capsys.readouterr().out
    # idle: 12-60 (48 us) and 75-90 (15 us): inner 23 + add 5 + outer 15 + launch 5, then outer 15
    assert "GPU busy 0.037 ms, idle 0.063 ms in 2 gaps" in out
    by_py = out.split("-- GPU idle by innermost Python function (ms)")[1].split("--")[0].split()
    assert by_py == ["0.035", "outer", "0.028", "inner"]
