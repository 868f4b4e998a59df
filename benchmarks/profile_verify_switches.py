"""A/B of decode-step switches and fused_linear tiles on the steps of 2-16 token rows (CUDA, bf16, random
weights of SmolLM2-135M's shape, so no download).

Shape: hidden 576, 30 layers, 9 / 3 heads of 64, intermediate 1536, vocab 49152, a 305-token prompt. Timed,
each captured in a CUDA graph (median of 50 replays, CUDA events, ``profile_speculative_round.time_graph``):

* ``verify_q2`` / ``verify_q16``: the target forward of a batch-1 verify pass over 2 / 16 tokens;
* ``bs16_step``: one decode step of 16 rows (16 prompts of 305 tokens), which runs the same 16-row kernels.

Switch settings (``--variants``, names of :data:`VARIANTS`) run in turns, ``--rounds`` times, so that drift
hits every setting alike. With ``--sweep`` the best setting (lowest mean ``verify_q16``) then gets a
coordinate search over the tiles of each of the four projections (q/k/v + RoPE, o, gate/up + SwiGLU, down):
one tile parameter changed at a time, kept where ``verify_q16`` and ``bs16_step`` both got faster.
Writes ``profile_verify_switches-<date>.json``.

    python benchmarks/profile_verify_switches.py [--sweep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, smollm2_shaped_model, step_over_blocks, write_results  # noqa: E402
from profile_speculative_round import time_graph  # noqa: E402

PROMPT = 305

VARIANTS = {
    "default": {},
    "preload": {"FUSED_LINEAR_PRELOAD": True},
    "overlap": {"MULTI_ROW_ATTENTION_OVERLAP": True},
    "preload+overlap": {"FUSED_LINEAR_PRELOAD": True, "MULTI_ROW_ATTENTION_OVERLAP": True},
    "preload+overlap+small_tiles": {"FUSED_LINEAR_PRELOAD": True, "MULTI_ROW_ATTENTION_OVERLAP": True,
                                    "FUSED_LINEAR_SMALL_TILES": True},
    "whole_k": {"FUSED_LINEAR_WHOLE_K": True},
    "whole_k+overlap": {"FUSED_LINEAR_WHOLE_K": True, "MULTI_ROW_ATTENTION_OVERLAP": True},
    "embedding_gather": {"GATHER_BY_INDEX": False},
}

#: The projections of a SmolLM2 layer as fused_linear's tile function sees them: (norm, swiglu, k, n).
ROLES = {"qkv_rope": (True, True, 576, 960), "o": (False, False, 576, 576), "gate_up": (True, True, 576, 1536),
         "down": (False, False, 1536, 576)}
#: Values tried per tile parameter (block_n of q/k/v + RoPE must divide head_dim / 2 = 32).
TILE_VALUES = {"block_n": (16, 32, 64), "block_k": (64, 128, 256), "num_warps": (1, 2, 4, 8),
               "num_stages": (2, 3, 4, 5)}


def build():
    model = smollm2_shaped_model()
    fast = model._hf_accel_engine
    ids16 = torch.randint(100, 49000, (16, PROMPT), device="cuda")
    with torch.inference_mode():  # the step buffers are inference tensors
        step16, _ = fast.start(ids16, torch.ones_like(ids16), 128, lookahead=17)
        step16.cache_lens[:16] = PROMPT
        ids = ids16[:1]
        verify = {}
        for q in (1, 2, 16):  # batch 1 on the first row's blocks (q 1: the one-row GEMV step)
            verify[q] = step_over_blocks(fast, step16, ids, q, PROMPT)
    return {"plain_q1": verify[1]._forward, "verify_q2": verify[2]._forward, "verify_q16": verify[16]._forward,
            "bs16_step": step16._forward}


def measure(fns: dict, reps: int = 2) -> dict:
    out = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            out[name] = [time_graph(fn)[0] for _ in range(reps)]
    return out


class tile_override:  # noqa: N801 (context manager)
    """fused_linear's ``_tiles`` with per-role overrides (``{role: {param: value}}``), in both modules that call it
    (the launchers in ``fused_linear`` and ``split_k_for`` in ``fused_linear_tiles``)."""

    def __init__(self, overrides: dict):
        import hf_accel.kernels.fused_linear as fl
        import hf_accel.kernels.fused_linear_tiles as fl_tiles

        self.modules, self.overrides, self.saved = (fl, fl_tiles), overrides, None

    def __enter__(self):
        saved = self.modules[1]._tiles
        self.saved = saved

        def tiles(rows, n, k, norm, swiglu, block_n, block_k, num_warps, num_stages, small_tiles=False):
            for role, key in ROLES.items():
                if (norm, swiglu, k) == key[:3] and (not swiglu or n == key[3]) and role in self.overrides:
                    o = self.overrides[role]
                    block_n = o.get("block_n", block_n)
                    block_k = o.get("block_k", block_k)
                    num_warps = o.get("num_warps", num_warps)
                    num_stages = o.get("num_stages", num_stages)
            return saved(rows, n, k, norm, swiglu, block_n, block_k, num_warps, num_stages, small_tiles)

        for module in self.modules:
            module._tiles = tiles
        return self

    def __exit__(self, *exc):
        for module in self.modules:
            module._tiles = self.saved
        return False


def run_tiles(fns, overrides, reps=2):
    """:func:`measure` with the tiles of ``overrides``; fused_linear_rope takes its block_n as an argument."""
    import functools

    import hf_accel.engine.decode_step as ds

    saved = ds.fused_linear_rope
    bn = overrides.get("qkv_rope", {}).get("block_n")
    if bn:
        ds.fused_linear_rope = functools.partial(saved, block_n=bn)
    try:
        with tile_override(overrides):
            return measure(fns, reps)
    finally:
        ds.fused_linear_rope = saved


def main(argv=None):
    from common import decode_step_overrides

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    names = args.variants.split(",")
    fns = build()
    rows, results = [], {n: {} for n in names}
    for r in range(args.rounds):
        for name in names:
            spec = "+".join(f"{k}={v!r}" for k, v in VARIANTS[name].items())
            with decode_step_overrides(spec):
                res = measure(fns)
            for m, v in res.items():
                results[name].setdefault(m, []).extend(v)
            print(f"round {r} {name:>30}: " + "  ".join(f"{m} {min(v):.4f}" for m, v in res.items()), flush=True)
    for name in names:
        for m, v in results[name].items():
            rows.append({"bench": "profile_verify_switches", "provider": "ours",
                         "shape": {"model": "smollm2-135m-shape", "dtype": "bfloat16", "prompt_len": PROMPT,
                                   "variant": name, "switches": VARIANTS[name]},
                         "metric": m, "unit": "ms", "value": v})
    print("-- medians over rounds (ms)")
    for name in names:
        print(f"{name:>30}: " + "  ".join(f"{m} {statistics.median(v):.4f}" for m, v in results[name].items()))
    if args.sweep:
        best = min(names, key=lambda n: statistics.mean(results[n]["verify_q16"]))
        spec = "+".join(f"{k}={v!r}" for k, v in VARIANTS[best].items())
        print(f"-- tile sweep on {best}")
        with decode_step_overrides(spec):
            base = measure(fns, 3)
            cur = {m: statistics.median(v) for m, v in base.items()}
            chosen: dict = {}
            for role in ROLES:
                for param, values in TILE_VALUES.items():
                    if role == "qkv_rope" and param == "block_n":
                        values = (16, 32)
                    for value in values:
                        trial = {k: dict(v) for k, v in chosen.items()}
                        trial.setdefault(role, {})[param] = value
                        try:
                            res = run_tiles(fns, trial)
                        except Exception as e:  # noqa: BLE001 (a tile the kernel cannot compile: skipped)
                            print(f"{role} {param}={value}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                            continue
                        med = {m: statistics.median(v) for m, v in res.items()}
                        rows.append({"bench": "profile_verify_switches", "provider": "ours",
                                     "shape": {"model": "smollm2-135m-shape", "dtype": "bfloat16",
                                               "prompt_len": PROMPT, "variant": best, "tiles": trial},
                                     "metric": "sweep", "unit": "ms", "value": med})
                        better = med["verify_q16"] < cur["verify_q16"] * 0.99 and med["bs16_step"] < cur["bs16_step"]
                        print(f"{role} {param}={value}: " + "  ".join(f"{m} {x:.4f}" for m, x in med.items())
                              + ("  kept" if better else ""), flush=True)
                        if better:
                            chosen, cur = trial, med
            final = run_tiles(fns, chosen, reps=3)
            print(f"-- chosen tiles {chosen}: " + "  ".join(f"{m} {statistics.median(v):.4f}" for m, v in final.items())
                  + "; base " + "  ".join(f"{m} {statistics.median(v):.4f}" for m, v in base.items()))
            for label, res, tiles in (("sweep_base", base, {}), ("sweep_final", final, chosen)):
                for m, v in res.items():
                    rows.append({"bench": "profile_verify_switches", "provider": "ours",
                                 "shape": {"model": "smollm2-135m-shape", "dtype": "bfloat16", "prompt_len": PROMPT,
                                           "variant": best, "tiles": tiles, "label": label},
                                 "metric": m, "unit": "ms", "value": v})
    write_results("profile_verify_switches", rows)


if __name__ == "__main__":
    main()
