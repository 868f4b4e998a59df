"""Upper bound on prompt lookup's speedup at batch 1 on the bench's prompts (CPU, no GPU, no timing).

Data: the float32 greedy continuations of SmolLM2-135M-Instruct that ``study_prompt_lookup.py`` stored (the first 8
prompts of each ``bench_speculative.py`` category, 128 new tokens, EOS ``<|im_end|>`` ends a row), loaded as
``simulate_k_chooser.py`` loads them.

For every committed output length j of a row, ``a(j)`` is the number of drafts of the lookup at j that equal the
greedy continuation (``simulate_lookup_classes.tables``: the first earlier occurrence of the longest suffix n-gram,
up to ``max_ngram`` tokens, as ``ngram_lookup_ref``; at most ``k_max`` drafts). A round at j may verify any k <= k_max
of them and then commits between 1 and a(j) + 1 tokens (fewer at EOS or at 128 new tokens: ``commit_count``), so
the fewest rounds that finish the row are found exactly by dynamic programming over j, whatever the k schedule
(the clairvoyant one included). A round runs at least one forward of the whole model, so it takes at least as long as
a plain decode step; with no fixed cost per call either, the plain path's time over the speculative path's time is
at most

    bound = (new tokens - 1) / (fewest rounds)        (summed over a category's prompts)

(the prefill's token is common to both paths). ``oracle`` drafts are the continuation itself (every draft right): the
bound for any proposer at that k_max. With ``--verify-cost c`` (default 1.25, the measured ratio of a 16-token verify
forward to the one-row step) the same programme weighs a verify round as c plain steps and a plain round as one,
for the engine's lookup: the least time of a clairvoyant chooser, still with no fixed cost or host gap. The
grounded categories are also pooled (plain steps over least cost, summed over passages and code). Writes
``results/study_speedup_bound-cpu-<date>.json``.

    .venv/bin/python benchmarks/study_speedup_bound.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import simulate_k_chooser as s  # noqa: E402
from simulate_lookup_classes import tables  # noqa: E402
from study_prompt_lookup import commit_count  # noqa: E402


def accepted_table(prompt: list[int], cont: list[int], max_ngram: int, k_max: int) -> list[int]:
    """``a(j)`` for j = 1 .. MAX_NEW committed output tokens: lookup drafts equal to the continuation, at most
    ``k_max`` (``max_ngram`` 0: every draft right, up to ``k_max``)."""
    if max_ngram == 0:
        return [min(k_max, len(cont) - j) for j in range(1, s.MAX_NEW + 1)]
    return tables(prompt, cont, max_ngram, k_max)[0]


def fewest_rounds(cont: list[int], acc: list[int], verify_cost: float = 1.0) -> tuple[float, int]:
    """(least cost, new tokens) of one row: rounds from the prefill's token to its end (EOS or MAX_NEW), each
    committing any count from 1 to ``acc[j - 1] + 1`` as ``commit_count`` cuts it. A plain round (one token) costs
    1, a verify round ``verify_cost`` (1: the cost is the number of rounds)."""
    end = s.MAX_NEW  # new tokens when the row stops: after its first EOS or at MAX_NEW
    for i, t in enumerate(cont[: s.MAX_NEW]):
        if t in s.EOS:
            end = i + 1
            break
    if end == 1:
        return 0, 1
    best = [0.0] * (end + 1)  # best[j]: least cost from j committed tokens to the end
    for j in range(end - 1, 0, -1):
        remaining = s.MAX_NEW - j
        options = [1 + best[j + 1]]  # a plain round
        for n in range(acc[j - 1] + 1):  # accept n drafts (verify any k >= n of them: the lookup ends there)
            count, finished = commit_count(cont[j: j + n + 1], n, remaining, s.EOS)
            nxt = end if finished else min(j + count, end)
            options.append(verify_cost + best[nxt])
        best[j] = min(options)
    return (int(best[1]) if verify_cost == 1.0 else best[1]), end


def _row(name, cost, category, prompts, tokens, least, bound) -> dict:
    return {"bench": "study_speedup_bound", "provider": name,
            "shape": {"model": "smollm2-135m-instruct", "dtype": "float32", "bs": 1, "category": category,
                      "prompts": prompts, "max_new_tokens": s.MAX_NEW, "new_tokens": tokens,
                      "verify_round_cost": cost, "least_cost": round(least, 3)},
            "metric": "speedup_bound", "unit": "x (plain steps over least cost)", "value": round(bound, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = ROOT / "results" / f"study_speedup_bound-cpu-{datetime.date.today():%Y%m%d}.json"
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--verify-cost", type=float, action="append", default=None,
                    help="also the bound with a verify round costing this many plain steps (the engine's lookup "
                         "only; repeatable; default 1.25: a 16-token verify forward 0.609 ms against 0.488 ms for "
                         "the one-row step, profile_verify_kernels-20261203-62c0953.json)")
    args = ap.parse_args(argv)
    args.verify_cost = args.verify_cost or [1.25]
    rows = s.load_rows()
    variants = [("lookup max_ngram 3, k <= 15 (the engine's)", 3, 15), ("lookup max_ngram 8, k <= 15", 8, 15),
                ("lookup max_ngram 3, k <= 31", 3, 31), ("lookup max_ngram 8, k <= 31", 8, 31),
                ("oracle drafts, k <= 15", 0, 15)]
    out_rows = []
    for cost in [1.0] + args.verify_cost:
        for name, max_ngram, k_max in variants[: None if cost == 1.0 else 1]:
            pooled = [0, 0.0]  # input-grounded prompts (passages and code) together: plain steps, least cost
            for cat in s.CATEGORIES:
                rounds = tokens = 0
                for prompt, cont in rows[cat]:
                    r, t = fewest_rounds(cont, accepted_table(prompt, cont, max_ngram, k_max), cost)
                    rounds, tokens = rounds + r, tokens + t
                bound = (tokens - len(rows[cat])) / rounds if rounds else float("inf")
                if cat.startswith("grounded"):
                    pooled[0] += tokens - len(rows[cat])
                    pooled[1] += rounds
                out_rows.append(_row(name, cost, cat, len(rows[cat]), tokens, rounds, bound))
                print(f"{name:45s} verify {cost:.2f} {cat:14s} tokens {tokens:5d} least cost {rounds:7.1f} "
                      f"bound {bound:.3f}x")
            out_rows.append(_row(name, cost, "grounded-text+grounded-code", 2 * len(rows["grounded-code"]), None,
                                 pooled[1], pooled[0] / pooled[1]))
            print(f"{name:45s} verify {cost:.2f} {'both grounded':14s} bound {pooled[0] / pooled[1]:.3f}x")
    meta = {"gpu": "cpu", "date": f"{datetime.date.today()}", "command": "study_speedup_bound.py",
            "python": platform.python_version(), "data": str(s.DATA.relative_to(ROOT.parent)),
            "note": "float32 CPU greedy continuations; the GPU bench runs bf16 (its outputs differ slightly)"}
    try:
        import subprocess

        meta["git_sha"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=ROOT.parent).stdout.strip()
    except OSError:
        pass
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": out_rows}, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
