"""Offline replay of the match-gated chooser with two prompt-lookup variants (CPU, no model run).

Data and replay as ``simulate_k_chooser.py`` (its stored float32 greedy continuations of SmolLM2-135M-Instruct, 8
prompts per category, 128 new tokens; the engine's ``_GatedChooser``; each round chosen from the class of its own
lookup). Round times (time model "F", the 6 December H100 bs1 rounds): plain decoding 0.43 ms per token, a verify
round 0.594 + 0.0039 k ms, the gated plain round 0.47 ms, and 0.034 ms of host turnaround per round.

Variants of the lookup (first earlier occurrence of the longest suffix n-gram, k = 15):

* ``max_ngram3`` (today's) and ``max_ngram8`` (n-grams up to 8; classes clamp at 7);
* ``continuing`` (max_ngram 3): a match whose position keeps the same offset from the row's end as the previous
  round's match (the lookup continues the same copy) gets a class of its own (n + 4), with a first-draft rejection
  prior of ``--prior`` for those classes.

Also printed: per category, how often a match of each (n, continuing) kind was followed by a rejected first draft,
and the mean drafts it accepted (every position of the continuation, k = 15).

    .venv/bin/python benchmarks/simulate_lookup_classes.py   # -> results/simulate_lookup_classes-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import simulate_k_chooser as s  # noqa: E402
from hf_accel.kernels.commit_tokens import NUM_CLASSES  # noqa: E402
from hf_accel.speculative.draft_length import _GatedChooser  # noqa: E402

K = 15
GAP_MS = 0.034
s.TIME_MODELS["F"] = (0.43, 0.594, 0.0039, 0.47)


def lookup(tokens: list[int], length: int, max_ngram: int) -> tuple[int, int]:
    """(matched n, position after the match) of the first earlier occurrence of the longest suffix n-gram that
    is followed by at least one committed token (``ngram_lookup_ref``'s rule), or (0, -1)."""
    for n in range(max_ngram, 0, -1):
        suffix = tokens[length - n: length]
        for start in range(0, length - n):
            if tokens[start: start + n] == suffix:
                return n, start + n
    return 0, -1


def tables(prompt, cont, max_ngram, k_max: int = K):
    """Per committed output length j: drafts accepted (at most ``k_max``, default 15), matched n, and the match's
    offset from the end."""
    full, p = prompt + cont, len(prompt)
    acc, ngram, offset = [], [], []
    for j in range(1, s.MAX_NEW + 1):
        length = p + j
        n, at = lookup(full, length, max_ngram)
        a = 0
        while n and a < k_max and at + a < length and j + a < len(cont) and full[at + a] == cont[j + a]:
            a += 1
        acc.append(a)
        ngram.append(min(n, NUM_CLASSES - 1))
        offset.append(at - length if n else None)
    return acc, ngram, offset


def replay(prompt, cont, tab, continuing: bool, prior: float) -> dict:
    acc, ngram, offset = tab
    chooser = _GatedChooser(K, s.DRAFT_COST)
    if continuing:
        for c in range(5, NUM_CLASSES):
            chooser.classes[c].prior_hazard = prior
    j, remaining = 1, s.MAX_NEW - 1
    active = remaining > 0 and cont[0] not in s.EOS
    used, first, t_ms, verify, plain, pending, prev = set(), True, 0.0, 0, 0, None, None
    while active:
        cls = ngram[j - 1]
        if continuing and cls and offset[j - 1] == prev:
            cls = min(cls + 4, NUM_CLASSES - 1)
        prev = offset[j - 1]
        counts = [0] * NUM_CLASSES
        counts[cls] = 1
        k, rounds = chooser.choose(counts, remaining, burst=True)
        ms = s.round_ms("F", k) * rounds + GAP_MS
        t_ms += ms
        hists = [[0] * (k + 1) for _ in range(NUM_CLASSES)]
        for r in range(rounds):
            if not active:
                break
            if r:
                prev = offset[j - 1]
            n = min(acc[j - 1], k) if k else 0
            hists[cls][n] += 1
            count, finished = s.commit_count(cont[j: j + k + 1], n, remaining, s.EOS)
            j += count
            remaining -= count
            active = not finished and remaining > 0
        verify += rounds if k else 0
        plain += 0 if k else rounds
        captured = k not in used
        used.add(k)
        if pending is not None:
            chooser.update(*pending)
        pending = (k, hists, None if (captured or first) else ms / 1e3 / rounds)
        first = False
    return {"tokens": j, "verify_rounds": verify, "plain_rounds": plain, "sim_ms": t_ms,
            "plain_decode_ms": j * s.TIME_MODELS["F"][0], "ks": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prior", type=float, action="append", help="first-draft rejection prior of the continuing "
                    "classes (repeatable; default 0.3, 0.15, 0.05)")
    default_out = ROOT / "results" / f"simulate_lookup_classes-cpu-{datetime.date.today():%Y%m%d}.json"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args()
    priors = args.prior or [0.3, 0.15, 0.05]
    rows = s.load_rows()
    out = {"meta": {"data": str(s.DATA.relative_to(ROOT.parent)), "time_model_F_ms": s.TIME_MODELS["F"],
                    "gap_ms": GAP_MS, "k": K}, "speedup": {}, "match_kinds": {}}
    for mx in (3, 8):
        tabs = {cat: [tables(p, c, mx) for p, c in rows[cat]] for cat in s.CATEGORIES}
        variants = [(f"max_ngram{mx}", False, None)]
        if mx == 3:
            variants += [(f"continuing_prior{pr}", True, pr) for pr in priors]
            for cat in s.CATEGORIES:
                kinds = defaultdict(list)
                for acc, ngram, offset in tabs[cat]:
                    prev = None
                    for a, n, off in zip(acc, ngram, offset):
                        kinds[f"n{n}" + ("_continuing" if n and off == prev else "")].append(a)
                        prev = off
                out["match_kinds"][cat] = {
                    k: {"positions": len(v), "first_draft_rejected": round(sum(a == 0 for a in v) / len(v), 3),
                        "mean_accepted": round(sum(v) / len(v), 2)} for k, v in sorted(kinds.items())}
        for name, cont_flag, pr in variants:
            out["speedup"][name] = {cat: s.summarise([replay(p, c, t, cont_flag, pr or 0.3)
                                                      for (p, c), t in zip(rows[cat], tabs[cat])])
                                    for cat in s.CATEGORIES}
            print(name, {cat: out["speedup"][name][cat]["speedup"] for cat in s.CATEGORIES}, flush=True)
    print(json.dumps(out["match_kinds"], indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
