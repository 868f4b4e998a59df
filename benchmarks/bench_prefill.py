"""Prefill attention on one GPU: ours (Triton FA2) vs SDPA-flash / SDPA-cuDNN / FlexAttention, and TTFT.

One run measures, side by side (triton.testing.do_bench medians, bf16):

* ``prefill``: B4 H32 L{1k,2k,4k,8k,16k} D128, causal and not; B1 H32 KV8 L16k D128 causal;
  B4 H32 L4k D64 causal. TFLOP/s = 4*B*H*L^2*D / time (x0.5 causal). Every provider's output is
  compared with SDPA's before it is timed. Inputs are contiguous [B, H, L, D]; GQA K/V are
  [B, H_kv, L, D] (``enable_gqa``; a provider that refuses GQA gets K/V expanded outside the timing,
  noted in the row). ``ours`` is the production path (per-key tuner); ``ours-best`` the best
  configuration of the sweep at that shape.
* ``prefill-sweep`` (``--sweep``): launch variants of our kernel (tile shapes, warps, stages, TMA or
  pointer loads, persistent grid, row-tile order, warp specialisation) at a few shapes.
* ``prefill-ablation`` (``--ablate``): stage-removal variants of the best configuration (no softmax,
  no P@V, no masks): the time differences say where the time goes. Their outputs are wrong by design.
* ``ttft``: time to first token of a SmolLM2-shaped Llama (random bf16 weights built on the GPU) with
  a 4096-token prompt: ``generate(max_new_tokens=1)`` and a plain forward, stock HF sdpa vs
  ``accelerate_model``.
* ``gpu-check``: the kernel compiled for the GPU vs a float64 reference (bf16/fp16/fp32, masks, varlen,
  head_dims) with the 2x-PyTorch error rule.

Kernels are compiled first in a pool of processes (Triton's and Inductor's on-disk caches are shared),
so the timed process only loads them. Results: ``$OUT/bench_prefill-<date>.json`` (rewritten after
each section).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import require_cuda, write_results  # noqa: E402

DT = torch.bfloat16
SHAPES = (
    [dict(B=4, H=32, H_kv=32, L=L, D=128, causal=c) for c in (True, False)
     for L in (1024, 2048, 4096, 8192, 16384)]
    + [dict(B=1, H=32, H_kv=8, L=16384, D=128, causal=True), dict(B=4, H=32, H_kv=32, L=4096, D=64, causal=True)]
)
# the attention of one SmolLM2 layer at the TTFT prompt (extra row, not an acceptance shape)
TTFT_SHAPE = dict(B=1, H=9, H_kv=3, L=4096, D=64, causal=True)
KEY_SHAPE = dict(B=4, H=32, H_kv=32, L=4096, D=128, causal=True)
SMOL = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
TTFT_LEN = 4096


def flops(s):
    f = 4 * s["B"] * s["H"] * s["L"] ** 2 * s["D"]
    return f * 0.5 if s["causal"] else f


def tag(s):
    return f"B{s['B']} H{s['H']} KV{s['H_kv']} L{s['L']} D{s['D']} {'causal' if s['causal'] else 'full'}"


def inputs(s, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + s["L"] + s["D"])
    q = torch.randn(s["B"], s["H"], s["L"], s["D"], device="cuda", dtype=DT, generator=g)
    k = torch.randn(s["B"], s["H_kv"], s["L"], s["D"], device="cuda", dtype=DT, generator=g)
    v = torch.randn(s["B"], s["H_kv"], s["L"], s["D"], device="cuda", dtype=DT, generator=g)
    return q, k, v


# ------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------


def sweep_configs(s):
    from hf_accel.kernels.prefill import PrefillConfig as C

    if s["D"] <= 64:
        base = [C(64, 64, 4, 3), C(64, 64, 4, 3, tma_qo=True), C(64, 64, 4, 3, use_tma=False), C(64, 128, 4, 3),
                C(128, 64, 4, 3), C(128, 128, 8, 3), C(64, 64, 4, 3, persistent=True),
                C(64, 64, 4, 3, reverse_m=False)]
    else:
        base = [C(64, 64, 4, 3), C(64, 64, 4, 3, tma_qo=True), C(64, 64, 4, 3, use_tma=False), C(64, 64, 4, 2),
                C(64, 32, 4, 3), C(128, 128, 8, 3), C(128, 128, 8, 3, use_tma=False), C(128, 64, 8, 3),
                C(64, 64, 4, 3, persistent=True), C(64, 64, 4, 3, reverse_m=False),
                C(64, 64, 4, 3, warp_specialize=True)]
    if not s["causal"]:
        base = [c for c in base if c.reverse_m]
    return base


def sweep_shapes():
    return [KEY_SHAPE, dict(KEY_SHAPE, causal=False), dict(KEY_SHAPE, D=64),
            dict(B=1, H=32, H_kv=8, L=16384, D=128, causal=True), dict(KEY_SHAPE, L=1024), TTFT_SHAPE]


def ablation_configs(best):
    from dataclasses import replace

    return [replace(best, ablate=a) for a in (1, 2, 3)]


# ------------------------------------------------------------------------------------------------
# worker side (compile in parallel; GPU correctness checks)
# ------------------------------------------------------------------------------------------------


def _worker_init():
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    _raise_recompile_limit()


def _raise_recompile_limit():
    # one compiled flex_attention serves every shape: allow one specialisation per shape
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)


def job_compile_ours(s, cfgs):
    """Compile (and run once) each config at shape s; returns [(config.short(), error or None)]."""
    from hf_accel.kernels.prefill import prefill_attention

    q, k, v = inputs(s)
    res = []
    for cfg in cfgs:
        try:
            prefill_attention(q, k, v, causal=s["causal"], config=cfg)
            torch.cuda.synchronize()
            res.append((cfg.short(), None))
        except Exception as e:  # noqa: BLE001
            res.append((cfg.short(), f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
    return res


def job_compile_hf_layout(cfgs):
    """The TTFT model's attention shape (B1 H9 KV3 L4096 D64, transformers' strided layout)."""
    from hf_accel.kernels.prefill import prefill_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, TTFT_LEN, 9, 64, device="cuda", dtype=DT, generator=g).transpose(1, 2)
    k = torch.randn(1, TTFT_LEN, 3, 64, device="cuda", dtype=DT, generator=g).transpose(1, 2)
    v = torch.randn(1, TTFT_LEN, 3, 64, device="cuda", dtype=DT, generator=g).transpose(1, 2)
    res = []
    for cfg in cfgs:
        try:
            prefill_attention(q, k, v, causal=True, config=cfg)
            torch.cuda.synchronize()
            res.append((cfg.short(), None))
        except Exception as e:  # noqa: BLE001
            res.append((cfg.short(), f"{type(e).__name__}: {str(e)[:200]}"))
    return res


def make_flex(s):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = torch.compile(flex_attention, dynamic=False)
    bm = None
    if s["causal"]:
        bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=s["L"], KV_LEN=s["L"],
                               device="cuda")
    return lambda q, k, v: fn(q, k, v, block_mask=bm, enable_gqa=s["H"] != s["H_kv"])


def job_compile_flex(s):
    try:
        q, k, v = inputs(s)
        make_flex(s)(q, k, v)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def job_gpu_checks():
    """The kernel compiled for the GPU vs float64, error <= 2x PyTorch's same-dtype error + 1e-5."""
    from hf_accel.kernels.prefill import (PrefillConfig, prefill_attention, prefill_attention_ref,
                                          prefill_attention_varlen, prefill_attention_varlen_ref)

    out = []
    C = PrefillConfig
    cases = [
        # B, H, Hkv, Lq, Lk, D, dtype, causal, mask, config
        (2, 8, 2, 333, 333, 128, torch.bfloat16, True, "leftpad", C(128, 128, 8, 3)),
        (2, 8, 2, 333, 333, 128, torch.bfloat16, True, "leftpad", C(128, 64, 8, 3)),
        (2, 8, 8, 97, 333, 128, torch.bfloat16, True, None, C(128, 64, 8, 3, persistent=True)),
        (1, 8, 1, 333, 333, 64, torch.float16, False, None, C(128, 64, 4, 3)),
        (2, 8, 2, 128, 128, 64, torch.bfloat16, True, "start", C(64, 64, 4, 3)),
        (1, 4, 2, 97, 97, 80, torch.bfloat16, True, None, C(64, 64, 4, 3)),
        (1, 4, 2, 97, 128, 96, torch.float16, False, None, C(64, 64, 4, 3)),
        (1, 4, 1, 333, 333, 256, torch.bfloat16, True, "leftpad", C(64, 64, 4, 2)),
        (2, 4, 2, 17, 17, 128, torch.float32, True, "allmasked", C(64, 32, 4, 2)),
        (2, 8, 2, 333, 333, 128, torch.bfloat16, True, None, C(128, 128, 8, 3, warp_specialize=True)),
        (2, 9, 3, 333, 333, 64, torch.bfloat16, True, "leftpad", C(64, 64, 4, 3, persistent=True)),
        (2, 8, 2, 333, 1000, 128, torch.bfloat16, True, "leftpad", C(64, 64, 4, 3, use_tma=False)),
        (2, 8, 2, 333, 333, 128, torch.bfloat16, False, None, C(64, 64, 4, 3)),
        (2, 8, 2, 333, 333, 128, torch.bfloat16, True, "leftpad", C(64, 64, 4, 3, tma_qo=True)),
    ]
    for case in cases:
        b, h, hkv, lq, lk, d, dt, causal, mk, cfg = case
        name = f"B{b} H{h}/{hkv} q{lq} kv{lk} D{d} {str(dt)[6:]} {'causal' if causal else 'full'} {mk} {cfg.short()}"
        try:
            g = torch.Generator(device="cuda").manual_seed(lq * 31 + d)
            q = torch.randn(b, lq, h, d, device="cuda", dtype=dt, generator=g).transpose(1, 2)
            k = torch.randn(b, lk, hkv, d, device="cuda", dtype=dt, generator=g).transpose(1, 2)
            v = torch.randn(b, lk, hkv, d, device="cuda", dtype=dt, generator=g).transpose(1, 2)
            key_mask = kv_start = None
            if mk in ("leftpad", "allmasked"):
                key_mask = torch.ones(b, lk, dtype=torch.bool, device="cuda")
                key_mask[0, : lk // 3] = False
                if mk == "allmasked":
                    key_mask[1] = False
            if mk == "start":
                kv_start = torch.tensor([0, lk // 3][:b], dtype=torch.int32, device="cuda")
            o, lse = prefill_attention(q, k, v, key_mask, causal=causal, kv_start=kv_start, return_lse=True,
                                       config=cfg)
            ref, rlse = prefill_attention_ref(q.double(), k.double(), v.double(), key_mask, causal=causal,
                                              kv_start=kv_start, return_lse=True)
            same = prefill_attention_ref(q, k, v, key_mask, causal=causal, kv_start=kv_start, compute_dtype=dt)
            err = (o.double() - ref).abs().max().item()
            terr = (same.double() - ref).abs().max().item()
            fin = torch.isfinite(rlse)
            lerr = (lse.double() - rlse)[fin].abs().max().item() if fin.any() else 0.0
            ok = (err <= 2 * terr + 1e-5 and bool(torch.isfinite(o).all())
                  and torch.equal(torch.isfinite(lse), fin) and lerr < 1e-2)
            out.append((name, ok, err, terr, lerr))
        except Exception as e:  # noqa: BLE001
            out.append((name, False, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:200]}"))
    # varlen pack, bf16, TMA path
    for cfg in (C(128, 64, 8, 3), C(64, 64, 4, 3, use_tma=False), C(64, 64, 4, 3, tma_qo=True)):
        name = f"varlen bf16 D128 GQA 8/2 {cfg.short()}"
        try:
            lens_q, lens_k = [300, 17, 128, 1, 333], [300, 97, 128, 40, 333]
            g = torch.Generator(device="cuda").manual_seed(7)
            q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=DT, generator=g)
            k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=DT, generator=g)
            v = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=DT, generator=g)
            cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
            o = prefill_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, config=cfg)
            ref = prefill_attention_varlen_ref(q.double(), k.double(), v.double(), cu_q.cpu(), cu_k.cpu())
            same = prefill_attention_varlen_ref(q, k, v, cu_q.cpu(), cu_k.cpu(), compute_dtype=DT)
            err = (o.double() - ref).abs().max().item()
            terr = (same.double() - ref).abs().max().item()
            out.append((name, err <= 2 * terr + 1e-5, err, terr, 0.0))
        except Exception as e:  # noqa: BLE001
            out.append((name, False, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:200]}"))
    return out


