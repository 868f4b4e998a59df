"""Batch-1 decode matmuls of a Llama-3-8B-shaped model: weight bytes/s of cuBLAS vs :func:`hf_accel.kernels.gemv.gemv`.

Two measurements, bf16, every time inside a CUDA graph (``triton.testing.do_bench`` median of replays):

* ``per_shape``: one kind of projection (q/k/v with the RMSNorm prologue, o, gate/up with norm + SwiGLU,
  down, LM head) over ``--copies`` distinct weight sets back to back (so no weight is in L2), as TB/s of
  weight bytes; cuBLAS (``F.linear`` with the separate RMSNorm / SwiGLU kernels where the kind has them)
  vs the GEMV over a tile sweep, with and without programmatic dependent launch (PDL);
* ``chain``: the matmuls of one whole token, 32 layers x (q/k/v, o, gate/up, down) + LM head, 15.0 GB of
  weights, as a decode step runs them: ms per token, TB/s, and the tok/s bound they set alone.

Correctness first: every GEMV variant is compared with a float32 reference of the same op.

    python benchmarks/bench_gemv.py                 # -> benchmarks/results/bench_gemv-<date>.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_replay_us, require_cuda, write_results  # noqa: E402

CFG = dict(hidden=4096, q=4096, kv=1024, inter=14336, vocab=128256, layers=32)
MODEL = "llama3-8b-shape"


def _layer(dt, seed):
    h, g = CFG["hidden"], torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda o, i: (torch.randn(o, i, device="cuda", generator=g) / i**0.5).to(dt)  # noqa: E731
    return dict(qkv=mk(CFG["q"] + 2 * CFG["kv"], h), o=mk(h, CFG["q"]), gate_up=mk(2 * CFG["inter"], h),
                down=mk(h, CFG["inter"]), n1=(1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(dt),
                n2=(1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(dt))


def _kinds():
    """(kind, weight key, input width, gemv kwargs builder, cuBLAS path)."""
    from hf_accel.kernels.rms_norm import rms_norm
    from hf_accel.kernels.swiglu import swiglu

    inter = CFG["inter"]
    F = torch.nn.functional
    return [
        ("qkv_norm", "qkv", CFG["hidden"], lambda w, r: dict(norm_weight=w["n1"], residual=r, eps=1e-5),
         lambda x, w, r: F.linear(rms_norm(x, w["n1"], 1e-5, r)[0], w["qkv"])),
        ("o", "o", CFG["q"], lambda w, r: {}, lambda x, w, r: F.linear(x, w["o"])),
        ("gate_up_norm_swiglu", "gate_up", CFG["hidden"],
         lambda w, r: dict(norm_weight=w["n2"], residual=r, eps=1e-5, swiglu=True),
         lambda x, w, r: (lambda gu: swiglu(gu[:, :inter], gu[:, inter:]))(
             F.linear(rms_norm(x, w["n2"], 1e-5, r)[0], w["gate_up"]))),
        ("down", "down", inter, lambda w, r: {}, lambda x, w, r: F.linear(x, w["down"])),
        ("lm_head", "lm_head", CFG["hidden"], lambda w, r: {}, lambda x, w, r: F.linear(x, w["lm_head"])),
        # the decode step's LM head (final norm fused), and the normed kinds without their norm: what the
        # per-program norm prologue costs
        ("lm_head_norm", "lm_head", CFG["hidden"], lambda w, r: dict(norm_weight=w["n1"], residual=r, eps=1e-5),
         lambda x, w, r: F.linear(rms_norm(x, w["n1"], 1e-5, r)[0], w["lm_head"])),
        ("qkv", "qkv", CFG["hidden"], lambda w, r: {}, lambda x, w, r: F.linear(x, w["qkv"])),
        ("gate_up_swiglu", "gate_up", CFG["hidden"], lambda w, r: dict(swiglu=True),
         lambda x, w, r: (lambda gu: swiglu(gu[:, :inter], gu[:, inter:]))(F.linear(x, w["gate_up"]))),
    ]


def check(dt):
    """Max abs error of each GEMV kind vs a float32 reference, relative to the reference's max."""
    from hf_accel.kernels.fused_linear import fused_linear_ref
    from hf_accel.kernels.gemv import gemv

    w = _layer(dt, 7)
    w["lm_head"] = (torch.randn(4096, CFG["hidden"], device="cuda") / 64).to(dt)
    out = {}
    for kind, key, width, kw, _ in _kinds():
        x = torch.randn(1, width, device="cuda", dtype=dt)
        r = torch.randn(1, width, device="cuda", dtype=dt)
        args = kw(w, r)
        for pdl in (False, True):
            got = gemv(x, w[key], pdl=pdl, **args)
            ref = fused_linear_ref(x.float(), w[key].float(),
                                   **{k: (v.float() if torch.is_tensor(v) else v) for k, v in args.items()})
            if "residual" in args:
                got, ref = got[0], ref[0]
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            out[f"{kind}{'-pdl' if pdl else ''}"] = err
            if not err < 2e-2:
                raise SystemExit(f"gemv {kind} pdl={pdl}: relative error {err:.3g}")
    return out


