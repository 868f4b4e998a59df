"""What the host runs while the GPU idles: reads a torch.profiler Chrome trace recorded with ``with_stack=True``
(``profile_call_overhead.py --stack`` writes ``trace_<provider>.json.gz``) and charges every microsecond in
which no kernel, copy or memset runs on the GPU to the innermost host event running then on the main thread
(a Python function, an aten op or a CUDA runtime call).

Prints, per trace: the GPU's busy and idle time inside the call's window (first to last GPU activity), the idle
time by innermost host event and by innermost Python function (the function an aten op or runtime call was made
from), and the longest idle intervals with the Python function running at their start.

    python benchmarks/analyze_host_gaps.py trace_ours.json.gz [more traces] [--top 25] [--min-gap-us 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Merged [start, end) intervals (µs) in which the GPU runs something."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATS)
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def leaf_segments(events: list[dict], tid) -> list[tuple[float, float, str, str]]:
    """The main thread's time cut into segments, each charged to the innermost event covering it:
    ``(start, end, event name, innermost Python function name)``."""
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and e.get("tid") == tid and "dur" in e),
                  key=lambda e: (e["ts"], -e["dur"]))
    segments = []
    stack: list[tuple[float, str, str]] = []  # (end, name, python function)
    cursor = None

    def emit(until: float) -> None:
        nonlocal cursor
        if stack and cursor is not None and until > cursor:
            _, name, py = stack[-1]
            segments.append((cursor, until, name, py))
        cursor = until if cursor is None or until > cursor else cursor

    for e in host:
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][0] <= start:
            emit(stack[-1][0])
            stack.pop()
        emit(start)
        cursor = start if cursor is None or start > cursor else cursor
        py = e["name"] if e["cat"] == "python_function" else (stack[-1][2] if stack else "")
        stack.append((end, e["name"], py))
    while stack:
        emit(stack[-1][0])
        stack.pop()
    return segments


def main_thread(events: list[dict]):
    counts: dict = defaultdict(float)
    for e in events:
        if e.get("cat") == "python_function":
            counts[e.get("tid")] += e.get("dur", 0)
    return max(counts, key=counts.get) if counts else None


def analyze(path: str, top: int, min_gap: float) -> None:
    events = load(path)
    busy = busy_intervals(events)
    if not busy:
        print(path, ": no GPU activity")
        return
    t0, t1 = busy[0][0], busy[-1][1]
    idle = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] > min_gap]
    busy_us = sum(e - s for s, e in busy)
    idle_us = sum(e - s for s, e in idle)
    segments = leaf_segments(events, main_thread(events))
    by_event: dict = defaultdict(float)
    by_py: dict = defaultdict(float)
    i = 0
    for s, e in idle:
        while i < len(segments) and segments[i][1] <= s:
            i += 1
        j = i
        while j < len(segments) and segments[j][0] < e:
            a, b, name, py = segments[j]
            overlap = min(b, e) - max(a, s)
            if overlap > 0:
                by_event[name] += overlap
                by_py[py] += overlap
            j += 1
    print(f"== {path}: window {1e-3 * (t1 - t0):.3f} ms, GPU busy {1e-3 * busy_us:.3f} ms, idle {1e-3 * idle_us:.3f} "
          f"ms in {len(idle)} gaps > {min_gap} us")
    for title, table in (("innermost host event", by_event), ("innermost Python function", by_py)):
        print(f"-- GPU idle by {title} (ms)")
        for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{1e-3 * us:9.3f}  {name[:140]}")
    print("-- longest gaps (ms from window start, us, Python function at the gap's start)")
    for s, e in sorted(idle, key=lambda se: se[0] - se[1])[:top]:
        at = next((seg for seg in segments if seg[0] <= s < seg[1]), None)
        print(f"{1e-3 * (s - t0):9.3f} {e - s:9.1f}  {(at[3] + ' / ' + at[2])[:140] if at else '-'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-gap-us", type=float, default=0.0)
    args = ap.parse_args()
    for path in args.traces:
        analyze(path, args.top, args.min_gap_us)


if __name__ == "__main__":
    main()
