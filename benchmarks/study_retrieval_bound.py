"""Would retrieval drafts lift the bound of ``study_speedup_bound.py``? (CPU, no GPU, no timing.)

Retrieval-based speculative decoding (REST; He et al. 2023, "REST: Retrieval-Based Speculative Decoding", §3) drafts
the continuation of the row's longest suffix found in a datastore of text. Here the datastore is the source of the
Python standard library that runs this script (its ``.py`` files outside test folders, tokenized with
SmolLM2-135M-Instruct's tokenizer, one token 0 between files): code the bench's code-edit answers resemble, and
nothing downloaded. For every committed length j of the stored float32 greedy answers (``study_speedup_bound``'s
data), the candidates are the datastore positions after the longest suffix of the row (3 to ``--max-suffix``
tokens) that occurs there; then

* ``top path``: the drafts are REST's most frequent path through those candidates' continuations (token by token the
  most common next token among the candidates still on the path), up to k_max = 15; a(j) = its prefix equal to the
  answer;
* ``hindsight``: a(j) = the longest match of any single candidate's continuation with the answer (a choice no
  proposer can make: the bound for any one-path retrieval over this datastore and suffix rule).

Combined with the engine's prompt lookup: ``lookup, else top path`` drafts the lookup's tokens where it matched and
the top path elsewhere; ``best of lookup and hindsight`` takes the larger a(j). The fewest-cost programme of
``study_speedup_bound.fewest_rounds`` then gives the speedup bound with free verify rounds and with verify rounds at
``--verify-cost`` plain steps, no fixed cost per call. Writes ``results/study_retrieval_bound-cpu-<date>.json``.

    .venv/bin/python benchmarks/study_retrieval_bound.py
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import simulate_k_chooser as s  # noqa: E402
from simulate_lookup_classes import tables  # noqa: E402
from study_speedup_bound import fewest_rounds  # noqa: E402

K_MAX = 15


class Datastore:
    """Token ids of a corpus with a sorted index of its 3-grams (REST's suffix array, cut to what this study asks:
    the positions after a given suffix of 3 or more tokens)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        t = self.tokens
        key = (t[:-2] << 34) + (t[1:-1] << 17) + t[2:]  # ids < 2**17
        self.order = np.argsort(key, kind="stable")
        self.keys = key[self.order]

    def after_suffix(self, row: list[int], max_suffix: int) -> np.ndarray:
        """Positions right after the longest suffix of ``row`` (3 to ``max_suffix`` tokens) found in the corpus,
        in corpus order; empty if not even its last 3 tokens occur."""
        if len(row) < 3:
            return np.zeros(0, dtype=np.int64)
        k = (row[-3] << 34) + (row[-2] << 17) + row[-1]
        lo, hi = np.searchsorted(self.keys, k), np.searchsorted(self.keys, k, side="right")
        start = np.sort(self.order[lo:hi])  # where the 3-gram starts
        for n in range(4, min(max_suffix, len(row)) + 1):  # extend the match backwards while any candidate holds
            back = start - (n - 3)
            keep = back >= 0
            keep[keep] = self.tokens[back[keep]] == row[-n]
            if not keep.any():
                break
            start = start[keep]
        return start + 3

    def top_path(self, after: np.ndarray, k_max: int) -> list[int]:
        """REST's most frequent path: token by token the commonest next token among the candidates on the path."""
        path, pos = [], after
        for _ in range(k_max):
            pos = pos[pos < len(self.tokens)]
            if len(pos) == 0:
                break
            values, counts = np.unique(self.tokens[pos], return_counts=True)
            top = int(values[np.argmax(counts)])  # ties: the smallest id
            path.append(top)
            pos = pos[self.tokens[pos] == top] + 1
        return path

    def best_match(self, after: np.ndarray, target: list[int]) -> int:
        """The longest prefix of ``target`` that some candidate's continuation equals."""
        alive, best = after, 0
        for t, want in enumerate(target):
            alive = alive[alive + t < len(self.tokens)]
            alive = alive[self.tokens[alive + t] == want]
            if len(alive) == 0:
                break
            best = t + 1
        return best