def per_shape(rows, dt, copies, configs, kinds=None):
    from hf_accel.kernels.gemv import gemv

    layers = [_layer(dt, 100 + i) for i in range(copies)]
    lm = [(torch.randn(CFG["vocab"], CFG["hidden"], device="cuda") / 64).to(dt) for _ in range(2)]
    for i, ly in enumerate(layers):
        ly["lm_head"] = lm[i % 2]
    table = []
    for kind, key, width, kw, cublas in _kinds():
        if kinds and kind not in kinds:
            continue
        n = 2 if kind.startswith("lm_head") else copies
        x = torch.randn(1, width, device="cuda", dtype=dt)
        r = torch.randn(1, width, device="cuda", dtype=dt)
        nbytes = layers[0][key].numel() * layers[0][key].element_size()

        def add(provider, us, config=None):
            shape = {"model": MODEL, "kind": kind, "rows": 1, "dtype": str(dt).replace("torch.", "")}
            if config:
                shape["config"] = config
            table.append((kind, provider, config or "", us, nbytes / us / 1e6))
            rows.append({"bench": "gemv", "provider": provider, "shape": shape, "metric": "latency", "unit": "us",
                         "value": us})
            rows.append({"bench": "gemv", "provider": provider, "shape": shape, "metric": "weight_bandwidth",
                         "unit": "TB/s", "value": nbytes / us / 1e6})

        add("cublas", graph_replay_us(lambda: [cublas(x, layers[i], r) for i in range(n)], n, rep_ms=40))
        for bn, bk, nw, pdl in configs:
            cfg = f"n{bn}k{bk}w{nw}" + ("-pdl" if pdl else "")
            us = graph_replay_us(lambda: [gemv(x, layers[i][key], pdl=pdl, block_n=bn, block_k=bk, num_warps=nw,
                                               **kw(layers[i], r)) for i in range(n)], n, rep_ms=40)
            add("ours", us, cfg)
    layers = lm = None  # frees the memory; not `del`: the lambdas above close over these names
    torch.cuda.empty_cache()
    return table


_SHORT = {"block_n": "n", "block_k": "k", "num_warps": "w", "preload_tiles": "p"}


