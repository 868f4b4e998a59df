"""Where a batch-1 prefill graph's GPU time goes (real SmolLM2 bf16, CUDA): the bucketed prefill of the
grounded-text prompts of ``bench_speculative`` (256- and 512-token buckets), replayed under torch.profiler
(CUDA activity only).

Per bucket: the graph's GPU time (CUDA events, median of 20 replays) and the kernels of one replay summed
by name (calls, µs; kernels overlap under programmatic dependent launch, so their sum can exceed the
graph's time), plus the sum of idle gaps between consecutive kernels on the GPU.

    python benchmarks/profile_prefill.py
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.engine.fast_generate import prefill_bucket  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402


def gpu_ms(graph, reps=20):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        ev[0].record()
        graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
        out.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(out)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    require_cuda(__file__)
    from torch.profiler import ProfilerActivity, profile

    model, tok = load_default_model(dtype="bfloat16", device="cuda")
    hf_accel.accelerate_model(model)
    fast = model._hf_accel_engine
    batches = [bs.encode(tok, [t], "cuda") for t in bs.chat_texts(tok, "grounded-text")]
    rows, done = [], set()
    tmp = Path(tempfile.mkdtemp())
    for ids, mask in batches:
        length = prefill_bucket(ids.shape[1])
        if length in done:
            continue
        done.add(length)
        with torch.inference_mode():
            step, _ = fast.start(ids, mask, 128)
            graph, _ = step.graphs[("prefill", length)]
            ms = gpu_ms(graph)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                graph.replay()
                torch.cuda.synchronize()
            fast.cache.release()
        path = tmp / f"prefill-{length}.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        events.sort(key=lambda e: e["ts"])
        by_name: dict = {}
        for e in events:
            name = e["name"][:90]
            calls, us = by_name.get(name, (0, 0.0))
            by_name[name] = (calls + 1, us + e["dur"])
        gaps, end = 0.0, None
        for e in events:
            if end is not None and e["ts"] > end:
                gaps += e["ts"] - end
            end = max(end or 0, e["ts"] + e["dur"])
        span = (end - events[0]["ts"]) if events else 0.0
        table = sorted(({"name": n, "calls": c, "us": round(u, 1)} for n, (c, u) in by_name.items()),
                       key=lambda r: -r["us"])
        shape = {"model": "smollm2-135m", "dtype": "bfloat16", "bs": 1, "prompt_len": int(ids.shape[1]),
                 "prefill_len": length}
        print(f"prefill {length}: {ms:.3f} ms GPU, span {span / 1e3:.3f} ms, idle gaps {gaps / 1e3:.3f} ms, "
              f"{len(events)} kernels", flush=True)
        for r in table[:14]:
            print(f"   {r['calls']:4d} {r['us']:9.1f} us  {r['name']}")
        for metric, value, unit in (("gpu_ms", ms, "ms"), ("span_ms", span / 1e3, "ms"), ("gap_ms", gaps / 1e3, "ms"),
                                    ("kernels", len(events), "count"), ("kernel_table", table, "calls / us by name")):
            rows.append({"bench": "profile_prefill", "provider": "ours", "shape": shape, "metric": metric,
                         "unit": unit, "value": value})
    write_results("profile_prefill", rows)


if __name__ == "__main__":
    main()
