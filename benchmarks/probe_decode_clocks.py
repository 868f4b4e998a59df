"""SM clock, power and clock-event reasons while batch-1 decode attention runs, against the read-only reference.

Nsight Compute (``probe_decode_ncu.py``, clocks not locked) saw the attention kernel at B1 S32k take fewer cycles
than the read-only reference but more time, at a lower average SM clock (1.81 vs 1.98 GHz on an H100). This probe
checks that outside the profiler: each reader's 10-call CUDA graph (as ``bench_decode.py`` times it) is replayed
back to back for ``--seconds``, in turns (``--turns`` rounds over the readers, so drift hits all alike), while a
thread samples the GPU through NVML (``pynvml``) or, without it, ``nvidia-smi``: SM and memory clocks (MHz), board
power (W) and the active clock-event (throttle) reasons bit mask. Per reader and turn it reports µs per call (CUDA
events over the window), the median of the samples inside the window, and the union of the reasons seen.

Shape: one query token, GQA 32/8, head_dim 128, bf16, block_size 16, a scattered block table, 32 KV splits.
Readers: ``ours`` (``paged_attention`` defaults), ``ours-attention-only`` (its merge launch replaced by nothing),
``read-only`` (``bench_decode``'s reference kernel on the same grid). Writes ``probe_decode_clocks-<date>.json``.

    python benchmarks/probe_decode_clocks.py [--seconds 2] [--turns 3] [--length 32768]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import bench_decode  # noqa: E402
import hf_accel.kernels.paged_attention as pa  # noqa: E402
from probe_decode_fixed_cost import _NoLaunch  # noqa: E402

SPLITS = 32
FIELDS = ("sm_mhz", "mem_mhz", "power_w", "reasons")


class Sampler:
    """Samples (time.monotonic(), sm_mhz, mem_mhz, power_w, reasons bit mask) of GPU 0 on a thread until stopped."""

    def __init__(self, period_s: float = 0.01):
        self.period_s = period_s
        self.samples: list[tuple] = []
        self.source = None
        self._stop = threading.Event()
        self._read = self._nvml_reader() or self._smi_reader()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _nvml_reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                       or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
            reasons(handle)
        except Exception:  # no NVML bindings (or no NVML) here
            return None
        self.source = "nvml"
        return lambda: (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                        pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                        reasons(handle))

    def _smi_reader(self):
        self.source = "nvidia-smi"
        query = "clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"

        def read():
            out = subprocess.run(["nvidia-smi", f"--id={torch.cuda.current_device()}", f"--query-gpu={query}",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            sm, mem, power, reasons = (v.strip() for v in out.strip().split(","))
            return int(sm), int(mem), float(power), int(reasons, 16)

        return read

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), *self._read()))
            time.sleep(self.period_s)

    def __enter__(self):
        self._read()  # fails here, not on the thread, if the source does not work
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def window(self, t0: float, t1: float) -> dict:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        out = {"samples": len(inside)}
        for i, name in enumerate(FIELDS[:3], start=1):
            out[name] = statistics.median(s[i] for s in inside) if inside else float("nan")
        out["reasons"] = 0
        for s in inside:
            out["reasons"] |= s[4]
        return out


def run_window(graph: torch.cuda.CUDAGraph, seconds: float) -> tuple[float, float, float]:
    """Replays ``graph`` back to back for about ``seconds``: (µs per call, window start, window end)."""
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replays = 0
    while time.monotonic() - t0 < seconds:
        for _ in range(50):
            graph.replay()
        replays += 50
        if replays % 500 == 0:
            torch.cuda.synchronize()  # keeps the host from running far ahead of the window
    end.record()
    torch.cuda.synchronize()
    t1 = time.monotonic()
    return start.elapsed_time(end) * 1e3 / (replays * bench_decode.REPS), t0, t1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="replay time per reader and turn")
    ap.add_argument("--turns", type=int, default=3, help="rounds over the readers")
    ap.add_argument("--length", type=int, default=32768, help="KV length S")
    args = ap.parse_args()
    require_cuda(__file__)
    S = args.length
    k_cache, v_cache, table, seq_lens, q = bench_decode.b1_case(S, seed=S)
    k, v = bench_decode.contiguous_kv(k_cache, v_cache, table, S)
    ref = bench_decode.sdpa_reference(q, k, v)
    kw = dict(num_splits=SPLITS, check_blocks=False)
    out = pa.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw)
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2, f"ours S{S} error {err}"

    capture = bench_decode.capture_calls
    graphs = {"ours": capture(lambda: pa.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw))}
    merge_kernel = pa._merge_splits_kernel
    pa._merge_splits_kernel = _NoLaunch()
    try:
        graphs["ours-attention-only"] = capture(
            lambda: pa.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw))
    finally:
        pa._merge_splits_kernel = merge_kernel
    graphs["read-only"] = capture(bench_decode.read_only_call(k_cache, v_cache, table, S, SPLITS)[0])

    nbytes = 2 * S * bench_decode.H_KV * bench_decode.D * 2
    rows = []
    shape = {"B": 1, "H": bench_decode.H, "H_kv": bench_decode.H_KV, "S": S, "D": bench_decode.D,
             "block_size": bench_decode.BLOCK, "splits": SPLITS, "dtype": "bfloat16"}
    print(f"{'reader':22}{'turn':>5}{'us/call':>9}{'TB/s':>7}{'SM MHz':>8}{'mem MHz':>8}{'W':>7}"
          f"{'reasons':>10}{'samples':>8}")
    with Sampler() as sampler:
        for turn in range(args.turns):
            for name, graph in graphs.items():
                us, t0, t1 = run_window(graph, args.seconds)
                w = sampler.window(t0, t1)
                print(f"{name:22}{turn:5}{us:9.2f}{nbytes / (us * 1e-6) / 1e12:7.2f}{w['sm_mhz']:8.0f}"
                      f"{w['mem_mhz']:8.0f}{w['power_w']:7.1f}{w['reasons']:#10x}{w['samples']:8}", flush=True)
                for metric, unit, value in (("latency", "us", us), ("sm_clock", "MHz", w["sm_mhz"]),
                                            ("mem_clock", "MHz", w["mem_mhz"]), ("power", "W", w["power_w"]),
                                            ("clock_event_reasons", "bitmask", w["reasons"])):
                    rows.append({"bench": "probe_decode_clocks", "provider": name, "shape": {**shape, "turn": turn},
                                 "metric": metric, "unit": unit, "value": value})
        source = sampler.source
    write_results("probe_decode_clocks", rows, {"timing": "cuda_graph", "seconds": args.seconds,
                                                "turns": args.turns, "sampler": source})


if __name__ == "__main__":
    main()
