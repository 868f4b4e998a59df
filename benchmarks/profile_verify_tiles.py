"""Verify-pass time of a SmolLM2-shaped model for the decode step's FUSED_LINEAR_ROPE x
FUSED_LINEAR_SMALL_TILES switches (A/B of kernel choices; random bf16 weights, so no download).

Shape: hidden 576, 30 layers, 9 / 3 heads of 64, intermediate 1536, vocab 49152 (SmolLM2-135M), batch 1,
a 305-token prompt. Each setting times the target forward over ``q_len`` = 2 and 16 tokens (what a
speculative verify pass runs) captured in a CUDA graph: the median of 50 replays, taken 3 times. Rows
``{"provider": "ours", "shape": {..., "fused_linear_rope", "small_tiles", "L"}, "metric": "latency",
"unit": "ms", "value": [3 medians]}``; ``profile_verify_tiles-<date>.json``.

    python benchmarks/profile_verify_tiles.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, smollm2_shaped_model, step_over_blocks, write_results  # noqa: E402
from profile_speculative_round import time_graph  # noqa: E402

PROMPT = 305


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    require_cuda(__file__)
    from hf_accel.engine import step_switches

    model = smollm2_shaped_model()
    fast = model._hf_accel_engine
    ids = torch.randint(100, 49000, (1, PROMPT), device="cuda")
    rows = []
    saved = step_switches.FUSED_LINEAR_ROPE, step_switches.FUSED_LINEAR_SMALL_TILES
    try:
        with torch.inference_mode():
            step, _ = fast.start(ids, torch.ones_like(ids), 128, lookahead=17)
            for rope in (True, False):
                for tiles in (True, False):
                    step_switches.FUSED_LINEAR_ROPE, step_switches.FUSED_LINEAR_SMALL_TILES = rope, tiles
                    for q in (2, 16):
                        v = step_over_blocks(fast, step, ids, q, PROMPT)

                        def fwd(v=v):
                            return v.forward_tokens(v.input_ids, v.position_ids, v.cache_lens, v.block_table,
                                                    v.key_mask)

                        ms = [time_graph(fwd)[0] for _ in range(3)]
                        print(f"rope={rope} small_tiles={tiles} q_len={q}: {[round(m, 4) for m in ms]} ms", flush=True)
                        rows.append({"bench": "profile_verify_tiles", "provider": "ours",
                                     "shape": {"model": "smollm2-135m-shape", "dtype": "bfloat16", "bs": 1,
                                               "prompt_len": PROMPT, "L": q, "fused_linear_rope": rope,
                                               "small_tiles": tiles},
                                     "metric": "latency", "unit": "ms", "value": ms})
            fast.cache.release()
    finally:
        step_switches.FUSED_LINEAR_ROPE, step_switches.FUSED_LINEAR_SMALL_TILES = saved
    write_results("profile_verify_tiles", rows)


if __name__ == "__main__":
    main()
