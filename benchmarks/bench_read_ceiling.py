"""Read-bandwidth ceiling of the B1 S32k decode shape: how fast do plain loads of its K/V go?

Paged decode attention at (B1, S32k, H_kv 8, D 128, bf16) reads 134 MB in ~35-40 us. This sweep times kernels
that only stream that K/V and sum it, with the grid of ``paged_attention`` (KV head x split) and several
tilings: pointer loads through a scattered block table (``paged``, block_size 16) or from contiguous
[H_kv, S, D] (``contig``); Hopper TMA loads (``tl`` tensor descriptors, host-side) from contiguous K/V and
per cache block; ``torch.sum`` over a tensor of the same bytes; ``Tensor.copy_`` of half the bytes (read +
write = the same bytes moved). Each variant is checked against a float32 sum before it is timed.

Timing as ``bench_decode.py``: 10 calls captured in one CUDA graph, ``triton.testing.do_bench`` median of
replays, time per call = replay / 10. TB/s = K+V bytes / time. Writes ``bench_read_ceiling-<date>.json``.
On CPU (``TRITON_INTERPRET=1``) it runs the checks at S 512 and times nothing.

    python benchmarks/bench_read_ceiling.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

B, S, HKV, D, BS = 1, 32768, 8, 128, 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    S = 512


@triton.jit
def _read_ptr(K, V, BT, Out, stride_kb, stride_ks, stride_kh, tps, seq_len, PAGED: tl.constexpr,
              BLOCK_N: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HKV: tl.constexpr):
    """Pointer loads of BLOCK_N tokens per step: through the block table (paged) or from [H_kv, S, D]."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    start = s * tps
    end = tl.minimum(seq_len, start + tps)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if PAGED:
            phys = tl.load(BT + offs_n // BS).to(tl.int64)
            ptr = phys[:, None] * stride_kb + (offs_n % BS)[:, None] * stride_ks + h * stride_kh + offs_d[None, :]
        else:
            ptr = (h * seq_len + offs_n.to(tl.int64))[:, None] * D + offs_d[None, :]
        acc += tl.load(K + ptr).to(tl.float32) + tl.load(V + ptr).to(tl.float32)
    tl.store(Out + (h * tl.num_programs(1) + s) * D + offs_d, tl.sum(acc, 0))


@triton.jit
def _read_tma_contig(kd, vd, Out, tps, seq_len, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Tensor-memory-accelerator (TMA) loads of BLOCK_N tokens per step from [H_kv * S, D] descriptors."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    start = s * tps
    end = tl.minimum(seq_len, start + tps)
    for n0 in range(start, end, BLOCK_N):
        row = h * seq_len + n0
        acc += kd.load([row, 0]).to(tl.float32) + vd.load([row, 0]).to(tl.float32)
    tl.store(Out + (h * tl.num_programs(1) + s) * D + tl.arange(0, D), tl.sum(acc, 0))


@triton.jit
def _read_tma_paged(kd, vd, BT, Out, tps, seq_len, D: tl.constexpr, BS: tl.constexpr, BLOCKS: tl.constexpr):
    """kd/vd: 2D descriptors over the pool as [num_blocks * BS, HKV * D], block [BS, D]; BLOCKS cache blocks
    per step (one TMA load each)."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    acc = tl.zeros([BS, D], dtype=tl.float32)
    start = s * tps
    end = tl.minimum(seq_len, start + tps)
    for n0 in range(start, end, BS * BLOCKS):
        for j in tl.static_range(BLOCKS):
            phys = tl.load(BT + n0 // BS + j)
            acc += kd.load([phys * BS, h * D]).to(tl.float32) + vd.load([phys * BS, h * D]).to(tl.float32)
    tl.store(Out + (h * tl.num_programs(1) + s) * D + tl.arange(0, D), tl.sum(acc, 0))


def timer(fn, reps=10):
    """ms per call of ``fn``: ``reps`` calls in one CUDA graph, do_bench median of replays (nan on CPU)."""
    if DEV == "cpu":
        fn()
        return float("nan")
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(g.replay, warmup=5, rep=40) / reps


def main():
    """Every variant: checked, then timed; prints a line per variant."""
    torch.manual_seed(0)
    nblk = S // BS
    kc = torch.randn(nblk, BS, HKV, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nblk, device=DEV).to(torch.int32)
    kcont = kc[bt.long()].reshape(S, HKV, D).transpose(0, 1).contiguous()  # [HKV, S, D] in logical order
    vcont = vc[bt.long()].reshape(S, HKV, D).transpose(0, 1).contiguous()
    want = (kcont.float() + vcont.float()).sum(1)  # [HKV, D]
    nbytes = 2 * kc.numel() * 2
    rows = []

    def check(out, ns, name):
        got = out.view(HKV, ns, D).sum(1)
        err = (got - want).abs().max().item()
        assert err < 1e-1 * max(1.0, want.abs().max().item()) * 1e-2 + 0.5, (name, err)

    def rec(name, ms):
        tbs = nbytes / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
        rows.append({"variant": name, "us": ms * 1e3, "tbs": tbs})
        print(f"{name:50s} {ms * 1e3:8.2f} us {tbs:6.3f} TB/s", flush=True)

    splits_opts = (32, 33, 64, 128) if DEV == "cuda" else (4,)
    for paged in (True, False):
        for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 4), (32, 4, 6), (256, 8, 2)):
            for ns in splits_opts:
                tps = triton.cdiv(triton.cdiv(S, ns), bn) * bn
                n = triton.cdiv(S, tps)
                out = torch.empty(HKV * n * D, device=DEV)
                a = (kc, vc) if paged else (kcont, vcont)
                f = lambda: _read_ptr[(HKV, n)](a[0], a[1], bt, out, kc.stride(0), kc.stride(1), kc.stride(2), tps, S,
                                               PAGED=paged, BLOCK_N=bn, D=D, BS=BS, HKV=HKV, num_warps=w, num_stages=st)
                ms = timer(f)
                check(out, n, "ptr")
                rec(f"ptr-{'paged' if paged else 'contig'} n{bn} w{w} s{st} splits{n}", ms)
    if True:  # TMA variants (the interpreter runs them too)
        k2 = kcont.view(HKV * S, D)
        v2 = vcont.view(HKV * S, D)
        for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 4), (64, 4, 6)):
            for ns in splits_opts:
                tps = triton.cdiv(triton.cdiv(S, ns), bn) * bn
                n = triton.cdiv(S, tps)
                out = torch.empty(HKV * n * D, device=DEV)
                kd = TensorDescriptor.from_tensor(k2, [bn, D])
                vd = TensorDescriptor.from_tensor(v2, [bn, D])
                f = lambda: _read_tma_contig[(HKV, n)](kd, vd, out, tps, S, BLOCK_N=bn, D=D, num_warps=w, num_stages=st)
                try:
                    ms = timer(f)
                    check(out, n, "tma")
                except Exception as e:  # noqa: BLE001
                    print("tma-contig failed", type(e).__name__, str(e)[:300]); break
                rec(f"tma-contig n{bn} w{w} s{st} splits{n}", ms)
        kp = kc.view(nblk * BS, HKV * D)
        vp = vc.view(nblk * BS, HKV * D)
        kd = TensorDescriptor.from_tensor(kp, [BS, D])
        vd = TensorDescriptor.from_tensor(vp, [BS, D])
        for blocks, w, st in ((4, 4, 3), (4, 4, 4), (2, 4, 4), (8, 4, 3), (4, 8, 4), (1, 4, 6)):
            for ns in splits_opts:
                tps = triton.cdiv(triton.cdiv(S, ns), BS * blocks) * BS * blocks
                n = triton.cdiv(S, tps)
                out = torch.empty(HKV * n * D, device=DEV)
                f = lambda: _read_tma_paged[(HKV, n)](kd, vd, bt, out, tps, S, D=D, BS=BS, BLOCKS=blocks, num_warps=w,
                                                      num_stages=st)
                try:
                    ms = timer(f)
                    check(out, n, "tma-paged")
                except Exception as e:  # noqa: BLE001
                    print("tma-paged failed", type(e).__name__, str(e)[:300]); break
                rec(f"tma-paged blocks{blocks} w{w} s{st} splits{n}", ms)
    if DEV == "cuda":
        x = torch.empty(nbytes // 2, device=DEV, dtype=torch.bfloat16).normal_()
        rec("torch-sum (one tensor of the same bytes)", timer(lambda: x.sum(dtype=torch.float32)))
        y = torch.empty_like(x[: nbytes // 4])
        rec("torch-copy half the bytes (read+write = same bytes)", timer(lambda: y.copy_(x[: nbytes // 4])))
    shape = {"B": B, "S": S, "H_kv": HKV, "D": D, "block_size": BS, "dtype": "bfloat16"}
    out = []
    for r in rows:
        for metric, unit, key in (("latency", "us", "us"), ("kv_bandwidth", "TB/s", "tbs")):
            out.append({"bench": "read_ceiling", "provider": r["variant"].split()[0], "shape": shape,
                        "config": r["variant"], "metric": metric, "unit": unit, "value": r[key]})
    if DEV == "cuda":
        write_results("bench_read_ceiling", out)


if __name__ == "__main__":
    main()
