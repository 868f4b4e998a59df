"""Study of prompt-lookup proposer variants: tokens per verify step on SmolLM2-135M-Instruct (CPU, float32).

Prompts: the first ``--prompts`` (default 4) prompts of each category of ``bench_speculative.py``
(grounded-text, grounded-code, open-ended; chat template applied), batch size 1, greedy, ``max_new_tokens``
128, EOS (``<|im_end|>``) stops a row.

Method (offline replay, exact for greedy): per prompt the plain greedy continuation is generated once
(transformers, float32, KV cache) for ``max_new_tokens + 33`` tokens *without* stopping at EOS, so the
target's argmax is known after every committed prefix a verify step can score. Each proposer variant is then
replayed as the speculative engine runs it: after the prefill token, each verify step drafts up to ``k``
tokens from prompt + committed tokens, accepts the longest prefix equal to the greedy continuation (``n``),
and commits ``n + 1`` tokens (fewer at EOS or at ``max_new_tokens``), as ``commit_tokens`` does. Reported:

* ``tokens_per_step`` = (accepted + verify steps) / verify steps (``speculative_stats``'
  ``mean_tokens_per_step``); ``accepted_per_step`` (``mean_accepted_per_step``); ``new_per_step`` = new
  tokens (prefill token included) / verify steps; summed over the prompts of a category (step-weighted);
* ``est_speedup`` = tokens_per_step x plain step / round time(k), with the H200 bs1 bf16 timings of
  ``profile_speculative_round-20261201.json`` (plain 0.98 ms, round k=8 1.047 ms, k=16 1.07 ms; k=32 is
  a linear extrapolation, 1.116 ms).

Variants: ``max_ngram`` 3..8 (and 12, 16), ``min_ngram`` 1 / 2, occurrence policy ``first`` (first earlier
occurrence: today's), ``last`` (most recent earlier occurrence), ``prompt_first`` (first occurrence that
lies inside the prompt, else the most recent; needs the prompt length, which the kernel does not get today),
``context`` (among the positions after an exact copy of the last ``min_ngram`` tokens, the one whose
preceding ``max_ngram`` tokens agree with the row's last ``max_ngram`` tokens at the most aligned positions,
then the longer exact match, then the first: tolerates a substituted token, which the exact n-gram match
does not), k = 8, 16, 32. (Longest n first with the first occurrence is the same as "the occurrence whose
preceding context matches the row's suffix longest, capped at max_ngram, ties to the first".)

Subsets: ``first4`` (the first 4 prompts of each category: the set variants were chosen on), and with
``--prompts 8`` also ``heldout`` (prompts 5-8: a check against picking a variant that fits 4 prompts) and
``all``. Sums are step-weighted within a subset.

Cross-check: the first-occurrence replay is compared with ``ngram_lookup_ref`` at every step of one
variant, and with the real engine (``accelerate_model(speculative=SpeculativeConfig(adaptive=False))``):
verify steps, accepted tokens and the output must agree.

    .venv/bin/python benchmarks/study_prompt_lookup.py          # -> benchmarks/results/study_prompt_lookup-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import chat_texts  # noqa: E402
from common import meta  # noqa: E402

CATEGORIES = ("grounded-text", "grounded-code", "open-ended")
PLAIN_MS = 0.98
ROUND_MS = {8: 1.047, 16: 1.07, 32: 1.116}  # k=32: extrapolated linearly from k=8 and k=16


# --- greedy continuations ---------------------------------------------------------------------------

@torch.inference_mode()
def greedy_continuation(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` (EOS does not stop it), transformers with a KV cache."""
    x = torch.tensor([ids])
    out = model(input_ids=x, use_cache=True)
    past, toks = out.past_key_values, []
    for _ in range(n):
        t = int(out.logits[0, -1].argmax())
        toks.append(t)
        out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return toks


# --- proposer variants ------------------------------------------------------------------------------

