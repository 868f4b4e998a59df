"""Would a CUDA-core GEMV over a few token rows beat the tensor-core ``fused_linear`` in a verify pass? (CUDA; no model.)

A batch-1 verify pass over k + 1 tokens runs its matmuls through ``fused_linear`` (tensor cores, whole-K tiles),
which costs more than the one-row GEMV of the plain step even at one row (docs/speculative-performance.md, "The
verify pass against the plain step, kernel by kernel"). Here a probe kernel keeps the GEMV's structure (each
program's weight rows, the whole K, loaded into registers before the PDL wait) and loops over the token rows
(``tl.static_range``), with the GEMV's fused RMSNorm (+ residual) prologue and SwiGLU epilogue per row. No RoPE
epilogue (the Q/K/V projection is timed without it on both sides).

Per SmolLM2-135M layer shape (bf16, 30 weight sets back to back in one CUDA graph, PDL launches, as the decode step
runs them; ``common.graph_replay_us``), µs per layer of the four matmuls (qkv with norm + residual, o, gate/up with
norm + residual + SwiGLU, down) at 1 / 2 / 5 / 9 / 16 rows: the probe, ``fused_linear(whole_k=True)`` and, at one
row, ``gemv``. Each probe output is compared with ``fused_linear``'s (max relative error).

With ``--old-gemv FILE`` another version of ``hf_accel/kernels/gemv.py`` (e.g. from ``git show``) is timed too,
at one row, as ``gemv-old`` (an A/B in one run).

    python benchmarks/probe_gemv_rows.py [--rows 1,2,5,9,16] [--warps 4] [--block-n 4] [--old-gemv FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_replay_us, require_cuda, write_results  # noqa: E402

from hf_accel.kernels.fused_linear import fused_linear  # noqa: E402
from hf_accel.kernels.gemv import gemv  # noqa: E402
from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl  # noqa: E402


@triton.jit
def _gemv_rows_kernel(X, R, NormW, W, Y, ROut, N, K, up_offset, stride_wn, stride_x, stride_r, stride_y, stride_ro,
                      eps, ROWS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
                      PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    dt = X.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    wm = n_ok[:, None] & k_ok[None, :]
    if PDL:
        gdc_launch_dependents()
    w = tl.load(w_rows, mask=wm, other=0.0).to(tl.float32)
    if SWIGLU:
        wu = tl.load(w_rows + up_offset * stride_wn, mask=wm, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    for r in tl.static_range(ROWS):
        x = tl.load(X + r * stride_x + offs_k, mask=k_ok, other=0.0)
        if RESIDUAL:
            res = tl.load(R + r * stride_r + offs_k, mask=k_ok, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dt)
            if pid == 0:
                tl.store(ROut + r * stride_ro + offs_k, x, mask=k_ok)
        xf = x.to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
            xf = (nw * (xf * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y = tl.sum(w * xf[None, :], 1)
        out = y.to(dt)
        if SWIGLU:
            up = tl.sum(wu * xf[None, :], 1)
            g = out.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt)
            out = (s.to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)
        tl.store(Y + r * stride_y + offs_n, out, mask=n_ok)


def gemv_rows(x, weight, *, norm_weight=None, residual=None, swiglu=False, eps=1e-5, pdl=True, block_n=4, warps=4):
    rows, k = x.shape
    n_out = weight.shape[0] // (2 if swiglu else 1)
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else y
    pdl = use_pdl(pdl, x)
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_rows_kernel[(triton.cdiv(n_out, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight, y, r_out,
        n_out, k, n_out if swiglu else 0, weight.stride(0), x.stride(0),
        residual.stride(0) if residual is not None else 0, y.stride(0), r_out.stride(0), eps,
        ROWS=rows, NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=swiglu, PDL=pdl,
        BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k), num_warps=warps, num_stages=1, **extra)
    return (y, r_out) if residual is not None else y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rows", default="1,2,5,9,16")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--block-n", type=int, default=4)
    ap.add_argument("--old-gemv", default=None, help="another gemv.py to time at one row as gemv-old")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    old_gemv = None
    if args.old_gemv:
        import importlib.util

        spec = importlib.util.spec_from_file_location("gemv_old", args.old_gemv)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        old_gemv = mod.gemv
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    h, q, kv, inter, copies = 576, 576, 192, 1536, 30
    mk = lambda o, i: (torch.randn(o, i, device=dev) / i**0.5).to(dt)  # noqa: E731
    ws = [dict(qkv=mk(q + 2 * kv, h), o=mk(h, q), gate_up=mk(2 * inter, h), down=mk(h, inter),
               n1=(1 + 0.1 * torch.randn(h, device=dev)).to(dt), n2=(1 + 0.1 * torch.randn(h, device=dev)).to(dt))
          for _ in range(copies)]
    rows_out, lines = [], []
    for rows in [int(v) for v in args.rows.split(",")]:
        x = torch.randn(rows, h, device=dev, dtype=dt)
        res = torch.randn(rows, h, device=dev, dtype=dt)
        o_in = torch.randn(rows, q, device=dev, dtype=dt)
        a_in = torch.randn(rows, inter, device=dev, dtype=dt)

        def calls(fn):
            return [lambda w: fn(x, w["qkv"], norm_weight=w["n1"], residual=res),
                    lambda w: fn(o_in, w["o"]),
                    lambda w: fn(x, w["gate_up"], norm_weight=w["n2"], residual=res, swiglu=True),
                    lambda w: fn(a_in, w["down"])]

        variants = {"probe": lambda a, b, **kw: gemv_rows(a, b, block_n=args.block_n, warps=args.warps, **kw),
                    "fused_linear": lambda a, b, **kw: fused_linear(a, b, whole_k=True, pdl=True, eps=1e-5, **kw)}
        if rows == 1:
            variants["gemv"] = lambda a, b, **kw: gemv(a, b, pdl=True, eps=1e-5, **kw)
            if old_gemv is not None:
                variants["gemv-old"] = lambda a, b, **kw: old_gemv(a, b, pdl=True, eps=1e-5, **kw)
        ref = [c(ws[0]) for c in calls(variants["fused_linear"])]
        ref = [r[0] if isinstance(r, tuple) else r for r in ref]
        line = f"rows {rows:2d}"
        for name, fn in variants.items():
            cs = calls(fn)
            got = [c(ws[0]) for c in cs]
            got = [g[0] if isinstance(g, tuple) else g for g in got]
            err = max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item() for g, r in zip(got, ref))
            per_kind = [graph_replay_us(lambda c=c: [c(w) for w in ws], len(ws)) for c in cs]
            layer = graph_replay_us(lambda: [c(w) for w in ws for c in cs], len(ws))
            shape = {"model": "smollm2-135m", "rows": rows, "dtype": "bfloat16", "block_n": args.block_n,
                     "warps": args.warps}
            rows_out.append({"bench": "probe_gemv_rows", "provider": name, "shape": shape, "metric": "layer_us",
                             "unit": "us", "value": layer, "per_kind_us": per_kind, "max_rel_err": err})
            line += f" | {name} {layer:6.2f} ({' '.join(f'{t:.2f}' for t in per_kind)}) err {err:.1e}"
        lines.append(line)
        print(line, flush=True)
    write_results("probe_gemv_rows", rows_out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
