"""Upper bound on prompt lookup's speedup at batch 1 on the bench's prompts (CPU, no GPU, no timing).

Data: the float32 greedy continuations of SmolLM2-135M-Instruct that ``study_prompt_lookup.py`` stored (the first 8
prompts of each ``bench_speculative.py`` category, 128 new tokens, EOS ``<|im_end|>`` ends a row), loaded as
``simulate_k_chooser.py`` loads them.

For every committed output length j of a row, ``a(j)`` is the number of drafts of the lookup at j that equal the
greedy continuation (``simulate_lookup_classes.lookup``: the first earlier occurrence of the longest suffix n-gram, up
to ``max_ngram`` tokens, as ``ngram_lookup_ref``; at most ``k_max`` drafts). A round at j may verify any k <= k_max
of them and then commits between 1 and a(j) + 1 tokens (fewer at EOS or at 128 new tokens: ``commit_count``), so
the fewest rounds that finish the row are found exactly by dynamic programming over j, whatever the k schedule
(the clairvoyant one included). A round runs at least one forward of the whole model, so it takes at least as long as
a plain decode step; with no fixed cost per call either, the plain path's time over the speculative path's time is
at most

    bound = (new tokens - 1) / (fewest rounds)        (summed over a category's prompts)

(the prefill's token is common to both paths). ``oracle`` drafts are the continuation itself (every draft right): the
bound for any proposer at that k_max. Writes ``results/study_speedup_bound-cpu-<date>.json``.

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
from simulate_lookup_classes import lookup  # noqa: E402
from study_prompt_lookup import commit_count  # noqa: E402


def accepted_table(prompt: list[int], cont: list[int], max_ngram: int, k_max: int) -> list[int]:
    """``a(j)`` for j = 1 .. MAX_NEW committed output tokens: lookup drafts equal to the continuation, at most
    ``k_max`` (``max_ngram`` 0: every draft right, up to ``k_max``)."""
    full, p = prompt + cont, len(prompt)
    out = []
    for j in range(1, s.MAX_NEW + 1):
        if max_ngram == 0:
            out.append(min(k_max, len(cont) - j))
            continue
        length = p + j
        n, at = lookup(full, length, max_ngram)
        a = 0
        while n and a < k_max and at + a < length and j + a < len(cont) and full[at + a] == cont[j + a]:
            a += 1
        out.append(a)
    return out


def fewest_rounds(cont: list[int], acc: list[int]) -> tuple[int, int]:
    """(fewest rounds, new tokens) of one row: rounds from the prefill's token to its end (EOS or MAX_NEW), each
    committing any count from 1 to ``acc[j - 1] + 1`` as ``commit_count`` cuts it."""
    end = s.MAX_NEW  # new tokens when the row stops: after its first EOS or at MAX_NEW
    for i, t in enumerate(cont[: s.MAX_NEW]):
        if t in s.EOS:
            end = i + 1
            break
    if end == 1:
        return 0, 1
    best = [0] * (end + 1)  # best[j]: fewest rounds from j committed tokens to the end
    for j in range(end - 1, 0, -1):
        remaining = s.MAX_NEW - j
        options = []
        for n in range(acc[j - 1] + 1):  # accept n drafts (verify any k >= n of them: the lookup ends there)
            count, finished = commit_count(cont[j: j + n + 1], n, remaining, s.EOS)
            nxt = end if finished else min(j + count, end)
            options.append(1 + best[nxt])
        best[j] = min(options)
    return best[1], end


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / f"study_speedup_bound-cpu-{datetime.date.today():%Y%m%d}.json"))
    args = ap.parse_args(argv)
    rows = s.load_rows()
    variants = [("lookup max_ngram 3, k <= 15 (the engine's)", 3, 15), ("lookup max_ngram 8, k <= 15", 8, 15),
                ("lookup max_ngram 3, k <= 31", 3, 31), ("lookup max_ngram 8, k <= 31", 8, 31),
                ("oracle drafts, k <= 15", 0, 15)]
    out_rows = []
    for name, max_ngram, k_max in variants:
        for cat in s.CATEGORIES:
            rounds = tokens = 0
            for prompt, cont in rows[cat]:
                r, t = fewest_rounds(cont, accepted_table(prompt, cont, max_ngram, k_max))
                rounds, tokens = rounds + r, tokens + t
            bound = (tokens - len(rows[cat])) / rounds if rounds else float("inf")
            out_rows.append({"bench": "study_speedup_bound", "provider": name,
                             "shape": {"model": "smollm2-135m-instruct", "dtype": "float32", "bs": 1,
                                       "category": cat, "prompts": len(rows[cat]), "max_new_tokens": s.MAX_NEW,
                                       "new_tokens": tokens, "fewest_rounds": rounds},
                             "metric": "speedup_bound", "unit": "x (plain steps over rounds)", "value": round(bound, 3)})
            print(f"{name:45s} {cat:14s} tokens {tokens:5d} fewest rounds {rounds:4d} bound {bound:.3f}x")
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
