"""Sampling vs greedy on the fast path (CUDA): ``model.generate`` tok/s at bs1 and bs8 on a SmolLM2-135M-shaped
Llama with random bf16 weights (``common.smollm2_shaped_model``), prompt 256 random tokens, 128 new tokens, no
EOS (every call generates all of them): greedy (in-graph pick), sampling (temperature 0.7), sampling with
top-k 50 + top-p 0.9, and greedy with a repetition penalty (a logits processor), each the median of 5 timed
calls after a warm-up call, next to stock transformers (sdpa) for greedy and top-p sampling.

    python benchmarks/bench_sampling.py    # -> bench_sampling-<date>.json under $OUT or benchmarks/results/
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, smollm2_shaped_model, write_results  # noqa: E402

import hf_accel  # noqa: E402

VARIANTS = {
    "greedy": {"do_sample": False},
    "sample-t0.7": {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0},
    "sample-topk50-topp0.9": {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "greedy-repetition-penalty": {"do_sample": False, "repetition_penalty": 1.1},
}
STOCK = ("greedy", "sample-topk50-topp0.9")


def timed(model, ids, kw, new_tokens, reps):
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        assert out.shape[1] == ids.shape[1] + new_tokens
    return statistics.median(times[1:])


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    require_cuda(__file__)
    model = smollm2_shaped_model()
    rows, new_tokens = [], 128
    for bs in (1, 8):
        g = torch.Generator(device="cuda").manual_seed(bs)
        ids = torch.randint(100, 49152, (bs, 256), device="cuda", generator=g)
        for name, kw in VARIANTS.items():
            for provider in ("ours", "hf-sdpa") if name in STOCK else ("ours",):
                if provider == "hf-sdpa":
                    hf_accel.revert_model(model)
                    model.set_attn_implementation("sdpa")
                sec = timed(model, ids, kw, new_tokens if provider == "ours" else 32, 5 if provider == "ours" else 1)
                tok_s = bs * (new_tokens if provider == "ours" else 32) / sec
                if provider == "hf-sdpa":
                    hf_accel.accelerate_model(model)
                rows.append({"bench": "sampling", "provider": provider,
                             "shape": {"model": "smollm2-135m-shape", "dtype": "bfloat16", "bs": bs, "prompt_len": 256,
                                       "new_tokens": new_tokens if provider == "ours" else 32, "variant": name},
                             "metric": "tokens_per_s", "unit": "tok/s", "value": tok_s})
                print(f"bs{bs} {name:28s} {provider:8s} {tok_s:10.1f} tok/s", flush=True)
    write_results("bench_sampling", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