def lookup(row: np.ndarray, length: int, prompt_len: int, k: int, max_ngram: int, min_ngram: int,
           policy: str) -> list[int]:
    """Drafts (<= k tokens, copied only from committed tokens) for the row's first ``length`` tokens."""
    seq = row[:length]
    if policy == "context":
        return _context_lookup(seq, length, k, max_ngram, min_ngram)
    if policy == "oracle":
        return _oracle_lookup(row, length, k)
    if policy.startswith("tree"):
        return _tree_lookup(row, length, k, int(policy[4:]), max_ngram, min_ngram)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length - n < 0:
            continue
        hits = _hits(seq, length, n)
        if not hits.size:
            continue
        if policy == "first":
            s = int(hits[0])
        elif policy == "last":
            s = int(hits[-1])
        elif policy == "prompt_first":
            inside = hits[hits + n <= prompt_len]
            s = int(inside[0]) if inside.size else int(hits[-1])
        else:
            raise ValueError(policy)
        return seq[s + n: s + n + k].tolist()
    return []


def _context_lookup(seq: np.ndarray, length: int, k: int, window: int, min_ngram: int) -> list[int]:
    """``context``: among the earlier positions that follow an exact copy of the last ``min_ngram`` tokens,
    the one whose preceding ``window`` tokens agree with the row's last ``window`` tokens at the most
    aligned positions (then: the longer exact suffix match; then: the first)."""
    cands = _hits(seq, length, min_ngram) + min_ngram  # index of the first drafted token
    if not cands.size:
        return []
    sim = np.zeros(len(cands), dtype=np.int64)
    exact = np.zeros(len(cands), dtype=np.int64)
    alive = np.ones(len(cands), dtype=bool)
    for i in range(1, window + 1):
        idx = cands - i
        same = (idx >= 0) & (length - i >= 0) & (seq[np.clip(idx, 0, None)] == seq[max(length - i, 0)])
        sim += same
        alive &= same
        exact += alive
    key = sim * (window + 1) + exact
    e = int(cands[np.flatnonzero(key == key.max())[0]])
    return seq[e: e + k].tolist()


def _oracle_lookup(row: np.ndarray, length: int, k: int) -> list[int]:
    """``oracle`` (an upper bound, not a proposer: it reads the target's own future tokens, which follow
    ``length`` in ``row``): the longest run of the coming tokens, at most ``k``, that occurs anywhere in the
    committed tokens. No policy that copies from prompt + output can accept more in one step."""
    seq, best = row[:length], []
    for n in range(1, k + 1):
        want = row[length: length + n]
        if len(want) < n or n > length:
            break
        win = np.lib.stride_tricks.sliding_window_view(seq, n)
        if not (win == want).all(axis=1).any():
            break
        best = want.tolist()
    return best


def _tree_lookup(row: np.ndarray, length: int, k: int, branches: int, max_ngram: int, min_ngram: int) -> list[int]:
    """``tree<C>``: what verifying ``C`` candidate drafts at once (a token tree) would accept. Candidates: the
    continuations after earlier copies of the last n tokens, longest n first, most recent copy first within
    an n, distinct continuations only, at most C; the one agreeing longest with the target's coming tokens
    (read from ``row`` past ``length``) is returned, as the verify pass would pick it."""
    seq, cands = row[:length], []
    for n in range(max_ngram, min_ngram - 1, -1):
        for s in _hits(seq, length, n)[::-1]:
            c = seq[s + n: s + n + k].tolist()
            if c and c not in cands:
                cands.append(c)
            if len(cands) == branches:
                break
        if len(cands) == branches:
            break
    want = row[length: length + k].tolist()

    def agree(c):
        m = 0
        while m < len(c) and c[m] == want[m]:
            m += 1
        return m

    return max(cands, key=agree, default=[])


def _hits(seq: np.ndarray, length: int, n: int) -> np.ndarray:
    """Starts s of earlier occurrences of the last n tokens, followed by >= 1 committed token (s + n < length)."""
    if length - n <= 0:
        return np.zeros(0, dtype=np.int64)
    suffix = seq[length - n:]
    win = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)  # starts 0 .. length - 1 - n
    return np.flatnonzero((win == suffix).all(axis=1))


def commit_count(out, n: int, remaining: int, eos) -> tuple[int, bool]:
    """Tokens a verify step commits, as ``commit_tokens`` does: the ``n`` accepted drafts and the target's
    next token (``out`` = the target's tokens from this position), cut after an EOS and at ``remaining``;
    and whether the row finished on an EOS."""
    count = n + 1
    for i in range(count):
        if out[i] in eos:
            count = i + 1
            break
    count = min(count, remaining)
    return count, any(t in eos for t in out[:count])


