"""End-to-end ``model.generate`` throughput: stock transformers (eager, sdpa) vs hf-accel, side by side.

Models: a Llama-3-8B-shaped model with random bf16 weights built on the GPU (hidden 4096, 32 layers,
32 heads, 8 KV heads, intermediate 14336, vocab 128256), prompt 512, 128 new tokens, bs 1/8/32; the real
SmolLM2-135M-Instruct (bf16, embedded GGUF) bs 1 and 16. Greedy with the model's EOS id unset, so every
provider generates exactly ``max_new_tokens`` tokens per row. Metrics: decode tok/s (all new tokens of the
batch / generate wall time), TTFT (a warm ``max_new_tokens=1`` call), % of the memory floor (weight bytes /
4.27 TB/s per step, bs1), first-call overhead of ours (first call - warm call: graph capture and
Triton compilation), greedy agreement with stock sdpa (bf16; not required to be identical).

    python benchmarks/bench_generate.py [--skip-8b] [--skip-smollm2] [--tiny] [--generate-kwargs JSON] [--lora R]

``--generate-kwargs '{"no_repeat_ngram_size": 4}'`` adds options to every provider's calls (e.g. logits processors,
which hf-accel runs inside transformers' ``generate`` through ``custom_generate``); they are recorded in each row's
shape as ``options``.

``--lora R`` wraps each model in a peft ``PeftModel`` with a rank-R LoRA adapter on every linear layer but the LM
head (``target_modules="all-linear"``, random B so the adapter changes the output; shape key ``lora_r``): the stock
providers run peft's unmerged forward, ``ours`` merges the adapter and runs the fused step on the merged base
weights, and the provider ``ours-module-step`` runs the same merged model on the module step (the fused step off:
what merged LoRA models ran before it took them).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_step_overrides, require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402

COPY_TBS = 4.27


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


#: options every provider's generate calls get (--generate-kwargs)
EXTRA_KWARGS: dict = {}
#: LoRA rank of the adapter each model is wrapped with (--lora; 0: none)
LORA_RANK = 0


def with_lora(model, rank: int):
    """``model`` in a PeftModel with a rank-``rank`` LoRA adapter on every linear layer but the LM head; its B
    matrices random (peft starts them at zero), so the adapter changes the output."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                  lora_dropout=0.0)).eval()
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.01).to(p.device, p.dtype))
    return peft_model


def timed_generate(model, ids, mask, new_tokens):
    _sync()
    t = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         **EXTRA_KWARGS)
    _sync()
    return out, time.perf_counter() - t


def run_model(name, model, ids, mask, new_tokens, rows, table, weight_bytes, providers):
    bs = ids.shape[0]
    shape = {"model": name, "bs": bs, "prompt_len": ids.shape[1], "new_tokens": new_tokens, "dtype": "bfloat16"}
    if EXTRA_KWARGS:
        shape["options"] = dict(EXTRA_KWARGS)
    if LORA_RANK:
        shape["lora_r"] = LORA_RANK
    ref = None
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # fixed-length generation for every provider
    providers = sorted(providers, key=lambda p: p != "hf-sdpa")  # sdpa first: the agreement reference
    for provider in providers:
        try:
            ref = _run_provider(provider, name, model, ids, mask, new_tokens, rows, table, weight_bytes, shape, ref)
        except Exception as e:  # record and go on: one broken provider must not hide the others
            import traceback

            traceback.print_exc()
            rows.append({"bench": "generate", "provider": provider, "shape": shape, "metric": "error",
                         "unit": "text", "value": f"{type(e).__name__}: {e}"[:300]})
            if hf_accel.is_accelerated(model):
                hf_accel.revert_model(model)
    model.generation_config.eos_token_id = eos


