"""Which earlier copy should prompt lookup draft from? Tokens per verify step of cheap choices (CPU replay).

Offline greedy replay (as ``study_prompt_lookup.py``) over the greedy continuations stored in
``study_prompt_lookup-cpu-20261201.json`` (SmolLM2-135M-Instruct, float32; 8 prompts per category of
``bench_speculative.py``, bs1, 128 new tokens, EOS id 2 stops a row). Every step verifies (no backing off),
k = 16 drafts, n-grams 3..1 (or 8..1), and the step commits the accepted drafts + 1. Policies:

* ``first``: the first earlier occurrence of the longest matching n-gram (today's proposer);
* ``last``: its most recent occurrence; ``out_last``: the most recent one if it lies in the output, else
  the first;
* ``winner``: first or most recent, whichever agreed longer with the target the last time they differed
  (known after each step from the committed tokens);
* ``best2``: the better of first and most recent for this very step (what verifying both, a 2-branch token
  tree, would accept: an upper bound of that tree, not a proposer);
* ``pointer``: after a step that drafted from position e and accepted m tokens, when the row's last
  n-gram match is shorter than 2, continue the copy at e + m + 2 if the target's own token equals the
  skipped source token (a deletion), else fall back to ``first``; ``pointer_sub`` also continues at
  e + m + 1 (a substitution) when no deletion fits.

Writes ``study_copy_positions-cpu-<date>.json`` to ``$OUT`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from study_prompt_lookup import _hits, replay  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "results" / "study_prompt_lookup-cpu-20261201.json"
CATEGORIES = ("grounded-text", "grounded-code", "open-ended")
EOS, MAX_NEW, K = {2}, 128, 16


def _accept(drafts, out) -> int:
    m = 0
    while m < len(drafts) and drafts[m] == out[m]:
        m += 1
    return m


class _Proposer:
    """One row's drafts under ``policy``, called as ``study_prompt_lookup.replay`` calls a proposer:
    ``(row, length, prompt_len, k)``. ``row`` holds the target's whole greedy continuation, so the tokens a
    step will see (``row[length:]``) are known to the policies that use them (``winner`` after the fact,
    ``best2`` as a bound), and the previous step's accepted count is read back from the committed tokens."""

    def __init__(self, policy: str, max_ngram: int):
        self.policy, self.max_ngram = policy, max_ngram
        self.prefer, self.last = "first", None  # last: (start, drafts, length) of the previous step

    def __call__(self, row, length, p, k):
        policy, seq = self.policy, row[:length]
        pointer = None
        if self.last is not None and self.last[0] is not None:
            start0, drafts0, length0 = self.last
            pointer = start0 + _accept(drafts0, row[length0:].tolist())
        n, hits = 0, None
        for nn in range(self.max_ngram, 0, -1):
            h = _hits(seq, length, nn)
            if h.size:
                n, hits = nn, h
                break
        out = row[length: length + k + 1].tolist()
        start = None
        if hits is not None:
            first, last = int(hits[0]) + n, int(hits[-1]) + n
            d_first, d_last = row[first: min(first + k, length)].tolist(), row[last: min(last + k, length)].tolist()
            start = first
            if policy == "last":
                start = last
            elif policy == "out_last":
                start = last if int(hits[-1]) >= p else first
            elif policy == "winner":
                start = first if self.prefer == "first" else last
                if d_first != d_last and _accept(d_first, out) != _accept(d_last, out):
                    self.prefer = "first" if _accept(d_first, out) > _accept(d_last, out) else "last"
            elif policy == "best2":
                start = first if _accept(d_first, out) >= _accept(d_last, out) else last
        if policy.startswith("pointer") and pointer is not None and n < 2:
            t = row[length - 1]  # the target's own token of the last step
            if pointer + 1 < length - 1 and row[pointer + 1] == t:
                start = pointer + 2
            elif policy == "pointer_sub" and pointer + 1 < length - 1:
                start = pointer + 1
        drafts = row[start: min(start + k, length)].tolist() if start is not None else []
        self.last = (start, drafts, length)
        return drafts


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    data = json.load(open(SOURCE))["continuations"]
    rows = []
    for max_ngram in (3, 8):
        for policy in ("first", "last", "out_last", "winner", "best2", "pointer", "pointer_sub"):
            line = []
            for cat in CATEGORIES:
                steps = acc = 0
                for i in range(8):
                    c = data[f"{cat}/{i}"]
                    r = replay(c["prompt"], c["continuation"], MAX_NEW, EOS, K, _Proposer(policy, max_ngram))
                    steps += r["verify_steps"]
                    acc += r["accepted"]
                tps = (acc + steps) / steps
                rows.append({"bench": "study_copy_positions", "provider": policy,
                             "shape": {"model": "smollm2-135m-instruct", "dtype": "float32", "category": cat, "bs": 1,
                                       "k": K, "max_ngram": max_ngram, "min_ngram": 1, "prompts": 8,
                                       "max_new_tokens": MAX_NEW},
                             "metric": "tokens_per_step", "unit": "tokens", "value": tps, "verify_steps": steps})
                line.append(f"{cat} {tps:.2f} ({steps} steps)")
            print(f"max_ngram {max_ngram} {policy:12s} " + "  ".join(line), flush=True)
    write_results("study_copy_positions-cpu", rows, {"source": SOURCE.name,
                                                      "method": "offline greedy replay (see the docstring)"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
