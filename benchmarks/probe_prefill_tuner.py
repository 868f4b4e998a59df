"""Does the prefill tuner's choice change the numbers, and does it change between processes? (CUDA, bf16)

For attention shapes of the fast path's bucketed prompt prefill (SmolLM2: 9 / 3 heads, head_dim 64; the
Llama-3-8B shape: 32 / 8, 128), causal, batch 1, this runs
:func:`~hf_accel.kernels.prefill.prefill_attention` with every candidate of
:func:`~hf_accel.kernels.prefill_tuning.candidate_configs` on the same random inputs and reports, per
candidate, the largest difference from the first candidate's output (0 = bitwise the same), then lets the
tuner choose (``tuned_configs``). Run it in several processes to see whether the choice moves: a choice
between candidates whose outputs differ makes bf16 greedy outputs depend on timing noise.

    python benchmarks/probe_prefill_tuner.py [--q-lens 48,256,384] [--label run1]

Writes ``probe_prefill_tuner-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

from hf_accel.kernels.prefill import prefill_attention  # noqa: E402
from hf_accel.kernels.prefill_tuning import bucket, candidate_configs, tuned_configs  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b-shape": (32, 8, 128)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--q-lens", default="48,256,384")
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    rows = []
    for model, (h, hkv, d) in SHAPES.items():
        for q_len in (int(v) for v in args.q_lens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(q_len + d)
            q = torch.randn(1, h, q_len, d, device="cuda", generator=g).bfloat16()
            k = torch.randn(1, hkv, q_len, d, device="cuda", generator=g).bfloat16()
            v = torch.randn(1, hkv, q_len, d, device="cuda", generator=g).bfloat16()
            first = None
            shape = {"model": model, "H": h, "H_kv": hkv, "D": d, "L": q_len, "S": q_len, "causal": True,
                     "label": args.label}
            for cfg in candidate_configs(d, bucket(q_len), torch.bfloat16):
                try:
                    out = prefill_attention(q, k, v, config=cfg).float()
                except Exception as e:  # noqa: BLE001 - a tile shape that does not compile here
                    print(f"{model} L{q_len} {cfg.short()}: {type(e).__name__}")
                    continue
                first = out if first is None else first
                diff = (out - first).abs().max().item()
                print(f"{model} L{q_len} {cfg.short():24} max |out - first candidate's| = {diff:.3g}")
                rows.append({"bench": "probe_prefill_tuner", "provider": cfg.short(), "shape": shape,
                             "metric": "max_abs_diff_vs_first_candidate", "unit": "bf16 value", "value": diff})
            prefill_attention(q, k, v)  # the tuner chooses for this key
    for key, cfg in tuned_configs().items():
        print(f"tuned {key}: {cfg.short()}")
        rows.append({"bench": "probe_prefill_tuner", "provider": "tuner", "metric": "chosen",
                     "shape": {"D": key[0], "L_bucket": key[5], "S_bucket": key[6], "label": args.label},
                     "unit": "config", "value": cfg.short()})
    write_results("probe_prefill_tuner", rows)


if __name__ == "__main__":
    main()
