"""Where a batch-1 verify forward spends the time its extra token rows cost (CUDA, bf16, random weights of
SmolLM2-135M's shape, so no download).

A 16-token verify pass of SmolLM2 takes ~0.62 ms against ~0.49 ms for the one-row decode step. This times the
forward over ``--q-lens`` tokens after ``--context`` cached tokens, captured in a CUDA graph (median of 50
replays, CUDA events, ``profile_speculative_round.time_graph``), in turns over ``--rounds``, under three
settings:

* ``default``: the step as it runs;
* ``no_pdl``: ``DECODE_PDL = ATTENTION_PDL = False`` (every kernel waits for the one before it), so that the
  kernel durations of the profile below are each kernel's own time rather than time spent waiting;
* ``no_gemv``: ``GEMV_ONE_ROW = False`` (the one-row step on ``fused_linear`` like the verify pass: separates
  the matmul kernels' cost from the number of rows).

Then, for each q_len under ``no_pdl``, a torch.profiler table of the kernels per replay (name, calls, summed
device µs). Writes ``profile_verify_kernels-<date>.json``.

    python benchmarks/profile_verify_kernels.py [--q-lens 1,2,8,16] [--context 305] [--rounds 3]
        [--settings 'base:,s4:FUSED_LINEAR_K_SLICES=4']
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    decode_step_overrides,
    require_cuda,
    smollm2_shaped_model,
    step_over_blocks,
    write_results,
)
from profile_speculative_round import time_graph  # noqa: E402

SETTINGS = {"default": "", "no_pdl": "DECODE_PDL=False+ATTENTION_PDL=False", "no_gemv": "GEMV_ONE_ROW=False"}


def kernel_table(fn, reps: int = 10) -> list[dict]:
    """Kernels of one replay of ``fn`` captured in a graph: name, calls, summed device µs (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    _, graph = time_graph(fn, reps=1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if not e.key.startswith(("cuda", "Activity"))]
    events.sort(key=lambda e: -getattr(e, "device_time_total", 0))
    return [{"name": e.key[:90], "calls": e.count / reps, "us": getattr(e, "device_time_total", 0) / reps}
            for e in events]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--q-lens", default="1,2,8,16")
    ap.add_argument("--context", type=int, default=305)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default=None,
                    help="named settings 'NAME:SPEC,NAME:SPEC' (SPEC: step_switches NAME=VALUE+...) instead "
                         "of the three above; the kernel tables then run under the first")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    settings = dict(SETTINGS)
    if args.settings:
        settings = dict(item.split(":", 1) for item in args.settings.split(","))
    q_lens = [int(q) for q in args.q_lens.split(",")]
    model = smollm2_shaped_model()
    fast = model._hf_accel_engine
    ids = torch.randint(100, 49000, (1, args.context), device="cuda")
    with torch.inference_mode():
        step, _ = fast.start(ids, torch.ones_like(ids), 128, lookahead=max(q_lens) + 1)
        steps = {q: step_over_blocks(fast, step, ids, q, args.context) for q in q_lens}
    times: dict = {}
    for r in range(args.rounds):
        for name, spec in settings.items():
            with decode_step_overrides(spec), torch.inference_mode():
                for q, s in steps.items():
                    times.setdefault((name, q), []).append(time_graph(s._forward)[0])
            print(f"round {r} {name:8s} " + "  ".join(f"q{q} {times[(name, q)][-1]:.4f}" for q in q_lens),
                  flush=True)
    shape = {"model": "smollm2-135m-shape", "dtype": "bfloat16", "bs": 1, "context": args.context}
    rows = [{"bench": "profile_verify_kernels", "provider": "ours", "shape": {**shape, "q_len": q, "setting": name,
                                                                            "switches": settings[name]},
             "metric": "forward_ms", "unit": "ms", "value": v} for (name, q), v in times.items()]
    table_setting = "no_pdl" if args.settings is None else next(iter(settings))
    for q, s in steps.items():
        with decode_step_overrides(settings[table_setting]), torch.inference_mode():
            table = kernel_table(s._forward)
        total = sum(e["us"] for e in table)
        print(f"-- q_len {q}, {table_setting}: {sum(e['calls'] for e in table):.0f} kernels, {total:.1f} us summed")
        for e in table[:14]:
            print(f"   {e['name'][:70]:70s} {e['calls']:6.1f} {e['us']:8.1f}")
        rows.append({"bench": "profile_verify_kernels", "provider": "ours",
                     "shape": {**shape, "q_len": q, "setting": table_setting}, "metric": "kernels",
                     "unit": "us per replay (profiled)", "value": table})
    print("-- medians (ms)")
    for name in settings:
        print(f"   {name:8s} " + "  ".join(f"q{q} {statistics.median(times[(name, q)]):.4f}" for q in q_lens))
    write_results("profile_verify_kernels", rows)


if __name__ == "__main__":
    main()