def replay(prompt: list[int], cont: list[int], max_new: int, eos: set[int], k: int, proposer) -> dict:
    """The engine's rounds for one row, bs1: returns counters."""
    p = len(prompt)
    row = np.array(prompt + cont, dtype=np.int64)
    length = p + 1  # the prefill token
    remaining = max_new - 1
    active = remaining > 0 and cont[0] not in eos
    steps = accepted = proposed = 0
    while active:
        drafts = proposer(row, length, p, k)
        j = length - p  # cont index of the next token
        out = cont[j: j + k + 1]
        assert len(out) == k + 1, "continuation too short"
        n = 0
        while n < len(drafts) and drafts[n] == out[n]:
            n += 1
        count, finished = commit_count(out, n, remaining, eos)
        length += count
        remaining -= count
        active = not finished and remaining > 0
        steps += 1
        accepted += n
        proposed += len(drafts)
    return {"verify_steps": steps, "accepted": accepted, "proposed": proposed, "new_tokens": length - p,
            "output": row[p:length].tolist()}


def variants(quick: bool):
    out = []
    for policy in ("first", "last", "prompt_first"):
        for max_ngram in (3, 4, 5, 6, 8, 12, 16):
            for min_ngram in (1, 2):
                for k in (8, 16, 32):
                    out.append(dict(policy=policy, max_ngram=max_ngram, min_ngram=min_ngram, k=k))
    for window in (8, 12, 16, 20, 24):  # max_ngram = the compared window
        for k in (8, 16, 32):
            out.append(dict(policy="context", max_ngram=window, min_ngram=1, k=k))
    for k in (8, 16, 32):  # the bound no copying policy can pass
        out.append(dict(policy="oracle", max_ngram=0, min_ngram=0, k=k))
    for branches in (2, 4, 8):  # token-tree verification of several candidates
        for k in (8, 16):
            out.append(dict(policy=f"tree{branches}", max_ngram=8, min_ngram=1, k=k))
    return out


