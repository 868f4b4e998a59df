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

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import _read_kv_kernel  # noqa: E402  (the pointer-load reader of bench_decode.py)
from common import require_cuda, write_results  # noqa: E402

B, S, HKV, D, BS = 1, 32768, 8, 128, 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    S = 512


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


def main(argv=None):
    """Every variant: checked, then timed; prints a line per variant."""
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    if isinstance(_read_tma_contig, JITFunction):  # compiled for a GPU (not Triton's interpreter)
        require_cuda(__file__, "TRITON_INTERPRET=1 runs its checks on the CPU")
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

    def variant(name, launch, tokens_per_step):
        """Check and time ``launch(out, tokens_per_split, splits)`` over the split counts."""
        for ns in splits_opts:
            tps = triton.cdiv(triton.cdiv(S, ns), tokens_per_step) * tokens_per_step
            n = triton.cdiv(S, tps)
            out = torch.empty(HKV * n * D, device=DEV)
            ms = timer(lambda: launch(out, tps, n))
            check(out, n, name)
            rec(f"{name} splits{n}", ms)

    splits_opts = (32, 33, 64, 128) if DEV == "cuda" else (4,)
    for paged in (True, False):
        a = (kc, vc) if paged else (kcont, vcont)
        for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 4), (32, 4, 6), (256, 8, 2)):
            name = f"ptr-{'paged' if paged else 'contig'} n{bn} w{w} s{st}"
            variant(name, lambda out, tps, n: _read_kv_kernel[(HKV, n)](
                a[0], a[1], bt[None], out, kc.stride(0), kc.stride(1), kc.stride(2), bt.numel(), HKV, tps, S,
                BLOCK_N=bn, HEAD_DIM=D, BLOCK_SIZE=BS, PAGED=paged, num_warps=w, num_stages=st), bn)
    k2, v2 = kcont.view(HKV * S, D), vcont.view(HKV * S, D)
    for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 4), (64, 4, 6)):
        kd, vd = TensorDescriptor.from_tensor(k2, [bn, D]), TensorDescriptor.from_tensor(v2, [bn, D])
        variant(f"tma-contig n{bn} w{w} s{st}", lambda out, tps, n: _read_tma_contig[(HKV, n)](
            kd, vd, out, tps, S, BLOCK_N=bn, D=D, num_warps=w, num_stages=st), bn)
    kd = TensorDescriptor.from_tensor(kc.view(nblk * BS, HKV * D), [BS, D])
    vd = TensorDescriptor.from_tensor(vc.view(nblk * BS, HKV * D), [BS, D])
    for blocks, w, st in ((4, 4, 3), (4, 4, 4), (2, 4, 4), (8, 4, 3), (4, 8, 4), (1, 4, 6)):
        variant(f"tma-paged blocks{blocks} w{w} s{st}", lambda out, tps, n: _read_tma_paged[(HKV, n)](
            kd, vd, bt, out, tps, S, D=D, BS=BS, BLOCKS=blocks, num_warps=w, num_stages=st), BS * blocks)
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
