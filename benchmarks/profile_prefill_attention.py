"""The bucketed prompt prefill's attention at SmolLM2-135M's shape: launch variants of the paged kernel (CUDA).

The fast path prefills a prompt padded to a bucket length in one forward whose attention is
:func:`hf_accel.kernels.paged_attention.paged_attention` over the prompt's own K/V in the paged cache
(causal, key mask, scattered blocks). At 512 tokens it took 16.7 µs per layer, a third of the prefill
(``profile_prefill-20261203-f4ff721.json``). This times that call (9 query / 3 KV heads, head_dim 64,
bf16, block 16, 1 batch row) at ``--lengths`` bucket lengths, in launch variants (keys per tile ``bn``,
query rows per program ``bm``, warps ``w``, pipeline stages ``s``, KV splits ``sp``), each call
captured 10 times in a CUDA graph (``common.graph_replay_us``), in turns over ``--rounds``. For reference
``prefill_attention`` (hf-accel's FlashAttention-2 kernel) and SDPA (flash) on contiguous K/V of the same
shape. Every variant's output is checked against the default's first. Writes
``profile_prefill_attention-<date>.json``.

    python benchmarks/profile_prefill_attention.py [--lengths 192,256,384,512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_replay_us, write_results  # noqa: E402

from hf_accel.kernels.paged_attention import paged_attention  # noqa: E402
from hf_accel.kernels.prefill import prefill_attention  # noqa: E402

H, KV, D, BLOCK = 9, 3, 64, 16

#: name -> paged_attention overrides (None: the kernel's defaults, as the prefill calls it: 1 split)
VARIANTS = {
    "default": {},
    "bn128": {"block_n": 128},
    "bn128_w8": {"block_n": 128, "num_warps": 8},
    "bn128_w8_s2": {"block_n": 128, "num_warps": 8, "num_stages": 2},
    "bn32": {"block_n": 32},
    "bm32": {"block_m": 32},
    "bm16": {"block_m": 16},
    "bm128_w8": {"block_m": 128, "num_warps": 8},
    "bm32_bn128": {"block_m": 32, "block_n": 128},
    "w8": {"num_warps": 8},
    "s2": {"num_stages": 2},
    "sp2": {"num_splits": 2},
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--lengths", default="192,256,384,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        width = 8
        while width * BLOCK < length + 160:  # the engine's table: prompt + new tokens + drafts, bucketed
            width *= 2
        pool = width + 4
        kc = torch.randn(pool, BLOCK, KV, D, device=dev, dtype=dt)
        vc = torch.randn(pool, BLOCK, KV, D, device=dev, dtype=dt)
        table = torch.randperm(pool, device=dev)[:width].to(torch.int32)[None]
        seq_lens = torch.tensor([length], dtype=torch.int32, device=dev)
        max_seq = width * BLOCK
        key_mask = torch.ones(1, max_seq, dtype=torch.uint8, device=dev)
        q = torch.randn(1, length, H, D, device=dev, dtype=dt).transpose(1, 2)  # [1, H, L, D] view, as the step
        out = torch.empty(1, length, H, D, device=dev, dtype=dt)

        def call(kw):
            return paged_attention(q, kc, vc, table, seq_lens, max_seq, key_mask, causal=True,
                                   num_splits=kw.get("num_splits", 1), out=out,
                                   **{k: v for k, v in kw.items() if k != "num_splits"})

        ref = call({}).clone()
        # contiguous K/V of the prompt for the references
        idx = torch.arange(length, device=dev)
        phys = table[0, idx // BLOCK].long()
        k4 = kc[phys, idx % BLOCK].permute(1, 0, 2)[None].contiguous()  # [1, KV, L, D]
        v4 = vc[phys, idx % BLOCK].permute(1, 0, 2)[None].contiguous()
        qc = q.contiguous()
        k_rep, v_rep = k4.repeat_interleave(H // KV, 1), v4.repeat_interleave(H // KV, 1)
        sdpa = torch.nn.functional.scaled_dot_product_attention(qc, k_rep, v_rep, is_causal=True)
        err = (sdpa.transpose(1, 2).float() - ref.float()).abs().max().item()
        print(f"L{length}: default vs SDPA max abs err {err:.3g}", flush=True)
        fns = {}
        for name in args.variants.split(","):
            kw = VARIANTS[name]
            try:
                got = call(kw)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (a variant that does not compile is reported)
                print(f"L{length} {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if not torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2):
                print(f"L{length} {name}: output differs from the default's (skipped)", flush=True)
                continue
            fns[name] = (lambda kw=kw: [call(kw) for _ in range(10)])
        fns["fa2_prefill_contiguous"] = lambda: [prefill_attention(qc, k4, v4, causal=True) for _ in range(10)]
        fns["sdpa_flash_contiguous_expanded"] = lambda: [
            torch.nn.functional.scaled_dot_product_attention(qc, k_rep, v_rep, is_causal=True) for _ in range(10)]
        times = {n: [] for n in fns}
        for r in range(args.rounds):
            for name, fn in fns.items():
                try:
                    times[name].append(graph_replay_us(fn, 10))
                except Exception as e:  # noqa: BLE001
                    print(f"L{length} {name}: timing failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    times[name].append(float("nan"))
        print(f"-- L{length} (us per call, median of {args.rounds})")
        for name, v in times.items():
            med = statistics.median(v)
            print(f"   {name:>32}: {med:7.2f}")
            rows.append({"bench": "profile_prefill_attention", "provider": "ours",
                         "shape": {"model": "smollm2-135m", "dtype": "bfloat16", "bs": 1, "q_len": length,
                                   "heads": H, "kv_heads": KV, "head_dim": D, "block_size": BLOCK,
                                   "table_blocks": width, "variant": name,
                                   "overrides": VARIANTS.get(name)},
                         "metric": "us_per_call", "unit": "us", "value": v})
        write_results("profile_prefill_attention", rows)


if __name__ == "__main__":
    main()