# ------------------------------------------------------------------------------------------------
# main side
# ------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.table = []
        self.extra = {"notes": []}
        self.t0 = time.time()

    def left(self):
        return self.args.budget_s - (time.time() - self.t0)

    def save(self):
        write_results("bench_prefill", self.rows, extra_meta=self.extra)

    def row(self, bench, provider, s, metric, unit, value, **extra):
        r = {"bench": bench, "provider": provider,
             "shape": {k: s[k] for k in ("B", "H", "H_kv", "L", "D", "causal")},
             "metric": metric, "unit": unit, "value": value}
        r.update(extra)
        self.rows.append(r)


def bench_ms(fn, rep=50):
    import triton.testing as tt

    return tt.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def bench_rounds(fns, rounds):
    """Time every fn once per round, providers interleaved (clock/power drift hits all alike);
    returns {name: [ms per round]}."""
    out = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(bench_ms(fn))
    return out


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def sdpa_providers(s, q, k, v):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    provs = {}
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        note = ""
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"], enable_gqa=s["H"] != s["H_kv"])

            def fn(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"],
                                                          enable_gqa=s["H"] != s["H_kv"])
        except RuntimeError:
            g = s["H"] // s["H_kv"]
            ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            note = "K/V expanded to H heads outside the timing (backend refused enable_gqa)"

            def fn(backend=backend, ke=ke, ve=ve):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, ke, ve, is_causal=s["causal"])
            try:
                fn()
            except RuntimeError as e:
                print(f"{name} unavailable at {tag(s)}: {str(e).splitlines()[0][:120]}")
                continue
        provs[name] = (fn, note)
    return provs


