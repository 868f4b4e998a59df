"""The bucketed prompt prefill's attention at SmolLM2-135M's shape: launch variants of the paged kernel (CUDA).

The fast path prefills a prompt padded to a bucket length in one forward whose attention is
:func:`hf_accel.kernels.paged_attention.paged_attention` over the prompt's own K/V in the paged cache
(causal, key mask, scattered blocks). At 512 tokens it took 16.7 µs per layer, a third of the prefill
(``profile_prefill-20261203-f4ff721.json``). This times that call (9 query / 3 KV heads, head_dim 64,
bf16, block 16, 1 batch row; ``--shape 8b``: 32 / 8 heads of 128, ``--batch``) at ``--lengths`` bucket lengths, in launch variants (keys per tile ``bn``,
query rows per program ``bm``, warps ``w``, pipeline stages ``s``, KV splits ``sp``), each call
captured 10 times in a CUDA graph (``common.graph_replay_us``), in turns over ``--rounds``. For reference
``prefill_attention`` (hf-accel's FlashAttention-2 kernel) on contiguous K/V and on the step's own layouts
(what ``PREFILL_CONTIGUOUS_ATTENTION`` runs: Q and K as [tokens, heads, D] views, V a column slice of the
Q/K/V projection, a key mask and start offsets), and SDPA (flash) on contiguous K/V of the same shape. Every variant's output is checked against the default's first. Writes
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
from common import graph_replay_us, require_cuda, write_results  # noqa: E402

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
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "8b"),
                    help="heads / KV heads / head_dim: SmolLM2-135M's 9 / 3 / 64 or Llama-3-8B's 32 / 8 / 128")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    require_cuda(__file__)
    global H, KV, D
    H, KV, D = (9, 3, 64) if args.shape == "smollm2" else (32, 8, 128)
    bsz = args.batch
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        width = 8
        while width * BLOCK < length + 160:  # the engine's table: prompt + new tokens + drafts, bucketed
            width *= 2
        pool = width * bsz + 4
        kc = torch.randn(pool, BLOCK, KV, D, device=dev, dtype=dt)
        vc = torch.randn(pool, BLOCK, KV, D, device=dev, dtype=dt)
        table = torch.randperm(pool, device=dev)[: width * bsz].to(torch.int32).view(bsz, width)
        seq_lens = torch.full((bsz,), length, dtype=torch.int32, device=dev)
        max_seq = width * BLOCK
        key_mask = torch.ones(bsz, max_seq, dtype=torch.uint8, device=dev)
        # the step's layouts: Q [n, H, D] from the RoPE kernel, V a column slice of the Q/K/V projection
        q = torch.randn(bsz, length, H, D, device=dev, dtype=dt).transpose(1, 2)  # [b, H, L, D] view
        out = torch.empty(bsz, length, H, D, device=dev, dtype=dt)

        def call(kw):
            return paged_attention(q, kc, vc, table, seq_lens, max_seq, key_mask, causal=True,
                                   num_splits=kw.get("num_splits", 1), out=out, check_blocks=False,
                                   **{k: v for k, v in kw.items() if k != "num_splits"})

        ref = call({}).clone()
        # contiguous K/V of the prompt for the references
        idx = torch.arange(length, device=dev)
        phys = table[:, idx // BLOCK].long()  # [b, L]
        k_rows = kc[phys, idx % BLOCK]  # [b, L, KV, D]
        v_rows = vc[phys, idx % BLOCK]
        k4 = k_rows.permute(0, 2, 1, 3).contiguous()  # [b, KV, L, D]
        v4 = v_rows.permute(0, 2, 1, 3).contiguous()
        # the step's: rotated K [n, KV, D] (RoPE kernel's k_out), V a slice of [n, (H + 2 KV) D]
        k_step = k_rows.reshape(bsz * length, KV, D).clone().view(bsz, length, KV, D).transpose(1, 2)
        qkv = torch.randn(bsz * length, (H + 2 * KV) * D, device=dev, dtype=dt)
        qkv[:, (H + KV) * D:] = v_rows.reshape(bsz * length, KV * D)
        v_step = qkv[:, (H + KV) * D:].view(bsz, length, KV, D).transpose(1, 2)
        own_mask = key_mask[:, :length]
        kv_start = torch.zeros(bsz, dtype=torch.int32, device=dev)
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
        step_out = prefill_attention(q, k_step, v_step, own_mask, causal=True, kv_start=kv_start)
        if not torch.allclose(step_out.float(), ref.float(), atol=2e-2, rtol=2e-2):
            print(f"L{length} fa2 in the step's layout: output differs from the paged kernel's", flush=True)
        fns["fa2_prefill_step_layout"] = lambda: [
            prefill_attention(q, k_step, v_step, own_mask, causal=True, kv_start=kv_start) for _ in range(10)]
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
                         "shape": {"model": f"{args.shape}-shape", "dtype": "bfloat16", "bs": bsz, "q_len": length,
                                   "heads": H, "kv_heads": KV, "head_dim": D, "block_size": BLOCK,
                                   "table_blocks": width, "variant": name,
                                   "overrides": VARIANTS.get(name)},
                         "metric": "us_per_call", "unit": "us", "value": v})
        write_results("profile_prefill_attention", rows)


if __name__ == "__main__":
    main()
