"""How busy the GPU is during a batch-1 ``generate`` call (real SmolLM2 bf16, CUDA): the GPU timeline of
whole calls, plain fast path vs prompt lookup, on the grounded-text prompts of ``bench_speculative``.

Each of the 8 prompts runs ``generate`` (128 new tokens, greedy) after warm-up calls, once without a
profiler (``wall_ms``, CUDA-synced) and once under ``torch.profiler`` recording CUDA activity only (no CPU
ops). From the profiled call's GPU activities (kernels, copies, fills):

* ``busy_ms``: the union of their intervals; ``span_ms``: first start to last end; ``profiled_wall_ms``;
* ``pre_ms`` / ``post_ms``: idle time on the GPU from the call's start to its first activity, and from its last
  activity to the call's return (marker kernels launched right before and after the call);
* ``longest_gaps``: the 8 longest idle gaps (where in the call, how long, the activities around them);
* ``gap_ms[<bucket>]`` / ``gaps[<bucket>]``: total length and number of idle gaps between consecutive
  activities, by length in µs (``<2``, ``2-5``, ``5-10``, ``10-20``, ``20-50``, ``50-100``, ``>=100``). Gaps
  inside a CUDA graph are a few µs; a gap of tens of µs is the GPU waiting for the host (a round's choice,
  a graph launch, the call's set-up).

The profiler adds host time to every launch, so ``profiled_wall_ms`` exceeds ``wall_ms``; the gaps are
upper bounds of the unprofiled ones. Writes ``profile_call_timeline-<date>.json``.

With ``--cprofile``, the 8 calls of each provider also run once under cProfile: the top functions by own
and by cumulative time are printed, and the dumps are written to ``$OUT`` (``calls_<provider>.prof``).

    python benchmarks/profile_call_timeline.py [--cprofile]
"""
import argparse
import cProfile
import io
import os
import pstats
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402

BUCKETS = ((0, 2), (2, 5), (5, 10), (10, 20), (20, 50), (50, 100), (100, float("inf")))
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def bucket_name(lo, hi) -> str:
    return f"<{hi}" if lo == 0 else (f">={lo}" if hi == float("inf") else f"{lo}-{hi}")


def gpu_intervals(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start, end, name), times in µs, of every GPU activity of a Chrome trace, sorted by start."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "")) for e in events
           if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    return sorted(out)


