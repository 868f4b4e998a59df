"""Multi-turn chat with the KV cache carried between calls: stock transformers vs hf-accel, side by side.

A conversation of several user turns on the real SmolLM2-135M-Instruct (embedded GGUF; bf16 with ``--device cuda``, else
float32). Every turn calls
``generate(input_ids=<the last output's sequences + the new user turn>, <cache>=<the last output's cache>,
return_dict_in_generate=True, max_new_tokens=N)``, greedy, the model's own EOS, so each call prefills only the
new turn and continues the cache, as a chat application does. Providers:

* ``hf``: stock transformers (its default attention), its DynamicCache carried between turns;
* ``ours-fast``: ``accelerate_model(model)``: the fast decode path continues the returned PagedCache;
* ``ours-fast-no-cache``: the same accelerated model called without the cache (each turn prefills the whole
  conversation again);
* ``ours-hf-loop``: ``accelerate_model(model, fast_decode=False)``: transformers' loop on hf-accel's kernels and
  PagedCache (what multi-turn calls ran before the fast path took them).

Reported per provider: tok/s of every timed pass and their median (``hf`` and ``ours-hf-loop`` run one timed pass),
each pass's per-turn ms, and, from the first timed pass, the new tokens per turn and whether the tokens equal stock's
(bf16: not required).

    python benchmarks/bench_multi_turn.py [--turns 4] [--new-tokens 128] [--passes 3] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.engine.call_options import output_cache  # noqa: E402
from hf_accel.models import load_model  # noqa: E402

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Tell me three facts about that city.",
    "Now write a short poem about the second fact.",
    "Summarise our conversation so far in two sentences.",
    "Which of the facts would a tourist care about most, and why?",
    "Thank you. Say goodbye in French.",
]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def conversation(model, tok, turns: int, new_tokens: int, carry_cache: bool = True):
    """Run the chat; returns (list of per-turn (new tokens, seconds, prompt tokens, cached tokens), sequences)."""
    device = next(model.parameters()).device
    first = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)
    ids = first["input_ids"].to(device)
    cache, per_turn, out = None, [], None
    for t in range(turns):
        if t:
            text = f"\n<|im_start|>user\n{QUESTIONS[t % len(QUESTIONS)]}<|im_end|>\n<|im_start|>assistant\n"
            more = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
            ids = torch.cat([out.sequences, more], 1)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                  return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        if cache is not None and carry_cache:
            kw[hf_accel.integrations.generate.CACHE_KWARG] = cache
        cached = 0 if cache is None or not carry_cache else cache.get_seq_length()
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**kw)
        _sync()
        seconds = time.perf_counter() - start
        cache = output_cache(out)
        per_turn.append((out.sequences.shape[1] - ids.shape[1], seconds, ids.shape[1], cached))
    return per_turn, out.sequences


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3, help="timed passes of ours-fast and ours-fast-no-cache (hf, ours-hf-loop: 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        require_cuda(__file__, "--device cpu runs on the CPU")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    base, tok = load_model(None, dtype=dtype, device=args.device)
    providers = {
        "hf": base,
        "ours-fast": hf_accel.accelerate_model(copy.deepcopy(base)),
        "ours-fast-no-cache": None,  # the ours-fast model, called without the cache
        "ours-hf-loop": hf_accel.accelerate_model(copy.deepcopy(base), fast_decode=False),
    }
    rows, ref = [], None
    for name, model in providers.items():
        carry = name != "ours-fast-no-cache"
        model = model if model is not None else providers["ours-fast"]
        conversation(model, tok, args.turns, args.new_tokens, carry)  # warm-up: compilation, graph capture
        passes = args.passes if name.startswith("ours-fast") else 1
        runs = [conversation(model, tok, args.turns, args.new_tokens, carry) for _ in range(passes)]
        totals = [(sum(n for n, *_ in r), sum(s for _, s, *_ in r)) for r, _ in runs]
        tok_s = [n / s for n, s in totals]
        per_turn, seq = runs[0]
        if ref is None:
            ref = seq
        row = {"bench": "multi_turn", "provider": name,
               "shape": {"model": "smollm2-135m", "dtype": dtype, "bs": 1, "turns": args.turns,
                         "max_new_tokens": args.new_tokens},
               "metric": "throughput", "unit": "tok/s", "value": round(statistics.median(tok_s), 1),
               "new_tokens": totals[0][0],
               "pass_tok_s": [round(v, 1) for v in tok_s], "tok_s": round(statistics.median(tok_s), 1),
               "turn_new_tokens": [n for n, *_ in per_turn],
               "pass_turn_ms": [[round(1e3 * s, 2) for _, s, *_ in r] for r, _ in runs],
               "turn_input_tokens": [p for *_, p, _ in per_turn], "turn_cached_tokens": [c for *_, c in per_turn],
               "tokens_equal_hf": bool(seq.shape == ref.shape and torch.equal(seq, ref))}
        rows.append(row)
        print(f"{name:14s} {row['tok_s']:9.1f} tok/s  passes {row['pass_tok_s']}  turns ms {row['pass_turn_ms']}  "
              f"new {row['turn_new_tokens']}  cached {row['turn_cached_tokens']}  equal-hf {row['tokens_equal_hf']}")
    hf = rows[0]["tok_s"]
    for r in rows:
        r["speedup_over_hf"] = round(r["tok_s"] / hf, 2)
    write_results("bench_multi_turn", rows, {"model": "SmolLM2-135M-Instruct (embedded GGUF)"})


if __name__ == "__main__":
    main()