def main_bench(run: Run, pool_results):
    from hf_accel.kernels.prefill import PrefillConfig, prefill_attention, tuned_configs

    best_by_shape = {}
    # ---- sweep ------------------------------------------------------------------------------------
    if run.args.sweep:
        for s in sweep_shapes():
            q, k, v = inputs(s)
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s["causal"],
                                                                   enable_gqa=s["H"] != s["H_kv"]).transpose(1, 2)
            results = []
            for cfg in sweep_configs(s):
                err_msg = pool_results.get((tag(s), cfg.short()))
                if err_msg:
                    print(f"sweep {tag(s)} {cfg.short()}: {err_msg}")
                    run.extra["notes"].append(f"sweep {tag(s)} {cfg.short()} failed: {err_msg}")
                    continue
                try:
                    o = prefill_attention(q, k, v, causal=s["causal"], config=cfg)
                    e = rel_err(o, ref)
                    if e > 2e-2:
                        print(f"sweep {tag(s)} {cfg.short()}: WRONG rel err {e:.3g}")
                        run.extra["notes"].append(f"sweep {tag(s)} {cfg.short()} wrong: rel err {e:.3g}")
                        continue
                    ms = bench_ms(lambda: prefill_attention(q, k, v, causal=s["causal"], config=cfg))
                except Exception as ex:  # noqa: BLE001
                    print(f"sweep {tag(s)} {cfg.short()}: {type(ex).__name__} {str(ex)[:150]}")
                    continue
                tf = flops(s) / ms / 1e9
                results.append((tf, cfg))
                run.row("prefill-sweep", "ours:" + cfg.short(), s, "throughput", "TFLOP/s", tf, ms=ms, rel_err=e)
                print(f"sweep {tag(s):36s} {cfg.short():28s} {tf:7.1f} TFLOP/s  {ms:.3f} ms  err {e:.2e}", flush=True)
            if results:
                best_by_shape[tag(s)] = max(results, key=lambda r: r[0])
            del q, k, v, ref
            torch.cuda.empty_cache()
        run.extra["sweep_best"] = {t: [round(tf, 1), c.short()] for t, (tf, c) in best_by_shape.items()}
        run.save()

    # ---- providers over all shapes -----------------------------------------------------------------
    shapes = SHAPES + [TTFT_SHAPE] if not run.args.quick else [KEY_SHAPE]
    for s in shapes:
        if run.left() < 40:
            run.extra["notes"].append(f"stopped before {tag(s)}: time budget")
            break
        q, k, v = inputs(s)
        provs = sdpa_providers(s, q, k, v)
        ref = None
        for name in ("sdpa-cudnn", "sdpa-flash"):
            if name in provs:
                ref = provs[name][0]().transpose(1, 2)
                break
        ours = lambda: prefill_attention(q, k, v, causal=s["causal"])  # noqa: E731
        entries = [("ours", ours, "")]
        best = best_by_shape.get(tag(s))
        if best is not None:
            cfg = best[1]
            entries.append(("ours-best", lambda cfg=cfg: prefill_attention(q, k, v, causal=s["causal"], config=cfg),
                            cfg.short()))
        entries += [(n, (lambda f=f: f().transpose(1, 2)), note) for n, (f, note) in provs.items()]
        if not run.args.no_flex and pool_results.get(("flex", tag(s))) is None:
            try:
                fx = make_flex(s)
                entries.append(("flex", lambda: fx(q, k, v).transpose(1, 2), "torch.compile(flex_attention)"))
            except Exception as ex:  # noqa: BLE001
                print(f"flex unavailable at {tag(s)}: {ex}")
        elif not run.args.no_flex:
            print(f"flex failed to compile at {tag(s)}: {pool_results.get(('flex', tag(s)))}")
        line = {}
        checked = {}
        for name, fn, note in entries:
            try:
                o = fn()
                e = rel_err(o, ref) if ref is not None else float("nan")
                if e > 2e-2 or not torch.isfinite(o).all():
                    print(f"{tag(s)} {name}: WRONG rel err {e:.3g}; not timed")
                    run.extra["notes"].append(f"{tag(s)} {name} wrong: rel err {e:.3g}")
                    continue
                bench_ms(fn, rep=5)  # tuner, compile and caches out of the way
            except Exception as ex:  # noqa: BLE001
                print(f"{tag(s)} {name}: {type(ex).__name__} {str(ex)[:200]}")
                continue
            checked[name] = (fn, note, e)
        times = bench_rounds({n: f for n, (f, _, _) in checked.items()}, run.args.rounds)
        for name, (fn, note, e) in checked.items():
            ms = median(times[name])
            tf = flops(s) / ms / 1e9
            line[name] = tf
            extra = {"ms": ms, "ms_rounds": times[name], "rel_err_vs_sdpa": e}
            if note:
                extra["note"] = note
            run.row("prefill", name, s, "throughput", "TFLOP/s", tf, **extra)
        run.table.append((tag(s), line))
        print(f"{tag(s):36s} " + "  ".join(f"{n} {t:6.1f}" for n, t in line.items()), flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
        run.save()
    run.extra["tuned"] = {str(k): v.short() for k, v in tuned_configs().items()}

    # ---- ablations --------------------------------------------------------------------------------
    if run.args.ablate and run.left() > 30:
        s = KEY_SHAPE
        q, k, v = inputs(s)
        base = best_by_shape.get(tag(s), (0, PrefillConfig(64, 64, 4, 3)))[1]
        run.extra["ablation_base"] = base.short()
        for causal in (True, False):
            sc = dict(s, causal=causal)
            fns = {}
            for cfg in [base] + ablation_configs(base):
                try:
                    fn = (lambda cfg=cfg: prefill_attention(q, k, v, causal=causal, config=cfg))
                    fn()
                    fns[cfg.short()] = fn
                except Exception as ex:  # noqa: BLE001
                    print(f"ablation {cfg.short()}: {type(ex).__name__} {str(ex)[:150]}")
            times = bench_rounds(fns, run.args.rounds)
            for name, ts in times.items():
                ms = median(ts)
                run.row("prefill-ablation", "ours:" + name, sc, "time", "ms", ms, ms_rounds=ts,
                        tflops_equiv=flops(sc) / ms / 1e9)
                print(f"ablation {tag(sc):36s} {name:34s} {ms:.3f} ms ({flops(sc) / ms / 1e9:.1f} TFLOP/s-equiv)")
        del q, k, v
        run.save()


def host_overhead(run: Run):
    """Host time per call (tiny problem, no sync between calls: the CPU side is what is measured)."""
    import torch.nn.functional as F

    from hf_accel.kernels.attention import attention
    from hf_accel.kernels.prefill import PrefillConfig, prefill_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 16, 9, 64, device="cuda", dtype=DT, generator=g).transpose(1, 2)
    k = torch.randn(1, 16, 3, 64, device="cuda", dtype=DT, generator=g).transpose(1, 2)
    v = torch.randn(1, 16, 3, 64, device="cuda", dtype=DT, generator=g).transpose(1, 2)
    fns = {
        "ours (tuned path)": lambda: prefill_attention(q, k, v, causal=True),
        "ours M64N64w4s3-tma (K/V)": lambda: prefill_attention(q, k, v, causal=True,
                                                               config=PrefillConfig(64, 64, 4, 3)),
        "ours M64N64w4s3-tma4 (Q/K/V/O)": lambda: prefill_attention(q, k, v, causal=True,
                                                                    config=PrefillConfig(64, 64, 4, 3, tma_qo=True)),
        "ours M64N64w4s3-ptr": lambda: prefill_attention(q, k, v, causal=True,
                                                         config=PrefillConfig(64, 64, 4, 3, use_tma=False)),
        "attention() (decode kernel)": lambda: attention(q, k, v, causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    s = dict(B=1, H=9, H_kv=3, L=16, D=64, causal=True)
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 300
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        run.row("host-overhead", name, s, "host_time_per_call", "us", host)
        print(f"host overhead {name:30s} {host:7.1f} us/call")
    run.save()


def ttft(run: Run):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_accel

    transformers.logging.set_verbosity_error()
    cfg = LlamaConfig(**SMOL)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(DT).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, SMOL["vocab_size"], (1, TTFT_LEN), device="cuda")
    mask = torch.ones_like(ids)
    s = dict(B=1, H=9, H_kv=3, L=TTFT_LEN, D=64, causal=True)

    def t_generate():
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def t_forward():
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import hf_accel.integrations.attention as hf_attn
    from hf_accel.kernels.attention import attention

    with torch.no_grad():
        ref_logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
        with sdpa_kernel(SDPBackend.MATH):
            math_logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
    run.extra["ttft_logits_rel_err_sdpa_math_vs_default"] = rel_err(math_logits, ref_logits)
    hf_accel.accelerate_model(model)
    with torch.no_grad():
        our_logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
    e = rel_err(our_logits, ref_logits)
    print(f"TTFT model: last-token logits rel err ours vs sdpa {e:.2e} "
          f"(sdpa math vs sdpa default: {run.extra['ttft_logits_rel_err_sdpa_math_vs_default']:.2e})")
    run.extra["ttft_logits_rel_err"] = e
    original = hf_attn.prefill_attention

    def set_mode(mode):
        hf_attn.prefill_attention = original
        if mode == "stock-sdpa":
            if hf_accel.is_accelerated(model):
                hf_accel.revert_model(model)
            return
        if not hf_accel.is_accelerated(model):
            hf_accel.accelerate_model(model)
        if mode == "hf_accel-old-kernel":  # prefill through the untuned attention() kernel, for reference
            hf_attn.prefill_attention = lambda q, k, v, m=None, **kw: attention(q, k, v, m, **kw)

    modes = ("stock-sdpa", "hf_accel", "hf_accel-old-kernel")
    gen = {m: [] for m in modes}
    fwd = {m: [] for m in modes}
    try:
        for m in modes:  # warm-up (tuner, compiles)
            set_mode(m)
            for _ in range(2):
                t_generate()
                t_forward()
        for _ in range(run.args.ttft_rounds):  # modes interleaved: host/clock drift hits all alike
            for m in modes:
                set_mode(m)
                t_generate()
                gen[m].append(median([t_generate() for _ in range(run.args.ttft_reps)]))
                fwd[m].append(median([t_forward() for _ in range(run.args.ttft_reps)]))
    finally:
        set_mode("stock-sdpa")
    for m in modes:
        gm, fm = median(gen[m]), median(fwd[m])
        run.row("ttft", m, s, "ttft_generate", "ms", gm, rounds=gen[m],
                note="generate(max_new_tokens=1), 4096-token prompt; median of per-round medians")
        run.row("ttft", m, s, "prefill_forward", "ms", fm, rounds=fwd[m],
                note="model forward of the prompt, use_cache=False; median of per-round medians")
        print(f"TTFT {m:22s} generate {gm:7.2f} ms   forward {fm:7.2f} ms   "
              f"(rounds {[round(x, 1) for x in gen[m]]})", flush=True)
    run.save()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sweep", action="store_true", help="measure launch variants")
    ap.add_argument("--ablate", action="store_true", help="stage-removal variants at B4 H32 L4096 D128")
    ap.add_argument("--no-ttft", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--quick", action="store_true", help="only B4 H32 L4096 D128 causal")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting sections after this")
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--ttft-rounds", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape")
    args = ap.parse_args()
    require_cuda(__file__)
    _raise_recompile_limit()
    run = Run(args)
    from hf_accel.kernels.prefill_tuning import candidate_configs as _candidate_configs

    # ---- compile everything in parallel ---------------------------------------------------------------
    ctx = mp.get_context("spawn")
    futs = {}
    pool_results = {}
    with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx, initializer=_worker_init) as pool:
        fut_checks = pool.submit(job_gpu_checks)
        shapes = SHAPES if not args.quick else [KEY_SHAPE]
        if not args.no_flex:
            for s in shapes:
                futs[pool.submit(job_compile_flex, s)] = ("flex", s)
        shapes = shapes + [TTFT_SHAPE] if not args.quick else shapes
        if not args.no_flex:
            futs[pool.submit(job_compile_flex, TTFT_SHAPE)] = ("flex", TTFT_SHAPE)
        for s in shapes:  # the tuner's candidates at every benchmark shape
            cands = _candidate_configs(s["D"], 16384, DT)
            futs[pool.submit(job_compile_ours, s, cands)] = ("ours", s)
        if args.sweep:
            for s in sweep_shapes():
                cfgs = sweep_configs(s)
                if args.ablate and s == KEY_SHAPE:
                    from hf_accel.kernels.prefill import PrefillConfig
                    for base in (PrefillConfig(64, 64, 4, 3), PrefillConfig(64, 64, 4, 3, tma_qo=True)):
                        cfgs = cfgs + ablation_configs(base)
                        futs[pool.submit(job_compile_ours, dict(s, causal=False), ablation_configs(base))] = (
                            "ours", dict(s, causal=False))
                for i in range(0, len(cfgs), 2):
                    futs[pool.submit(job_compile_ours, s, cfgs[i:i + 2])] = ("ours", s)
        if not args.no_ttft:
            futs[pool.submit(job_compile_hf_layout, _candidate_configs(64, 4096, DT))] = ("hf", None)
        for f in cf.as_completed(futs):
            kind, s = futs[f]
            try:
                r = f.result()
            except Exception:  # noqa: BLE001
                print(f"compile job {kind} {s and tag(s)} crashed:\n{traceback.format_exc()[-800:]}")
                continue
            if kind == "flex":
                pool_results[("flex", tag(s))] = r
                if r:
                    print(f"flex compile {tag(s)}: {r}")
            else:
                for name, err in r:
                    if s is not None:
                        pool_results[(tag(s), name)] = err
                    if err:
                        print(f"compile {kind} {s and tag(s)} {name}: {err}")
        checks = fut_checks.result()
    print(f"compile phase {time.time() - run.t0:.0f} s", flush=True)
    n_ok = 0
    for name, ok, err, terr, lerr in checks:
        n_ok += bool(ok)
        print(f"gpu-check {'PASS' if ok else 'FAIL'} {name}: err {err:.3g} torch {terr:.3g} lse {lerr}")
        run.rows.append({"bench": "gpu-check", "provider": "ours", "case": name, "pass": bool(ok),
                         "metric": "max_abs_err", "unit": "1", "value": err, "torch_same_dtype_err": terr})
    run.extra["gpu_checks_passed"] = f"{n_ok}/{len(checks)}"
    run.save()

    main_bench(run, pool_results)
    try:
        host_overhead(run)
    except Exception:  # noqa: BLE001
        print("host overhead failed:\n" + traceback.format_exc()[-1000:])
    if not args.no_ttft and run.left() > 20:
        try:
            ttft(run)
        except Exception:  # noqa: BLE001
            print("TTFT failed:\n" + traceback.format_exc()[-1500:])
    print(f"\ntotal {time.time() - run.t0:.0f} s")
    print("\n=== prefill TFLOP/s (bf16) ===")
    for t, line in run.table:
        ratio = ""
        if "ours" in line and "sdpa-cudnn" in line:
            ratio += f"  ours/cudnn {line['ours'] / line['sdpa-cudnn']:.2f}"
        if "ours" in line and "sdpa-flash" in line:
            ratio += f"  ours/flash {line['ours'] / line['sdpa-flash']:.2f}"
        print(f"{t:36s} " + "  ".join(f"{n} {v:6.1f}" for n, v in line.items()) + ratio)
    run.save()


if __name__ == "__main__":
    main()