def _run_provider(provider, name, model, ids, mask, new_tokens, rows, table, weight_bytes, shape, ref):
    bs = ids.shape[0]
    from hf_accel.engine import step_switches

    from hf_accel.kernels import paged_attention as pa

    fused_rows = step_switches.FUSED_LINEAR_MAX_ROWS
    chunk_tokens = pa.CHUNK_TOKENS
    saved = {k: getattr(step_switches, k) for k in ("GEMV_ONE_ROW", "DECODE_PDL", "ATTENTION_PDL")}
    if provider == "ours-no-gemv":
        # A/B of the one-row GEMV path: the same engine with fused_linear / cuBLAS at batch 1.
        step_switches.GEMV_ONE_ROW = False
    if provider == "ours-no-pdl":
        # A/B of programmatic dependent launch: the step's kernels launched plainly.
        step_switches.DECODE_PDL = False
    if provider == "ours-attention-no-pdl":
        # A/B of PDL on the RoPE / attention / merge kernels alone.
        step_switches.ATTENTION_PDL = False
    if provider == "ours-unfused-linear":
        # A/B of the fused norm/linear/SwiGLU kernels: the same engine with RMSNorm + cuBLAS + SwiGLU.
        step_switches.FUSED_LINEAR_MAX_ROWS = 0
    if provider == "ours-ids-per-tile":
        # A/B of the paged kernel's block-id chunks: the same engine with ids loaded by each tile.
        pa.CHUNK_TOKENS = 0
    overrides = decode_step_overrides(provider.partition("@")[2])  # "ours@NAME=VALUE+...": an A/B of switches
    overrides.__enter__()
    if provider.startswith("ours"):
        hf_accel.accelerate_model(model)
        if provider == "ours-module-step":  # A/B of the fused step: the same engine running the model's modules
            inner = model.get_base_model() if hasattr(model, "get_base_model") else model
            inner._hf_accel_engine.fused = False
    else:
        model.set_attn_implementation(provider.removeprefix("hf-"))
    _, first = timed_generate(model, ids, mask, new_tokens)
    out, warm = timed_generate(model, ids, mask, new_tokens)
    timed_generate(model, ids, mask, 1)  # a 1-token call may compile/capture for its own cache size
    _, ttft = timed_generate(model, ids, mask, 1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        timed_generate(model, ids, mask, new_tokens)
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = None
    tok_s = bs * new_tokens / warm
    per_step = (warm - ttft) / max(new_tokens - 1, 1)
    floor = weight_bytes / (COPY_TBS * 1e12)
    rec = [("tokens_per_s", "tok/s", tok_s), ("ttft", "ms", ttft * 1e3),
           ("decode_step", "ms", per_step * 1e3), ("pct_of_memory_floor", "%", 100 * floor / per_step),
           ("first_call_overhead", "s", first - warm)]
    if peak is not None:
        rec.append(("peak_memory", "GiB", peak / 2**30))
    if provider == "hf-sdpa":
        ref = out
    if provider != "hf-sdpa" and ref is not None:
        new_ref, new_out = ref[:, ids.shape[1]:], out[:, ids.shape[1]:]
        rec.append(("greedy_match_vs_hf_sdpa", "fraction", (new_ref == new_out).float().mean().item()))
    for metric, unit, value in rec:
        rows.append({"bench": "generate", "provider": provider, "shape": shape, "metric": metric, "unit": unit,
                     "value": value})
    table.append((name, bs, provider, tok_s, ttft * 1e3, per_step * 1e3, 100 * floor / per_step, first - warm))
    print(table[-1], flush=True)
    if provider.startswith("ours"):
        hf_accel.revert_model(model)
    overrides.__exit__(None, None, None)
    step_switches.FUSED_LINEAR_MAX_ROWS = fused_rows
    pa.CHUNK_TOKENS = chunk_tokens
    for k, v in saved.items():
        setattr(step_switches, k, v)
    return ref


def llama8b(tiny=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=256, vocab_size=1000)
    else:
        cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                          rope_theta=500000.0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny config")
    ap.add_argument("--providers", default="hf-eager,hf-sdpa,ours",
                    help="comma list of hf-eager, hf-sdpa, ours, ours-module-step, ours-unfused-linear, ours-ids-per-tile, "
                         "ours-no-gemv, ours-no-pdl, ours-attention-no-pdl, "
                         "or ours@NAME=VALUE+NAME=VALUE (switches of hf_accel.engine.step_switches)")
    ap.add_argument("--bs-8b", default="1,8,32", help="batch sizes of the 8B-shaped model")
    ap.add_argument("--bs-smollm2", default="1,16", help="batch sizes of SmolLM2")
    ap.add_argument("--generate-kwargs", default=None,
                    help='JSON object of extra generate options for every provider, e.g. \'{"no_repeat_ngram_size": 4}\'')
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="wrap each model in a PeftModel with a rank-R LoRA adapter on every linear layer but the head")
    args = ap.parse_args()
    if not args.tiny:  # the real shapes (a Llama-3-8B-shaped model is ~32 GB in float32) are GPU work
        require_cuda(__file__, "--tiny runs a CPU smoke test")
    global LORA_RANK
    LORA_RANK = args.lora
    if args.generate_kwargs:
        import json

        EXTRA_KWARGS.update(json.loads(args.generate_kwargs))
    providers = args.providers.split(",")
    rows, table = [], []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.skip_8b:
        model = llama8b(args.tiny)
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if LORA_RANK:
            model = with_lora(model, LORA_RANK)
        prompt, new = (512, 128) if not args.tiny else (16, 8)
        for bs in (tuple(int(v) for v in args.bs_8b.split(",")) if not args.tiny else (1, 2)):
            g = torch.Generator(device=dev).manual_seed(bs)
            ids = torch.randint(0, model.config.vocab_size, (bs, prompt), device=dev, generator=g)
            run_model("llama3-8b-shape" if not args.tiny else "tiny-llama", model, ids, torch.ones_like(ids), new,
                      rows, table, wbytes, providers)
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_smollm2:
        from hf_accel.models import load_default_model

        model, tok = load_default_model(dtype="bfloat16" if dev == "cuda" else "float32", device=dev)
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if LORA_RANK:
            model = with_lora(model, LORA_RANK)
        passage = "Explain, step by step, how a hash table handles collisions, and compare open addressing " \
                  "with separate chaining."
        text = tok.apply_chat_template([{"role": "user", "content": passage}], tokenize=False,
                                       add_generation_prompt=True)
        for bs in (tuple(int(v) for v in args.bs_smollm2.split(",")) if not args.tiny else (1,)):
            enc = tok([text] * bs, return_tensors="pt").to(dev)
            run_model("smollm2-135m", model, enc["input_ids"], enc["attention_mask"], 128 if not args.tiny else 8,
                      rows, table, wbytes, providers)
    if args.tiny or dev != "cuda":
        # A smoke test's numbers never go to benchmarks/results/.
        os.environ.setdefault("OUT", tempfile.mkdtemp(prefix="bench_generate-"))
    write_results("bench_generate" if not args.tiny else "bench_generate-tiny", rows)
    print(f"\n{'model':18}{'bs':>4}  {'provider':20}{'tok/s':>10}{'TTFT ms':>10}{'step ms':>9}{'% floor':>9}{'1st-call s':>11}")
    for name, bs, prov, tok_s, ttft, step, pct, first in table:
        print(f"{name:18}{bs:>4}  {prov:20}{tok_s:10.1f}{ttft:10.1f}{step:9.2f}{pct:9.1f}{first:11.2f}")


if __name__ == "__main__":
    main()
