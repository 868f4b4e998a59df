"""What the batch-1 decode attention kernel's softmax costs: the kernel timed with and without it.

``--module`` is a version of ``paged_attention.py`` with a module constant ``NO_SOFTMAX``: True makes the chunked
tile loop keep its K/V loads and both MMAs (``q @ k``, then the scores, cast, ``@ v``) but drop the masks, the
running max, ``exp2`` and the sums, with their cross-warp reductions. That output is wrong and is not checked;
with ``NO_SOFTMAX`` False the module is checked against float32 SDPA. Each reader is the attention kernel alone
(the split-merge launch replaced by nothing), timed as ``bench_decode.py`` times (10 calls in one CUDA graph),
against the read-only reference on the same grid.

One query token, GQA 32/8, head_dim 128, bf16, block_size 16, a scattered block table, 32 KV splits (``--splits``
takes a list: 16 gives one program per SM on a 132-SM GPU, 32 two). Writes ``probe_decode_ablation-<date>.json``.

    python benchmarks/probe_decode_ablation.py --module benchmarks/variants/pa_ablate.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import bench_decode  # noqa: E402
from probe_decode_fixed_cost import _load_baseline, _NoLaunch  # noqa: E402


def _time_splits(mod, time_ms, S, splits, k_cache, v_cache, table, seq_lens, q, k, v, ref):
    """Rows of the three readers at ``S`` keys and ``splits`` KV splits."""
    out = []
    kw = dict(num_splits=splits, check_blocks=False)
    err = (mod.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw).float() - ref).abs().max().item()
    assert err < 2e-2, f"S{S} {splits} splits: error {err}"
    shape = {"B": 1, "H": bench_decode.H, "H_kv": bench_decode.H_KV, "S": S, "D": bench_decode.D,
             "block_size": bench_decode.BLOCK, "splits": splits, "dtype": "bfloat16"}
    merge_kernel = mod._merge_splits_kernel
    mod._merge_splits_kernel = _NoLaunch()
    try:
        for name, no_softmax in (("attention-only", False), ("attention-only-no-softmax", True)):
            mod.NO_SOFTMAX = no_softmax
            us = time_ms(lambda: mod.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw)) * 1e3
            out.append({"bench": "probe_decode_ablation", "provider": name, "shape": shape,
                        "metric": "latency", "unit": "us", "value": us})
            print(f"S{S:<6} {splits:3} splits {name:28} {us:8.2f} us", flush=True)
    finally:
        mod._merge_splits_kernel = merge_kernel
        mod.NO_SOFTMAX = False
    best = bench_decode.read_ceiling(k_cache, v_cache, table, k, v, S, time_ms, (splits,))["paged"]
    out.append({"bench": "probe_decode_ablation", "provider": "read-only", "shape": shape,
                "metric": "latency", "unit": "us", "value": best[2] * 1e3})
    print(f"S{S:<6} {splits:3} splits {'read-only':28} {best[2] * 1e3:8.2f} us")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--module", required=True, help="a paged_attention.py with a NO_SOFTMAX constant")
    ap.add_argument("--lengths", default="32768,65536", help="KV lengths")
    ap.add_argument("--splits", default="32", help="KV split counts, comma-separated")
    args = ap.parse_args()
    require_cuda(__file__)
    mod = _load_baseline(args.module)
    time_ms = bench_decode._timer(eager=False)
    rows = []
    for S in (int(x) for x in args.lengths.split(",")):
        k_cache, v_cache, table, seq_lens, q = bench_decode.b1_case(S, seed=S)
        k, v = bench_decode.contiguous_kv(k_cache, v_cache, table, S)
        ref = bench_decode.sdpa_reference(q, k, v)
        for splits in (int(x) for x in args.splits.split(",")):
            rows += _time_splits(mod, time_ms, S, splits, k_cache, v_cache, table, seq_lens, q, k, v, ref)
        k_cache = v_cache = k = v = None
        torch.cuda.empty_cache()
    write_results("probe_decode_ablation", rows, {"timing": "cuda_graph", "module": args.module})


if __name__ == "__main__":
    main()