def check_against_reference(prompt, cont, max_new, eos, k=16, max_ngram=3, min_ngram=1, steps=40):
    """The replay's first-occurrence lookup equals ngram_lookup_ref at the positions the replay visits."""
    from hf_accel.kernels.ngram_lookup import ngram_lookup_ref

    p = len(prompt)
    row = np.array(prompt + cont, dtype=np.int64)
    checked = 0
    for length in range(p + 1, min(p + max_new, p + 1 + steps)):
        mine = lookup(row, length, p, k, max_ngram, min_ngram, "first")
        tokens = torch.tensor(row[None, :length + 4])
        d, v = ngram_lookup_ref(tokens, torch.tensor([length]), torch.tensor([0]), k, max_ngram, min_ngram)
        assert d[0][v[0]].tolist() == mine, (length, mine, d[0][v[0]].tolist())
        checked += 1
    return checked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/study_prompt_lookup-cpu-<date>.json)")
    ap.add_argument("--continuations", default=None, help="reuse the greedy continuations of an earlier result JSON")
    ap.add_argument("--skip-engine", action="store_true", help="skip the cross-check against the real engine")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from hf_accel.models.loading import load_model

    model, tok = load_model(None, dtype="float32", device="cpu")
    eos_cfg = model.generation_config.eos_token_id
    eos = set([eos_cfg] if isinstance(eos_cfg, int) else list(eos_cfg or []))
    max_new = args.max_new_tokens
    extra = 33  # lookahead: k (<= 32) drafts + 1 past the last committed token

    data = {}
    cached = json.load(open(args.continuations))["continuations"] if args.continuations else {}
    for cat in CATEGORIES:
        texts = chat_texts(tok, cat)[: args.prompts]
        data[cat] = []
        for i, text in enumerate(texts):
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            key = f"{cat}/{i}"
            if key in cached and cached[key]["prompt"] == prompt:
                cont = cached[key]["continuation"]
            else:
                t0 = time.perf_counter()
                cont = greedy_continuation(model, prompt, max_new + extra)
                print(f"{key}: prompt {len(prompt)} tokens, greedy {len(cont)} in {time.perf_counter() - t0:.1f}s",
                      flush=True)
            data[cat].append((prompt, cont))

    checked = check_against_reference(*data["grounded-text"][0], max_new, eos)
    print(f"replay lookup == ngram_lookup_ref at {checked} positions", flush=True)

    rows = []
    for v in variants(False):
        per_prompt = {cat: [replay(prompt, cont, max_new, eos, v["k"],
                                   lambda row, length, p, k: lookup(row, length, p, k, v["max_ngram"],
                                                                    v["min_ngram"], v["policy"]))
                            for prompt, cont in data[cat]] for cat in CATEGORIES}
        subsets = {"first4": range(0, min(4, args.prompts))}
        if args.prompts > 4:
            subsets.update(heldout=range(4, args.prompts), all=range(args.prompts))
        res = {}
        for name, idx in subsets.items():
            res[name] = {}
            for cat in CATEGORIES:
                tot = {key: sum(per_prompt[cat][i][key] for i in idx)
                       for key in ("verify_steps", "accepted", "proposed", "new_tokens")}
                s = tot["verify_steps"]
                tps = (tot["accepted"] + s) / s
                res[name][cat] = {**tot, "tokens_per_step": tps, "accepted_per_step": tot["accepted"] / s,
                                  "new_per_step": tot["new_tokens"] / s,
                                  "acceptance_rate": tot["accepted"] / max(tot["proposed"], 1),
                                  "est_speedup": tps * PLAIN_MS / ROUND_MS[v["k"]]}
        rows.append({**v, "results": res})
        print(f"{v['policy']:>12} max{v['max_ngram']:>2} min{v['min_ngram']} k{v['k']:>2}  " + "  ".join(
            f"{c}: " + "/".join(f"{res[n][c]['tokens_per_step']:.3f}" for n in subsets) for c in CATEGORIES),
            flush=True)

    engine_check = None if args.skip_engine else cross_check_engine(model, tok, data, max_new, eos)

    result = {"meta": {**meta(), "model": "SmolLM2-135M-Instruct (embedded GGUF, Q4_1 dequantised)",
                       "dtype": "float32", "device": "cpu", "max_new_tokens": max_new, "prompts_per_category":
                       args.prompts, "bs": 1, "method": "offline greedy replay (see the script's docstring)",
                       "round_ms": ROUND_MS, "plain_ms": PLAIN_MS,
                       "round_ms_note": "H200 bf16 bs1 (profile_speculative_round-20261201.json and the brief); "
                                        "k=32 extrapolated", "reference_check_positions": checked},
              "engine_check": engine_check, "rows": rows,
              "continuations": {f"{c}/{i}": {"prompt": p, "continuation": ct}
                                for c in CATEGORIES for i, (p, ct) in enumerate(data[c])}}
    date = datetime.date.today().strftime("%Y%m%d")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"study_prompt_lookup-cpu-{date}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def cross_check_engine(model, tok, data, max_new, eos, k=8, max_ngram=3, min_ngram=1):
    """The real engine (prompt lookup, adaptive off, k fixed) vs the replay with the library's own lookup."""
    import hf_accel
    from hf_accel.speculative.proposers import prompt_lookup

    def proposer(row, length, p, kk):
        t = torch.tensor(row[None, :length])
        d, v = prompt_lookup(t, torch.tensor([length]), torch.tensor([0]), kk, max_ngram, min_ngram)
        return d[0][v[0]].tolist()

    cfg = hf_accel.SpeculativeConfig(method="prompt_lookup", num_draft_tokens=k, adaptive=False,
                                     max_ngram=max_ngram, min_ngram=min_ngram)
    accel = hf_accel.accelerate_model(model, speculative=cfg)
    checks = []
    try:
        for cat in ("grounded-text", "grounded-code"):
            for i, (prompt, cont) in enumerate(data[cat]):
                x = torch.tensor([prompt])
                out = accel.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                     do_sample=False)
                st = hf_accel.speculative_stats(accel)
                new = out[0, len(prompt):].tolist()
                sim = replay(prompt, cont, max_new, eos, k, proposer)
                checks.append({"prompt": f"{cat}/{i}", "engine_verify_steps": st and st["verify_steps"],
                               "engine_accepted": st and st["accepted_tokens"],
                               "replay_verify_steps": sim["verify_steps"], "replay_accepted": sim["accepted"],
                               "same_output": new[: len(sim["output"])] == sim["output"]})
                print("engine check", checks[-1], flush=True)
    finally:
        hf_accel.revert_model(accel)
    return {"config": {"k": k, "max_ngram": max_ngram, "min_ngram": min_ngram, "adaptive": False}, "prompts": checks}


if __name__ == "__main__":
    raise SystemExit(main())
