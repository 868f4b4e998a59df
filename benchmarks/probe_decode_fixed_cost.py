"""Where the batch-1 decode attention loses time against a plain read: fixed cost vs streaming rate.

One query token, GQA 32/8, head_dim 128, bf16, block_size 16, a scattered block table, 32 KV splits at every
length. For KV lengths S = 4k .. 64k each reader is timed as ``bench_decode.py`` times it (10 back-to-back
calls in one CUDA graph, median replay / 10), and a line ``time = fixed + S * per_token`` is fitted per
reader (least squares over the lengths whose K+V bytes exceed the L2: the graph's next call re-reads shorter
ones partly from L2). Readers:

- ``read-only``: ``bench_decode``'s reference kernel (loads the same K/V through the block table, sums it);
- ``ours``: ``paged_attention`` with its defaults (attention kernel + split-merge kernel; the merge kernel on 1 warp
  and, on Hopper, launched with PDL as the attention programs start);
- ``ours-attention-only``: the attention kernel alone (the merge launch replaced by nothing; its output is
  not the attention, only its time is used);
- ``ours-fused-merge``: the splits merged inside the attention kernel (``merge_counters``);
- ``ours-merge-4-warps``: the merge kernel on 4 warps (``MERGE_WARPS`` 4; the default, None, gives the fewest
  warps that hold its tile: 1 here), still with the PDL launch;
- ``ours-merge-no-pdl``: the merge kernel launched after the attention kernel (``MERGE_PDL_TRIGGER`` None), on 1 warp;
  ``ours-merge-pdl-after-keys``: launched once the attention programs' K/V are in; ``ours-merge-4-warps-no-pdl``:
  neither (the defaults before 2026-12-07);
- ``merge-only-<w>-warps``: the split-merge kernel alone (32 splits x 32 heads) with w warps per program
  (the launcher's default is 4).

``--baseline FILE`` (repeatable) times ``ours`` and ``ours-attention-only`` of another version of
``paged_attention.py`` too (prefix: the file's stem and ``-``).

Equal per-token costs and different fixed costs put the gap in the prologue / epilogue / merge; a larger
per-token cost puts it in the tile loop. Writes ``probe_decode_fixed_cost-<date>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import bench_decode  # noqa: E402
import hf_accel.kernels.paged_attention as pa  # noqa: E402

H, H_KV, D, BLOCK = 32, 8, 128, 16
SPLITS = 32
LENGTHS = (4096, 8192, 16384, 32768, 65536)
#: (name, paged_attention kwargs or "fused", module constants set for the call); a baseline module runs the
#: first only
VARIANTS = [
    ("ours", {}, {}),
    ("ours-fused-merge", "fused", {}),
    ("ours-merge-4-warps", {}, {"MERGE_WARPS": 4}),
    ("ours-merge-no-pdl", {}, {"MERGE_PDL_TRIGGER": None}),
    ("ours-merge-pdl-after-keys", {}, {"MERGE_PDL_TRIGGER": "after_keys"}),
    ("ours-merge-4-warps-no-pdl", {}, {"MERGE_WARPS": 4, "MERGE_PDL_TRIGGER": None}),
]


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def fit(xs, ys):
    """Least-squares ``y = a + b x``: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _load_baseline(path):
    """``paged_attention`` of another version of the module (a file), for an A/B in the same process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("paged_attention_" + Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--baseline", action="append", default=[],
                    help="a paged_attention.py of another version, timed as '<stem>-*' (repeatable)")
    ap.add_argument("--lengths", default=None, help="only these KV lengths, e.g. '32768' (no fit below 2 lengths)")
    args = ap.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else LENGTHS
    require_cuda(__file__)
    time_ms = bench_decode._timer(eager=False)
    rows, times = [], {}
    modules = [("", pa)] + [(Path(path).stem + "-", _load_baseline(path)) for path in args.baseline]
    if len({prefix for prefix, _ in modules}) != len(modules):
        ap.error("--baseline files need different stems")
    for S in lengths:
        k_cache, v_cache, table, seq_lens, q = bench_decode.b1_case(S, seed=S)
        k, v = bench_decode.contiguous_kv(k_cache, v_cache, table, S)
        ref = bench_decode.sdpa_reference(q, k, v)
        counters = torch.zeros(H_KV, dtype=torch.int32, device="cuda")
        kw = dict(num_splits=SPLITS, check_blocks=False)
        for prefix, mod in modules:
            for name, extra, overrides in VARIANTS if not prefix else VARIANTS[:1]:
                if any(not hasattr(mod, attr) for attr in overrides):
                    continue
                saved = {attr: getattr(mod, attr) for attr in overrides}
                for attr, value in overrides.items():
                    setattr(mod, attr, value)
                extra = {"merge_counters": counters} if extra == "fused" else extra
                try:
                    out = mod.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw, **extra)
                    err = (out.float() - ref).abs().max().item()
                    assert err < 2e-2, f"{prefix}{name} S{S} error {err}"
                    assert int(counters.abs().sum()) == 0
                    times[prefix + name, S] = time_ms(
                        lambda: mod.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw, **extra))
                finally:
                    for attr, value in saved.items():
                        setattr(mod, attr, value)
            merge_kernel = mod._merge_splits_kernel
            mod._merge_splits_kernel = _NoLaunch()
            try:
                times[prefix + "ours-attention-only", S] = time_ms(
                    lambda: mod.paged_attention(q, k_cache, v_cache, table, seq_lens, S, **kw))
            finally:
                mod._merge_splits_kernel = merge_kernel
        best = bench_decode.read_ceiling(k_cache, v_cache, table, k, v, S, time_ms, (SPLITS,))
        times["read-only", S] = best["paged"][2]
        if S == 32768:
            part_out = torch.randn(SPLITS, H, D, device="cuda")
            part_lse = torch.randn(SPLITS, H, device="cuda")
            target = torch.empty(H, D, device="cuda", dtype=torch.bfloat16)
            for warps in (1, 2, 4, 8):
                times[f"merge-only-{warps}-warps", S] = time_ms(lambda: pa._merge_splits_kernel[(H,)](
                    part_out, part_lse, target, part_out.stride(0), D, part_lse.stride(0), target.stride(0),
                    SPLITS, D, BLOCK_S=SPLITS, BLOCK_D=D, PDL=False, num_warps=warps))
        k_cache = v_cache = k = v = None
        torch.cuda.empty_cache()

    for (name, S), ms in sorted(times.items()):
        nbytes = 2 * S * H_KV * D * 2
        rows.append({"bench": "probe_decode_fixed_cost", "provider": name,
                     "shape": {"B": 1, "H": H, "H_kv": H_KV, "S": S, "D": D, "block_size": BLOCK, "splits": SPLITS,
                               "dtype": "bfloat16"},
                     "metric": "latency", "unit": "us", "value": ms * 1e3})
        print(f"{name:30} S{S:<6} {ms * 1e3:8.2f} us {nbytes / (ms * 1e-3) / 1e12:6.2f} TB/s")
    print(f"\n{'reader':30} {'fixed us':>9} {'ns/1k tokens':>13} {'streaming TB/s':>15}")
    # lengths whose K/V exceed the L2 (shorter ones are partly re-read from L2 by the graph's next call)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    fit_lengths = [S for S in lengths if 2 * S * H_KV * D * 2 > l2]
    timed_at_all = {name for name, _ in times if all((name, S) in times for S in fit_lengths)}
    names = sorted(timed_at_all) if len(fit_lengths) > 1 else []
    for name in names:
        a, b = fit(fit_lengths, [times[name, S] * 1e3 for S in fit_lengths])
        stream = 2 * H_KV * D * 2 / (b * 1e-6) / 1e12  # bytes per token / seconds per token
        rows.append({"bench": "probe_decode_fixed_cost", "provider": name, "shape": {"fit": fit_lengths},
                     "metric": "fixed_us", "unit": "us", "value": a})
        rows.append({"bench": "probe_decode_fixed_cost", "provider": name, "shape": {"fit": fit_lengths},
                     "metric": "streaming_bandwidth", "unit": "TB/s", "value": stream})
        print(f"{name:30} {a:9.2f} {b * 1e6:13.1f} {stream:15.2f}")
    write_results("probe_decode_fixed_cost", rows, {"timing": "cuda_graph", "splits": SPLITS,
                                                    "baseline": args.baseline})


if __name__ == "__main__":
    main()
