"""Decode-time matmuls of a llama layer: hf-accel's fused norm/linear/SwiGLU kernel vs RMSNorm + cuBLAS + SwiGLU.

Shapes: the SmolLM2-135M layer (hidden 576, 9/3 heads of 64, intermediate 1536, vocab 49152) and the
Llama-3-8B layer (4096, 32/8 heads of 128, 14336, vocab 128256), bf16, 1 / 8 / 16 / 32 token rows.

Timing is what a captured decode step sees: each measurement is one CUDA graph that runs the kernel(s) over
``copies`` distinct weight sets back to back (30 for SmolLM2 — its real layer count —, 2-4 for 8B so the
weights do not sit in the 50 MB L2), replayed with ``triton.testing.do_bench`` (median); the reported time is
per weight set. Rows:

* ``sweep``: one matmul kind (qkv with norm prologue, o, gate/up with norm + SwiGLU, down, lm_head with
  norm and a float32 output) per tiling config: us and weight TB/s;
* ``layer``: the four matmuls of a layer plus its norms and SwiGLU, old sequence (``rms_norm`` ->
  ``F.linear`` -> ... -> ``swiglu`` -> ``F.linear``, 7 kernels) vs fused (4 kernels, default tiles and the
  best tiles of the sweep);
* ``fused-small-tiles``: in both, the kernel's ``small_tiles=True`` (A/B).

``--pdl`` launches every fused call with programmatic dependent launch, as the decode step does (the
kernels of one graph then overlap as they do there); ``--grid 'N,..:K,..:WARPS,..:STAGES,..'`` sets the
sweep's grid.

* ``split`` (``--split``): default tiles, launched with / without PDL, split-K in 1-6 shares per output
  tile (the last program to arrive reduces; arrival counters shared by the calls) and with / without the
  weight preload before the PDL wait; per kind and for the whole layer.

* ``whole-k`` (``--whole-k``): with PDL, the K-loop kernel (default tiles) vs its whole-K path (``whole_k``:
  all weight columns of a program loaded before the PDL wait) at several output tiles / warps, and at one
  row the GEMV of the batch-1 step; per kind and for the whole layer.

    python benchmarks/bench_fused_linear.py [--quick | --split | --whole-k]
    python benchmarks/bench_fused_linear.py --pdl --models smollm2-135m --rows 2,16 --grid 16,32:64,128,256:1,2,4:2,3
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_replay_us, require_cuda, write_results  # noqa: E402

from hf_accel.kernels.fused_linear import fused_linear  # noqa: E402
from hf_accel.kernels.rms_norm import rms_norm  # noqa: E402
from hf_accel.kernels.swiglu import swiglu  # noqa: E402

MODELS = {
    "smollm2-135m": dict(hidden=576, q=576, kv=192, inter=1536, vocab=49152, copies=30),
    "llama3-8b": dict(hidden=4096, q=4096, kv=1024, inter=14336, vocab=128256, copies=2),
}


def _weights(cfg, copies):
    h = cfg["hidden"]
    dt = torch.bfloat16
    mk = lambda o, i: (torch.randn(o, i, device="cuda") / i**0.5).to(dt)  # noqa: E731
    return [dict(qkv=mk(cfg["q"] + 2 * cfg["kv"], h), o=mk(h, cfg["q"]), gate_up=mk(2 * cfg["inter"], h),
                 down=mk(h, cfg["inter"]), n1=(1 + 0.1 * torch.randn(h, device="cuda")).to(dt),
                 n2=(1 + 0.1 * torch.randn(h, device="cuda")).to(dt)) for _ in range(copies)]


def _lm_head(cfg):
    """LM head weight [vocab, hidden] and a final-norm weight of ones, bf16."""
    w = (torch.randn(cfg["vocab"], cfg["hidden"], device="cuda") / cfg["hidden"]**0.5).to(torch.bfloat16)
    return dict(w=w, n=torch.ones(cfg["hidden"], device="cuda", dtype=torch.bfloat16))


def _kinds(cfg, rows, ws, lm):
    """(name, weight bytes, fused call(w, tiles), old call(w)) per matmul kind."""
    h = cfg["hidden"]
    dt = torch.bfloat16
    x = torch.randn(rows, h, device="cuda", dtype=dt)
    r = torch.randn(rows, h, device="cuda", dtype=dt)
    o_in = torch.randn(rows, cfg["q"], device="cuda", dtype=dt)
    a_in = torch.randn(rows, cfg["inter"], device="cuda", dtype=dt)
    return [
        ("qkv_norm", lambda w, t: fused_linear(x, w["qkv"], norm_weight=w["n1"], residual=r, **t),
         lambda w: torch.nn.functional.linear(rms_norm(x, w["n1"], 1e-5, r)[0], w["qkv"]), "qkv"),
        ("o", lambda w, t: fused_linear(o_in, w["o"], **t), lambda w: torch.nn.functional.linear(o_in, w["o"]), "o"),
        ("gate_up_norm_swiglu",
         lambda w, t: fused_linear(x, w["gate_up"], norm_weight=w["n2"], residual=r, swiglu=True, **t),
         lambda w: (lambda gu: swiglu(gu[:, : cfg["inter"]], gu[:, cfg["inter"]:]))(
             torch.nn.functional.linear(rms_norm(x, w["n2"], 1e-5, r)[0], w["gate_up"])), "gate_up"),
        ("down", lambda w, t: fused_linear(a_in, w["down"], **t), lambda w: torch.nn.functional.linear(a_in, w["down"]),
         "down"),
        ("lm_head_norm_f32",
         lambda w, t: fused_linear(x, lm["w"], norm_weight=lm["n"], residual=r, out_dtype=torch.float32, **t),
         lambda w: torch.nn.functional.linear(rms_norm(x, lm["n"], 1e-5, r)[0], lm["w"]).float(), "lm"),
    ]


#: fused_linear's small-layer tiles (off by default): the A/B of a sweep.
SMALL_TILES = {"small_tiles": True}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 tiling configs")
    ap.add_argument("--full", action="store_true", help="36 tiling configs")
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--split", action="store_true", help="split-K / PDL / preload variants at default tiles")
    ap.add_argument("--pdl", action="store_true", help="launch every fused call with PDL, as the decode step does")
    ap.add_argument("--grid", default=None, help="tiling grid 'BLOCK_N,..:BLOCK_K,..:WARPS,..:STAGES,..'")
    ap.add_argument("--whole-k", action="store_true", help="K loop vs whole-K path (and the GEMV at one row)")
    ap.add_argument("--variants", default=None, help="--whole-k: comma list of WHOLE_K_VARIANTS names (default all)")
    args = ap.parse_args()
    require_cuda(__file__)
    if args.split:
        return split_main(args)
    if args.whole_k:
        return whole_k_main(args)
    if args.grid:
        grid = list(itertools.product(*[[int(v) for v in part.split(",")] for part in args.grid.split(":")]))
    elif args.quick:
        grid = list(itertools.product([16, 32], [128, 256], [4], [4]))
    elif args.full:
        grid = list(itertools.product([16, 32, 64], [64, 128, 256], [4, 8], [3, 5]))
    else:
        grid = list(itertools.product([16, 32, 64], [128, 256], [4], [3, 5]))
    results = []
    summary = []
    for model in args.models.split(","):
        cfg = MODELS[model]
        ws, lm = _weights(cfg, cfg["copies"]), _lm_head(cfg)
        for rows in [int(v) for v in args.rows.split(",")]:
            shape = dict(model=model, rows=rows, dtype="bfloat16")
            best = {}
            for name, fused, old, wkey in _kinds(cfg, rows, ws, lm):
                sets = [ws[0]] if wkey == "lm" else ws
                nbytes = (lm["w"] if wkey == "lm" else ws[0][wkey]).numel() * 2
                # correctness of the fused call (default tiles) against the reference sequence
                base = {"pdl": True} if args.pdl else {}
                got = fused(sets[0], base)
                got = got[0] if isinstance(got, tuple) else got
                ref = old(sets[0]).to(got.dtype)
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
                t_old = graph_replay_us(lambda: [old(w) for w in sets], len(sets))
                t_def = graph_replay_us(lambda: [fused(w, base) for w in sets], len(sets))
                small = {**base, **SMALL_TILES}
                t_small = graph_replay_us(lambda: [fused(w, small) for w in sets], len(sets))
                results += [dict(bench="fused_linear", provider="fused-small-tiles",
                                 shape={**shape, "kind": name}, metric="latency", unit="us", value=t_small),
                            dict(bench="fused_linear", provider="old", shape={**shape, "kind": name}, metric="latency",
                                 unit="us", value=t_old),
                            dict(bench="fused_linear", provider="fused-default", shape={**shape, "kind": name},
                                 metric="latency", unit="us", value=t_def, rel_err=err)]
                cand = []
                for bn, bk, nw, ns in grid:
                    tiles = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, **base)
                    try:
                        t = graph_replay_us(lambda: [fused(w, tiles) for w in sets], len(sets))
                    except Exception as e:  # noqa: BLE001 (out of shared memory etc.: record and go on)
                        results.append(dict(bench="fused_linear", provider="fused-sweep",
                                            shape={**shape, "kind": name, "config": f"n{bn}k{bk}w{nw}s{ns}"},
                                            metric="error", unit="text", value=type(e).__name__))
                        continue
                    cand.append((t, f"n{bn}k{bk}w{nw}s{ns}", tiles))
                    results.append(dict(bench="fused_linear", provider="fused-sweep",
                                        shape={**shape, "kind": name, "config": f"n{bn}k{bk}w{nw}s{ns}"},
                                        metric="latency", unit="us", value=t))
                t_best, c_best, tiles_best = min(cand)
                best[name] = tiles_best
                results.append(dict(bench="fused_linear", provider="fused-best", shape={**shape, "kind": name,
                                    "config": c_best}, metric="latency", unit="us", value=t_best))
                summary.append(f"{model:14s} rows {rows:3d} {name:20s} old {t_old:8.2f} us  fused-default {t_def:8.2f} "
                               f"small-tiles {t_small:8.2f} "
                               f"best {t_best:8.2f} ({c_best}, {nbytes / t_best / 1e6:.2f} TB/s)  err {err:.1e}")
                print(summary[-1], flush=True)
            # whole layer (4 matmuls + norms + SwiGLU): old vs fused default vs fused best tiles
            kinds = _kinds(cfg, rows, ws, lm)[:4]
            base = {"pdl": True} if args.pdl else {}
            small = {**base, **SMALL_TILES}
            t_old = graph_replay_us(lambda: [k[2](w) for w in ws for k in kinds], len(ws))
            t_def = graph_replay_us(lambda: [k[1](w, base) for w in ws for k in kinds], len(ws))
            t_small = graph_replay_us(lambda: [k[1](w, small) for w in ws for k in kinds], len(ws))
            t_best = graph_replay_us(lambda: [k[1](w, best[k[0]]) for w in ws for k in kinds], len(ws))
            for prov, t in (("old", t_old), ("fused-default", t_def), ("fused-small-tiles", t_small),
                            ("fused-best", t_best)):
                results.append(dict(bench="fused_linear", provider=prov, shape={**shape, "kind": "layer"},
                                    metric="latency", unit="us", value=t))
            summary.append(f"{model:14s} rows {rows:3d} LAYER old {t_old:8.2f} us  fused-default {t_def:8.2f}  "
                           f"small-tiles {t_small:8.2f}  "
                           f"fused-best {t_best:8.2f}")
            print(summary[-1], flush=True)
    write_results("bench_fused_linear", results)
    print("\n".join(summary))


def split_main(args):
    from hf_accel.kernels.fused_linear_tiles import split_k_for

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    variants = [("plain", dict()), ("pdl", dict(pdl=True)), ("pdl-preload", dict(pdl=True, preload=True))]
    for sk in (2, 3, 6):
        variants.append((f"pdl-split{sk}", dict(pdl=True, split_k=sk, counters=counters)))
    variants.append(("pdl-split-auto", dict(pdl=True, split_k="auto", counters=counters)))
    variants.append(("pdl-split-auto2", dict(pdl=True, split_k="auto2", counters=counters)))
    results, summary = [], []
    for model in args.models.split(","):
        cfg = MODELS[model]
        ws, lm = _weights(cfg, cfg["copies"]), _lm_head(cfg)
        for rows in [int(v) for v in args.rows.split(",")]:
            shape = dict(model=model, rows=rows, dtype="bfloat16")
            kinds = _kinds(cfg, rows, ws, lm)

            def opts(kind, w, v):
                v = dict(v)
                if v.get("split_k") in ("auto", "auto2"):
                    wt = lm["w"] if kind[3] == "lm" else w[kind[3]]
                    n = wt.shape[0] // (2 if kind[0].startswith("gate_up") else 1)
                    v["split_k"] = split_k_for(n, wt.shape[1], (1 if v["split_k"] == "auto" else 2) * sms, rows)
                return v

            for name, v in variants:
                line = f"{model:14s} rows {rows:3d} {name:16s}"
                for kind in kinds:
                    sets = [ws[0]] if kind[3] == "lm" else ws
                    ref = kind[2](sets[0])
                    got = kind[1](sets[0], opts(kind, sets[0], v))
                    got = got[0] if isinstance(got, tuple) else got
                    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    t = graph_replay_us(lambda: [kind[1](w, opts(kind, w, v)) for w in sets], len(sets))
                    results.append(dict(bench="fused_linear", provider=f"split-{name}",
                                        shape={**shape, "kind": kind[0]}, metric="latency", unit="us", value=t,
                                        rel_err=err))
                    line += f" {kind[0][:7]} {t:6.2f}"
                t = graph_replay_us(lambda: [k[1](w, opts(k, w, v)) for w in ws for k in kinds[:4]], len(ws))
                results.append(dict(bench="fused_linear", provider=f"split-{name}", shape={**shape, "kind": "layer"},
                                    metric="latency", unit="us", value=t))
                line += f"  LAYER {t:6.2f}"
                summary.append(line)
                print(line, flush=True)
    write_results("bench_fused_linear-split", results)
    print("\n".join(summary))


#: Whole-K variants of ``--whole-k``: (name, fused_linear options).
WHOLE_K_VARIANTS = [("loop", {}), ("whole-n16-w2", dict(whole_k=True, num_warps=2)),
                    ("whole-n16-w4", dict(whole_k=True, num_warps=4)), ("whole-n16-w8", dict(whole_k=True, num_warps=8)),
                    ("whole-n16", dict(whole_k=True)), ("whole-n32-w4", dict(whole_k=True, block_n=32, num_warps=4)),
                    ("whole-n64-w4", dict(whole_k=True, block_n=64, num_warps=4)),
                    ("whole-n32-w2", dict(whole_k=True, block_n=32, num_warps=2)),
                    ("whole-n32-w8", dict(whole_k=True, block_n=32, num_warps=8)),
                    ("whole-n64-w8", dict(whole_k=True, block_n=64, num_warps=8)),
                    ("whole-n16-w1", dict(whole_k=True, block_n=16, num_warps=1)),
                    ("whole-n128-w8", dict(whole_k=True, block_n=128, num_warps=8))]


def _gemv_kind(kind, w, lm, x, r, o_in, a_in):
    """The one-row GEMV call of a ``_kinds`` entry (as the batch-1 step makes it, with PDL)."""
    from hf_accel.kernels.gemv import gemv

    name = kind[0]
    if name == "qkv_norm":
        return gemv(x, w["qkv"], norm_weight=w["n1"], residual=r, pdl=True)
    if name == "o":
        return gemv(o_in, w["o"], pdl=True)
    if name == "gate_up_norm_swiglu":
        return gemv(x, w["gate_up"], norm_weight=w["n2"], residual=r, swiglu=True, pdl=True)
    if name == "down":
        return gemv(a_in, w["down"], pdl=True)
    return gemv(x, lm["w"], norm_weight=lm["n"], residual=r, out_dtype=torch.float32, pdl=True)


def whole_k_main(args):
    results, summary = [], []
    models = args.models.split(",") if args.models != ",".join(MODELS) else ["smollm2-135m"]
    rows_list = [int(v) for v in args.rows.split(",")] if args.rows != "1,8,16,32" else [1, 2, 4, 8, 16]
    for model in models:
        cfg = MODELS[model]
        ws, lm = _weights(cfg, cfg["copies"]), _lm_head(cfg)
        for rows in rows_list:
            shape = dict(model=model, rows=rows, dtype="bfloat16")
            kinds = _kinds(cfg, rows, ws, lm)
            g_in = None
            if rows == 1:
                torch.manual_seed(0)
                h = cfg["hidden"]
                g_in = (torch.randn(1, h, device="cuda", dtype=torch.bfloat16),
                        torch.randn(1, h, device="cuda", dtype=torch.bfloat16),
                        torch.randn(1, cfg["q"], device="cuda", dtype=torch.bfloat16),
                        torch.randn(1, cfg["inter"], device="cuda", dtype=torch.bfloat16))
            variants = [v for v in WHOLE_K_VARIANTS if args.variants is None or v[0] in args.variants.split(",")]
            variants += [("gemv", None)] if rows == 1 else []
            layer_calls = {}
            for name, v in variants:
                line = f"{model:14s} rows {rows:3d} {name:14s}"
                per_kind = []
                for kind in kinds:
                    sets = [ws[0]] if kind[3] == "lm" else ws
                    if v is None:
                        call = (lambda kind: lambda w: _gemv_kind(kind, w, lm, *g_in))(kind)
                        ref = None
                    else:
                        opts = dict(v, pdl=True)
                        call = (lambda kind, opts: lambda w: kind[1](w, opts))(kind, opts)
                        ref = kind[2](sets[0])
                    try:
                        got = call(sets[0])
                    except ValueError as e:  # e.g. a block_n that does not fit: record and go on
                        results.append(dict(bench="fused_linear", provider=f"whole-k-{name}",
                                            shape={**shape, "kind": kind[0]}, metric="error", unit="text",
                                            value=str(e)[:200]))
                        line += f" {kind[0][:7]} {'-':>6s}"
                        per_kind.append(None)
                        continue
                    got = got[0] if isinstance(got, tuple) else got
                    err = None
                    if ref is not None:
                        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    t = graph_replay_us(lambda: [call(w) for w in sets], len(sets))
                    results.append(dict(bench="fused_linear", provider=f"whole-k-{name}",
                                        shape={**shape, "kind": kind[0]}, metric="latency", unit="us", value=t,
                                        rel_err=err))
                    line += f" {kind[0][:7]} {t:6.2f}"
                    per_kind.append(call)
                if all(c is not None for c in per_kind[:4]):
                    layer_calls[name] = per_kind[:4]
                    t = graph_replay_us(lambda: [c(w) for w in ws for c in per_kind[:4]], len(ws))
                    results.append(dict(bench="fused_linear", provider=f"whole-k-{name}",
                                        shape={**shape, "kind": "layer"}, metric="latency", unit="us", value=t))
                    line += f"  LAYER {t:6.2f}"
                summary.append(line)
                print(line, flush=True)
    write_results("bench_fused_linear-whole-k", results)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
