"""Batch-1 decode attention with extra small "tail" splits that the block scheduler hands to SMs as they free up.

The per-program timeline (``probe_decode_timeline.py``) shows the attention kernel's 256 programs at B1 S32k, all
with the same number of keys, ending over a 10 µs spread: the call waits for the slowest. Here ``--module`` (a
version of ``paged_attention.py`` with ``TAIL_SPLITS`` / ``TAIL_TOKENS``) carves ``TAIL_SPLITS`` splits of
``TAIL_TOKENS`` keys from the end of each sequence's keys; the main splits share the rest. The tail programs come
last in launch order, so those not resident at once start on the SMs whose programs finish first. ``stages`` 4
(~100 KB of shared memory per program) leaves room for 2 programs per SM instead of 3.

One query token, GQA 32/8, head_dim 128, bf16, block_size 16, a scattered block table, 32 main splits; each
configuration checked against float32 SDPA and timed as ``bench_decode.py`` times (10 calls in one CUDA graph,
median replay / 10). Writes ``probe_decode_tail_splits-<date>.json``.

    python benchmarks/probe_decode_tail_splits.py --module benchmarks/variants/pa_tail.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import bench_decode  # noqa: E402
import hf_accel.kernels.paged_attention as pa  # noqa: E402
from probe_decode_fixed_cost import _load_baseline  # noqa: E402

SPLITS = 32
#: (tail splits, tail tokens, pipeline stages)
CONFIGS = [(0, 0, 3), (32, 128, 3), (64, 64, 3), (64, 128, 3), (128, 64, 3), (32, 256, 3), (96, 128, 3),
           (0, 0, 4), (64, 64, 4), (64, 128, 4), (128, 64, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--module", required=True, help="a paged_attention.py with TAIL_SPLITS and TAIL_TOKENS")
    ap.add_argument("--lengths", default="32768", help="KV lengths, e.g. '16384,32768,65536'")
    args = ap.parse_args()
    require_cuda(__file__)
    mod = _load_baseline(args.module)
    time_ms = bench_decode._timer(eager=False)
    rows = []
    for S in (int(x) for x in args.lengths.split(",")):
        k_cache, v_cache, table, seq_lens, q = bench_decode.b1_case(S, seed=S)
        k, v = bench_decode.contiguous_kv(k_cache, v_cache, table, S)
        ref = bench_decode.sdpa_reference(q, k, v)
        nbytes = 2 * S * bench_decode.H_KV * bench_decode.D * 2
        shape = {"B": 1, "H": bench_decode.H, "H_kv": bench_decode.H_KV, "S": S, "D": bench_decode.D,
                 "block_size": bench_decode.BLOCK, "splits": SPLITS, "dtype": "bfloat16"}
        runs = [("current", pa, None)] + [(f"tail{n}x{t}-stages{st}", mod, (n, t, st)) for n, t, st in CONFIGS]
        for name, module, cfg in runs:
            kw = dict(num_splits=SPLITS, check_blocks=False)
            if cfg:
                module.TAIL_SPLITS, module.TAIL_TOKENS = cfg[0], cfg[1] or 128
                kw["num_stages"] = cfg[2]
            try:
                out = module.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw)
                err = (out.float() - ref).abs().max().item()
                assert err < 2e-2, f"{name} S{S} error {err}"
                ms = time_ms(lambda: module.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw))
            finally:
                if cfg:
                    module.TAIL_SPLITS = 0
            tbs = nbytes / (ms * 1e-3) / 1e12
            print(f"S{S:<6} {name:24} {ms * 1e3:8.2f} us {tbs:6.2f} TB/s", flush=True)
            for metric, unit, value in (("latency", "us", ms * 1e3), ("kv_bandwidth", "TB/s", tbs)):
                rows.append({"bench": "probe_decode_tail_splits", "provider": name, "shape": shape,
                             "metric": metric, "unit": unit, "value": value})
        best = bench_decode.read_ceiling(k_cache, v_cache, table, k, v, S, time_ms, (SPLITS,))["paged"]
        print(f"S{S:<6} {'read-only':24} {best[2] * 1e3:8.2f} us {best[0]:6.2f} TB/s")
        rows.append({"bench": "probe_decode_tail_splits", "provider": "read-only", "shape": shape,
                     "metric": "kv_bandwidth", "unit": "TB/s", "value": best[0]})
        k_cache = v_cache = k = v = None
        torch.cuda.empty_cache()
    write_results("probe_decode_tail_splits", rows, {"timing": "cuda_graph", "module": args.module})


if __name__ == "__main__":
    main()
