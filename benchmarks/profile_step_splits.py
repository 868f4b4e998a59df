"""KV splits of the paged attention inside batch-1 steps: plain step and verify passes (CUDA, bf16, random
weights of SmolLM2-135M's shape, so no download).

At batch 1 the attention grid of SmolLM2 has 3 programs before splitting (one per KV head), so the step's
default (:func:`hf_accel.engine.decode_step.default_num_splits`) splits the keys into ~64-key partitions and
runs a merge kernel per layer. This times each step's forward, captured in a CUDA graph (median of 50
replays, CUDA events, ``profile_speculative_round.time_graph``), with the step's split count forced to each
of ``--splits`` (``0`` = the default), in turns over ``--rounds`` so that drift hits every setting alike, at
cached contexts of ``--contexts`` tokens:

* ``q1``: the one-row decode step; ``q2`` ... ``q32`` (``--q-lens``): the verify pass over that many tokens.

``--set NAME=VALUE+...`` overrides switches of :mod:`hf_accel.engine.step_switches` for the whole run (e.g.
``FUSED_LINEAR_MAX_ROWS=32``: verify passes of 17-32 tokens through fused_linear instead of cuBLAS).
Writes ``profile_step_splits-<date>.json``.

    python benchmarks/profile_step_splits.py [--splits 0,1,2,4] [--contexts 305,600] [--rounds 3]
        [--q-lens 1,2,16] [--set NAME=VALUE+...]
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


def build(model, context: int, q_lens) -> dict:
    """Batch-1 steps of each q_len over ``context`` cached tokens of one row's blocks."""
    fast = model._hf_accel_engine
    ids = torch.randint(100, 49000, (1, context), device="cuda")
    steps = {}
    with torch.inference_mode():  # the step buffers are inference tensors
        step, _ = fast.start(ids, torch.ones_like(ids), 128, lookahead=max(q_lens) + 1)
        for q in q_lens:
            steps[q] = step_over_blocks(fast, step, ids, q, context)
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--splits", default="0,1,2,4")
    ap.add_argument("--contexts", default="305,600")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--q-lens", default="1,2,16")
    ap.add_argument("--set", default="", help="switches of hf_accel.engine.step_switches (NAME=VALUE+...)")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    with decode_step_overrides(args.set):
        _main(args)


def _main(args):
    splits = [int(s) for s in args.splits.split(",")]
    q_lens = [int(q) for q in args.q_lens.split(",")]
    model = smollm2_shaped_model()
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        steps = build(model, context, q_lens)
        defaults = {q: s.num_splits for q, s in steps.items()}
        print(f"context {context}: default splits {defaults}", flush=True)
        times: dict = {}
        for r in range(args.rounds):
            for s in splits:
                with torch.inference_mode():
                    for q, step in steps.items():
                        step.num_splits = s or defaults[q]
                        ms, _ = time_graph(step._forward)
                        times.setdefault((q, s), []).append(ms)
                print(f"round {r} splits {s or 'default'}: "
                      + "  ".join(f"q{q} {times[(q, s)][-1]:.4f}" for q in q_lens), flush=True)
        for q, step in steps.items():
            step.num_splits = defaults[q]
        for (q, s), v in times.items():
            rows.append({"bench": "profile_step_splits", "provider": "ours",
                         "shape": {"model": "smollm2-135m-shape", "dtype": "bfloat16", "bs": 1, "context": context,
                                   "q_len": q, "num_splits": s or defaults[q], "default": s == 0,
                                   "switches": args.set},
                         "metric": "forward_ms", "unit": "ms", "value": v})
        print(f"-- context {context}, medians (ms)")
        for s in splits:
            print(f"   splits {s or 'default':>7}: "
                  + "  ".join(f"q{q} {statistics.median(times[(q, s)]):.4f}" for q in q_lens))
    write_results("profile_step_splits", rows)


if __name__ == "__main__":
    main()