def chain(rows, dt, variants):
    """All matmuls of one token on 32 distinct layers + LM head; ``variants``: (pdl, tiles or None)."""
    from hf_accel.kernels.gemv import gemv as _gemv
    from hf_accel.kernels.rms_norm import rms_norm
    from hf_accel.kernels.swiglu import swiglu

    F = torch.nn.functional
    layers = [_layer(dt, 1000 + i) for i in range(CFG["layers"])]
    lm = (torch.randn(CFG["vocab"], CFG["hidden"], device="cuda") / 64).to(dt)
    final = (1 + 0.1 * torch.randn(CFG["hidden"], device="cuda")).to(dt)
    total = sum(t.numel() * t.element_size() for ly in layers for k, t in ly.items() if k in ("qkv", "o", "gate_up",
                                                                                               "down"))
    total += lm.numel() * lm.element_size()
    inter, q = CFG["inter"], CFG["q"]
    x0 = torch.randn(1, CFG["hidden"], device="cuda", dtype=dt)

    def run_cublas():
        res, d = x0, None
        for ly in layers:
            if d is None:
                h = rms_norm(res, ly["n1"], 1e-5)
            else:
                h, res = rms_norm(d, ly["n1"], 1e-5, res)
            qkv = F.linear(h, ly["qkv"])
            o = F.linear(qkv[:, :q].contiguous(), ly["o"])
            h, res = rms_norm(o, ly["n2"], 1e-5, res)
            gu = F.linear(h, ly["gate_up"])
            d = F.linear(swiglu(gu[:, :inter], gu[:, inter:]), ly["down"])
        h, _ = rms_norm(d, final, 1e-5, res)
        return F.linear(h, lm)

    def run_gemv(pdl, tiles):
        def gemv(*a, **k):
            return _gemv(*a, **k, **tiles)

        def run():
            res, d = x0, None
            for ly in layers:
                if d is None:
                    qkv = gemv(res, ly["qkv"], norm_weight=ly["n1"], eps=1e-5, pdl=pdl)
                else:
                    qkv, res = gemv(d, ly["qkv"], norm_weight=ly["n1"], eps=1e-5, residual=res, pdl=pdl)
                o = gemv(qkv[:, :q].contiguous(), ly["o"], pdl=pdl)
                a, res = gemv(o, ly["gate_up"], norm_weight=ly["n2"], eps=1e-5, residual=res, swiglu=True, pdl=pdl)
                d = gemv(a, ly["down"], pdl=pdl)
            h, _ = rms_norm(d, final, 1e-5, res)
            return gemv(h, lm, pdl=pdl)
        return run

    ref = run_cublas().float()
    table = []
    runs = [("cublas", run_cublas, None)]
    for p, tiles in variants:
        cfg = None if tiles is None else "".join(f"{_SHORT[k]}{v}" for k, v in tiles.items())
        runs.append((f"ours{'-pdl' if p else ''}", run_gemv(p, tiles or {}), cfg))
    for name, fn, cfg in runs:
        out = fn().float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        us = graph_replay_us(fn, 1, rep_ms=40)
        shape = {"model": MODEL, "kind": "all_matmuls_of_a_token", "rows": 1, "dtype": str(dt).replace("torch.", ""),
                 "weight_bytes": total, "config": cfg or "default"}
        for metric, unit, v in (("latency", "ms", us / 1e3), ("weight_bandwidth", "TB/s", total / us / 1e6),
                                ("tokens_per_s_bound", "tok/s", 1e6 / us), ("rel_err_vs_cublas", "fraction", err)):
            rows.append({"bench": "gemv_chain", "provider": name, "shape": shape, "metric": metric, "unit": unit,
                         "value": v})
        table.append((f"{name} {cfg or 'default'}", us / 1e3, total / us / 1e6, 1e6 / us, err))
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=4, help="weight sets per per-shape timing (defeats L2)")
    ap.add_argument("--configs", default="8,512,4;8,1024,4;4,1024,4;16,512,4;8,512,8;16,1024,8",
                    help="'block_n,block_k,warps;...' swept per shape (each with and without PDL)")
    ap.add_argument("--pdl-only", action="store_true", help="sweep only the PDL launches")
    ap.add_argument("--chain-configs", default="",
                    help="'block_n,block_k,warps;...' chains with PDL besides the defaults with and without PDL")
    ap.add_argument("--chain-preload", default="",
                    help="'2,4': chains with PDL and this many weight tiles loaded before each wait (default tiles)")
    ap.add_argument("--kinds", default="", help="per-shape timing of only these kinds (','-separated)")
    ap.add_argument("--skip-per-shape", action="store_true")
    ap.add_argument("--skip-chain", action="store_true")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    t0 = time.perf_counter()
    dt = torch.bfloat16
    configs = []
    for c in args.configs.split(";"):
        bn, bk, nw = (int(v) for v in c.split(","))
        configs += ([] if args.pdl_only else [(bn, bk, nw, False)]) + [(bn, bk, nw, True)]
    rows = []
    errs = check(dt)
    print("relative error vs float32 reference:", {k: f"{v:.2e}" for k, v in errs.items()})
    if not args.skip_per_shape:
        for kind, prov, cfg, us, tbs in per_shape(rows, dt, args.copies, configs,
                                                  list(filter(None, args.kinds.split(","))) or None):
            print(f"{kind:22s} {prov:8s} {cfg:16s} {us:8.2f} us {tbs:6.2f} TB/s")
    if not args.skip_chain:
        variants = [(False, None), (True, None)]
        for c in filter(None, args.chain_configs.split(";")):
            bn, bk, nw = (int(v) for v in c.split(","))
            variants.append((True, dict(block_n=bn, block_k=bk, num_warps=nw)))
        for p in filter(None, args.chain_preload.split(",")):
            variants.append((True, dict(preload_tiles=int(p))))
        for name, ms, tbs, tps, err in chain(rows, dt, variants):
            print(f"chain {name:22s} {ms:7.3f} ms {tbs:6.2f} TB/s  bound {tps:6.1f} tok/s  rel err {err:.2e}")
    write_results("bench_gemv", rows, {"seconds": time.perf_counter() - t0, "check_rel_err": errs})


if __name__ == "__main__":
    main()