def timeline_stats(intervals: list[tuple[float, float, str]], top: int = 0) -> dict:
    """Busy time, span and idle gaps (µs) of sorted intervals. Intervals named ``spin_kernel``
    (``torch.cuda._sleep``) are call markers: the first and the last bound the call on the GPU's clock and
    give ``pre_ms`` (marker to the call's first activity) and ``post_ms`` (its last activity to the closing
    marker); with ``top``, the ``top`` longest gaps as (ms from the first marker, µs, activity before, after)."""
    markers = [iv for iv in intervals if "spin_kernel" in iv[2]]
    intervals = [iv for iv in intervals if "spin_kernel" not in iv[2]]
    busy, gaps = 0.0, []
    cur_s, cur_e, cur_name = intervals[0]
    for s, e, name in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e, cur_name, name))
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
        cur_name = name if e >= cur_e else cur_name
    busy += cur_e - cur_s
    stats = {"busy_ms": busy / 1e3, "span_ms": (intervals[-1][1] - intervals[0][0]) / 1e3,
             "activities": len(intervals)}
    if len(markers) >= 2:
        stats["pre_ms"] = (intervals[0][0] - markers[0][1]) / 1e3
        stats["post_ms"] = (markers[-1][0] - max(e for _, e, _ in intervals)) / 1e3
    for lo, hi in BUCKETS:
        sel = [g for g, *_ in gaps if lo <= g < hi]
        stats[f"gap_ms[{bucket_name(lo, hi)}]"] = sum(sel) / 1e3
        stats[f"gaps[{bucket_name(lo, hi)}]"] = len(sel)
    if top:
        origin = markers[0][1] if markers else intervals[0][0]
        stats["longest_gaps"] = [(round((at - origin) / 1e3, 3), round(g, 1), before[:60], after[:60])
                                 for g, at, before, after in sorted(gaps, reverse=True)[:top]]
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--cprofile", action="store_true", help="also run each provider's 8 calls under cProfile")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    from torch.profiler import ProfilerActivity, profile

    tmp = Path(tempfile.mkdtemp())
    model, tok = load_default_model(dtype="bfloat16", device="cuda")
    batches = [bs.encode(tok, [t], "cuda") for t in bs.chat_texts(tok, "grounded-text")]
    base = {"model": "smollm2-135m", "dtype": "bfloat16", "bs": 1, "category": "grounded-text",
            "max_new_tokens": 128}
    rows, totals = [], {}
    for provider, spec in (("ours", None), ("ours-prompt_lookup", "prompt_lookup")):
        hf_accel.accelerate_model(model, **({"speculative": spec} if spec else {}))

        def gen(ids, mask):
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, do_sample=False)

        for ids, mask in batches:  # warm-up: graph captures, Triton compilation, round times
            gen(ids, mask)
            gen(ids, mask)
        agg = {}
        for i, (ids, mask) in enumerate(batches):
            walls = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = gen(ids, mask)
                torch.cuda.synchronize()
                walls.append(1e3 * (time.perf_counter() - t))
            new = int(out.shape[1] - ids.shape[1])
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                t = time.perf_counter()
                torch.cuda._sleep(1)  # markers of the call's start and end on the GPU's clock
                gen(ids, mask)
                torch.cuda._sleep(1)
                torch.cuda.synchronize()
                pwall = 1e3 * (time.perf_counter() - t)
            path = tmp / f"{provider}-{i}.json"
            prof.export_chrome_trace(str(path))
            vals = {"wall_ms": statistics.median(walls), "profiled_wall_ms": pwall, "new_tokens": new,
                    **timeline_stats(gpu_intervals(path), top=8)}
            longest = vals.pop("longest_gaps")
            for k, v in vals.items():
                agg[k] = agg.get(k, 0) + v
            print(provider, i, {k: round(v, 3) for k, v in vals.items()}, flush=True)
            if i < 2:
                for gap in longest:
                    print("   gap", gap)
            vals["longest_gaps"] = longest
            shape = {**base, "prompt_len": int(ids.shape[1]), "prompt_index": i}
            for metric, value in vals.items():
                rows.append({"bench": "profile_call_timeline", "provider": provider, "shape": shape,
                             "metric": metric, "unit": ("ms" if metric.endswith("ms") or "_ms[" in metric else
                                                        "(ms from call start, µs, before, after)" if metric ==
                                                        "longest_gaps" else "count"), "value": value})
        if args.cprofile:
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for ids, mask in batches:
                gen(ids, mask)
            torch.cuda.synchronize()
            pr.disable()
            if os.environ.get("OUT"):
                pr.dump_stats(str(Path(os.environ["OUT"]) / f"calls_{provider}.prof"))
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(pr, stream=text).sort_stats(order).print_stats(30)
                print(f"-- {provider}: cProfile of the 8 calls by {order}\n" + text.getvalue().split("\n\n", 1)[-1])
        totals[provider] = agg
        rows.append({"bench": "profile_call_timeline", "provider": provider, "shape": {**base, "prompts": len(batches)},
                     "metric": "sum_over_prompts", "unit": "ms / count", "value": agg})
        hf_accel.revert_model(model)
    print("\nsum over the 8 prompts")
    keys = list(next(iter(totals.values())))
    print(f"{'':24s}" + "".join(f"{p:>22s}" for p in totals))
    for k in keys:
        print(f"{k:24s}" + "".join(f"{totals[p][k]:22.3f}" for p in totals))
    write_results("profile_call_timeline", rows, {"profiler": "torch.profiler, CUDA activity only"})


if __name__ == "__main__":
    main()