def matched(drafts: list[int], target: list[int]) -> int:
    """Leading drafts equal to ``target``."""
    n = 0
    while n < min(len(drafts), len(target)) and drafts[n] == target[n]:
        n += 1
    return n


def stdlib_tokens(tokenizer) -> tuple[np.ndarray, int]:
    """The standard library's ``.py`` files (outside test folders and site-packages) as one token array, 0 between
    files; and the number of files read."""
    paths = sorted(p for p in glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)
                   if "/test" not in p and "site-packages" not in p)
    ids, files = [], 0
    for p in paths:
        try:
            text = Path(p).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [0])
        files += 1
    return np.array(ids, dtype=np.int64), files


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-suffix", type=int, default=8, help="longest row suffix matched in the datastore")
    ap.add_argument("--verify-cost", type=float, default=1.25, help="a verify round in plain steps (second bound)")
    default_out = ROOT / "results" / f"study_retrieval_bound-cpu-{datetime.date.today():%Y%m%d}.json"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    from hf_accel.models.loading import find_default_gguf, load_default_model

    _, tokenizer = load_default_model()
    store_tokens, files = stdlib_tokens(tokenizer)
    store = Datastore(store_tokens)
    print(f"datastore: {len(store_tokens)} tokens from {files} files", flush=True)
    rows = s.load_rows()
    out_rows = []
    for cat in ("grounded-code", "grounded-text"):
        costs = {}
        plain_steps = 0
        for prompt, cont in rows[cat]:
            full = prompt + cont
            lookup = tables(prompt, cont, 3, K_MAX)[0]
            top, hind = [], []
            for j in range(1, s.MAX_NEW + 1):
                after = store.after_suffix(full[: len(prompt) + j], args.max_suffix)
                target = cont[j: j + K_MAX]
                top.append(matched(store.top_path(after, K_MAX), target) if len(after) else 0)
                hind.append(store.best_match(after, target) if len(after) else 0)
            variants = {"lookup (the engine's)": lookup, "retrieval top path": top, "retrieval hindsight": hind,
                        "lookup, else retrieval top path": [a if a else t for a, t in zip(lookup, top)],
                        "best of lookup and retrieval hindsight": [max(a, h) for a, h in zip(lookup, hind)]}
            for name, acc in variants.items():
                for cost in (1.0, args.verify_cost):
                    least, new = fewest_rounds(cont, acc, cost)
                    costs[(name, cost)] = costs.get((name, cost), 0.0) + least
            plain_steps += new - 1
        for (name, cost), least in costs.items():
            bound = plain_steps / least
            print(f"{cat:14s} {name:40s} verify {cost:.2f}: bound {bound:.3f}x", flush=True)
            out_rows.append({"bench": "study_retrieval_bound", "provider": name,
                             "shape": {"model": "smollm2-135m-instruct", "dtype": "float32", "bs": 1, "category": cat,
                                       "prompts": len(rows[cat]), "max_new_tokens": s.MAX_NEW, "k_max": K_MAX,
                                       "max_suffix": args.max_suffix, "verify_round_cost": cost,
                                       "plain_steps": plain_steps, "least_cost": round(least, 3)},
                             "metric": "speedup_bound", "unit": "x (plain steps over least cost)",
                             "value": round(bound, 3)})
    meta = {"gpu": "cpu", "date": f"{datetime.date.today()}", "command": "study_retrieval_bound.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "python": platform.python_version(), "data": str(s.DATA.relative_to(ROOT.parent)),
            "datastore": {"source": "Python standard library .py files outside test folders",
                          "tokens": int(len(store_tokens)), "files": files},
            "tokenizer": str(find_default_gguf().name),
            "git_sha": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      cwd=ROOT.parent).stdout.strip()}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": out_rows}, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
