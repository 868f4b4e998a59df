"""Offline simulation of the adaptive draft-length chooser of prompt-lookup speculative decoding.

Data: the prompts and greedy continuations (SmolLM2-135M-Instruct, CPU, float32, 161 tokens, not stopped at
EOS) that ``study_prompt_lookup.py`` stored in ``results/study_prompt_lookup-cpu-20261201.json``: 8 prompts of
each category (grounded-text, grounded-code, open-ended). Replay is exact for greedy: a verify round with k
drafts (``ngram_lookup_ref``, max_ngram 3, min_ngram 1) accepts the longest valid draft prefix equal to the
continuation (n) and commits n + 1 tokens (fewer at EOS or at ``max_new_tokens`` = 128), as ``commit_tokens``;
a plain round (k = 0) commits one token.

The engine's host loop is replayed as ``SpeculativeEngine.generate`` runs it on the GPU: one round queued
ahead (``choose`` for round r + 1 runs before ``update`` for round r), plain rounds in bursts (``seconds`` per
round), the histogram of accepted drafts as ``update`` gets it, the rounds queued after the row finished
(they cost GPU time too). ``seconds`` comes from a round-time model (below); the first round, and (with
``--none-first-use``, the default) the first round of each k, pass None, as freshly captured graphs do.

Time models (ms, H200 bf16 bs1-like): A) plain 0.92, k > 0: 0.95 + 0.003 k; B) plain 0.92, 0.97 + 0.006 k;
C) plain 0.98, 1.0 + 0.004 k. Time to first token 4 ms per call. Speedup per category =
sum(4 + tokens x plain) / sum(4 + simulated time) over its prompts (tokens: new tokens incl. the prefill one).

Time model D is the kernels' graph replays (plain 0.486 ms; verify 0.793 + 0.0026 k ms); E is whole engine
rounds at 88accfb (plain decoding 0.488 ms per token; the engine's plain round 0.540, verify round 0.845 +
0.0023 k ms).

Policies: see ``POLICIES`` (the current ``_KChooser`` imported from the engine, and variants of it), the
match-gated loop (``g_match_gated_gap*``: the engine's ``_GatedChooser``, each round chosen from the class of
its own lookup, no lag, a host turnaround of 0 / 0.02 / 0.04 ms added to every host sync; ``_no_bursts``:
one plain round per sync, as before plain bursts), and two clairvoyant
ceilings (``z_oracle_*``: the best k sequence knowing every outcome; not attainable).
A policy "passes" if, under all three time models, its speedup is >= 5% above the current chooser's on
grounded-code and no worse than -2% on grounded-text and open-ended.

    .venv/bin/python benchmarks/simulate_k_chooser.py   # -> results/simulate_k_chooser-cpu-20261201.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import hf_accel.speculative.draft_length as eng  # noqa: E402
from hf_accel.kernels.commit_tokens import NUM_CLASSES  # noqa: E402
from hf_accel.kernels.ngram_lookup import ngram_lookup_ref  # noqa: E402
from hf_accel.speculative.draft_length import _GatedChooser, _KChooser, _candidates  # noqa: E402

sys.path.insert(0, str(ROOT))
from study_prompt_lookup import commit_count  # noqa: E402

CATEGORIES = ("grounded-text", "grounded-code", "open-ended")
DATA = ROOT / "results" / "study_prompt_lookup-cpu-20261201.json"
EOS = {2}  # <|im_end|> of SmolLM2-Instruct (generation_config.eos_token_id); checked in main()
K_MAX = 15
MAX_NEW = 128
TTFT_MS = 4.0
DRAFT_COST = 0.03  # SpeculativeEngine._draft_cost() for prompt lookup
TIME_MODELS = {
    "A": (0.92, 0.95, 0.003),  # plain ms, verify intercept ms, per draft ms
    "B": (0.92, 0.97, 0.006),
    "C": (0.98, 1.00, 0.004),
    # today's kernels: graph replays back to back, profile_generate_call-20261201-662919e.json (plain 0.486,
    # verify over 2 / 16 tokens 0.796 / 0.833 ms)
    "D": (0.486, 0.793, 0.0026),
    # whole engine rounds, profile_speculative_round at 88accfb (plain step 0.488; a plain round of the
    # speculative engine 0.533-0.540 and a verify round 0.874-0.888 ms, commit and lookup included): the
    # fourth entry is the engine's plain-round time where it differs from plain decoding's step
    "E": (0.488, 0.845, 0.0023, 0.540),
}
GATED_GAP_MS = (0.0, 0.02, 0.04)  # host turnaround per round of the match-gated loop (no round in flight)


def round_ms(model: str, k: int) -> float:
    plain, a, b, *k0 = TIME_MODELS[model]
    return (k0[0] if k0 else plain) if k == 0 else a + b * k


# --- data ---------------------------------------------------------------------------------------------------

def load_rows():
    d = json.loads(DATA.read_text())
    rows = {c: [] for c in CATEGORIES}
    for key, v in d["continuations"].items():
        cat, i = key.rsplit("/", 1)
        rows[cat].append((int(i), v["prompt"], v["continuation"]))
    return {c: [(p, ct) for _, p, ct in sorted(r)] for c, r in rows.items()}


def match_table(prompt: list[int], cont: list[int], k_max: int = K_MAX, with_ngram: bool = False):
    """For each committed output length j (tokens of cont committed), how many of the k_max prompt-lookup
    drafts (``ngram_lookup_ref`` on prompt + cont[:j]) equal the greedy continuation, valid prefix only.
    A round with k <= k_max drafts then accepts min(table[j], k) (the k drafts are a prefix of the k_max ones).
    With ``with_ngram`` also the matched n-gram length at each j (the match class, 0 = none)."""
    p = len(prompt)
    full = torch.tensor([prompt + cont], dtype=torch.long)
    out, ngrams = [], []
    for j in range(1, MAX_NEW + 1):
        length = p + j
        tokens = full[:, :length].clone()
        d, v, ng = ngram_lookup_ref(tokens, torch.tensor([length]), torch.tensor([0]), k_max, with_ngram=True)
        target = cont[j: j + k_max]
        n = 0
        while n < k_max and bool(v[0, n]) and int(d[0, n]) == target[n]:
            n += 1
        out.append(n)
        ngrams.append(min(int(ng[0]), NUM_CLASSES - 1))
    return (out, ngrams) if with_ngram else out


# --- policies -------------------------------------------------------------------------------------------------

def variant(prior: float = 1 / 3, shrink: float = 2.0, decay: float = 0.9, fit_time: bool = False,
            explore_every: int = 0, ks: list[int] | None = None, fixed: bool = False, name: str = "V"):
    """A ``_KChooser`` (the engine's class) with one or more changes:

    prior / shrink / decay: the hazard prior (engine: 1/3), the shrinkage pseudo-rounds (engine:
        ``_SHRINK`` = 2) and the per-round decay of the histograms (engine: ``_DECAY`` = 0.9);
    fit_time: an unmeasured k > 0 is priced on the line through the smallest and the largest measured
        verify rounds (k > 0) once two are measured (the engine scales the draft-cost prior, 0.03 of a step
        per draft for prompt lookup, from the smallest measured k, so a k never tried stays overpriced);
    explore_every: every n-th drafting round uses k_max (positions past the chosen k are censored);
    ks: other candidates; fixed: adaptive=False (k = k_max always)."""
    shrink_, decay_ = shrink, decay

    class V(_KChooser):
        prior_hazard = prior
        shrink = shrink_
        decay = decay_

        def __init__(self, k_max, adaptive, draft_cost):
            super().__init__(k_max, adaptive and not fixed, draft_cost)
            if ks is not None and self.adaptive:
                self.ks = list(ks)
            self.n_spec = 0

        def time(self, k: int) -> float:
            if fit_time and k > 0 and k not in self.times:
                ver = sorted((kk, t) for kk, t in self.times.items() if kk > 0)
                if len(ver) >= 2:
                    (k1, t1), (k2, t2) = ver[0], ver[-1]
                    return t1 + max(0.0, (t2 - t1) / (k2 - k1)) * (k - k1)
            return super().time(k)

        def choose(self, max_remaining, burst=True):
            k, r = super().choose(max_remaining, burst)
            if explore_every and k > 0 and self.adaptive:
                self.n_spec += 1
                if self.n_spec % explore_every == 0:
                    return self.k_max, 1
            return k, r

    V.__name__ = name
    return V


def draft_cost_variant(dc: float):
    """The engine's chooser with another draft-cost prior (``SpeculativeEngine._draft_cost``, not the chooser)."""
    class D(_KChooser):
        def __init__(self, k_max, adaptive, draft_cost):
            super().__init__(k_max, adaptive, dc)
    return D


POLICIES = {
    "a_current": _KChooser,  # the engine's class itself
    "a_replica": variant(name="replica"),  # check: must equal a_current
    "b_fixed15": variant(fixed=True),
    "c_0_or_15": variant(ks=[0, K_MAX]),
    "d_prior0.15": variant(prior=0.15),
    "d_prior0.1": variant(prior=0.1),
    "d_shrink1": variant(shrink=1.0),
    "d_prior0.15_shrink1": variant(prior=0.15, shrink=1.0),
    "d_decay0.95": variant(decay=0.95),
    "e_fit_time": variant(fit_time=True),
    "e_explore_kmax_every4": variant(explore_every=4),
    "e_explore_kmax_every8": variant(explore_every=8),
    "e_ks_0_4_8_15": variant(ks=[0, 4, 8, K_MAX]),
    "de_prior0.15_fit_time": variant(prior=0.15, fit_time=True),
    "de_prior0.15_fit_time_decay0.95": variant(prior=0.15, fit_time=True, decay=0.95),
    "de_prior0.15_fit_time_explore8": variant(prior=0.15, fit_time=True, explore_every=8),
    "de_prior0.15_fit_time_ks_0_4_8_15": variant(prior=0.15, fit_time=True, ks=[0, 4, 8, K_MAX]),
    "x_draft_cost_prior0.005": draft_cost_variant(0.005),  # outside _KChooser: _draft_cost()
    "x_draft_cost_prior0.005_prior0.15": None,  # filled below
}


class _Dc005Prior015(variant(prior=0.15)):
    def __init__(self, k_max, adaptive, draft_cost):
        super().__init__(k_max, adaptive, 0.005)


POLICIES["x_draft_cost_prior0.005_prior0.15"] = _Dc005Prior015


def oracle(prompt, cont, table, tm: str, ks) -> dict:
    """Clairvoyant ceiling: the k sequence (from ``ks``) of least total time, knowing every round's outcome,
    no lag, no rounds after the finish (dynamic programming over (committed, remaining))."""
    import functools

    @functools.lru_cache(None)
    def best(j, rem):
        res = None
        for k in ks:
            n = min(table[j - 1], k) if k > 0 else 0
            count, fin = commit_count(cont[j: j + k + 1], n, rem, EOS)
            fin = fin or rem - count <= 0
            tail = (0.0, j + count) if fin else best(j + count, rem - count)
            v = round_ms(tm, k) + tail[0]
            if res is None or v < res[0]:
                res = (v, tail[1])
        return res

    if cont[0] in EOS:
        return {"tokens": 1, "sim_ms": 0.0, "plain_decode_ms": TIME_MODELS[tm][0]}
    v, tokens = best(1, MAX_NEW - 1)
    return {"tokens": tokens, "sim_ms": v, "plain_decode_ms": tokens * TIME_MODELS[tm][0]}


# --- replay -------------------------------------------------------------------------------------------------

def simulate(prompt, cont, table, policy_cls, tm: str, ahead: int = 1, none_first_use: bool = True,
             trace: bool = False) -> dict:
    chooser = policy_cls(K_MAX, True, DRAFT_COST)
    j = 1  # output tokens committed (the prefill token)
    remaining = MAX_NEW - 1
    active = remaining > 0 and cont[0] not in EOS
    running, max_remaining = active, MAX_NEW - 1
    inflight = []
    used = set()
    first = True
    t_ms = 0.0
    ks_count: dict[int, int] = {}
    verify_rounds = plain_rounds = 0
    log = []
    while running:
        k, rounds = chooser.choose(max_remaining)
        ks_count[k] = ks_count.get(k, 0) + rounds
        hist = [0] * (k + 1)
        for _ in range(rounds):  # the rounds run on the device state now
            t_ms += round_ms(tm, k)
            if not active:
                if k > 0:
                    verify_rounds += 1
                else:
                    plain_rounds += 1
                continue  # a finished row: the round runs, commits nothing, counts nothing
            n = min(table[j - 1], k) if k > 0 else 0
            count, finished = commit_count(cont[j: j + k + 1], n, remaining, EOS)
            j += count
            remaining -= count
            active = not finished and remaining > 0
            if k > 0:
                verify_rounds += 1
            else:
                plain_rounds += 1
            hist = [0] * (k + 1)
            hist[n] = 1  # info of the last of the rounds (plain bursts: all zero but hist[0])
        captured = none_first_use and k not in used
        used.add(k)
        inflight.append((k, rounds, captured, hist, active, remaining if active else 0))
        if len(inflight) <= ahead:
            continue
        k0, r0, cap0, hist0, act0, rem0 = inflight.pop(0)
        seconds = None if (cap0 or first) else round_ms(tm, k0) / 1e3
        first = False
        chooser.update(k0, hist0, seconds)
        running, max_remaining = act0, rem0
        if trace:
            log.append((k0, hist0.index(1) if 1 in hist0 else None))
    tokens = j
    plain_ms = TIME_MODELS[tm][0]
    return {"tokens": tokens, "verify_rounds": verify_rounds, "plain_rounds": plain_rounds, "sim_ms": t_ms,
            "plain_decode_ms": tokens * plain_ms, "ks": ks_count, **({"trace": log} if trace else {})}


def simulate_gated(prompt, cont, table, ngrams, tm: str, gap_ms: float, none_first_use: bool = True,
                   bursts: bool = True) -> dict:
    """The match-gated loop (``SpeculativeConfig.match_gated``): each round is chosen by the engine's
    ``_GatedChooser`` from the class of the lookup made for it, the host waits for every round, and every
    round costs ``gap_ms`` more (the host's turnaround between rounds; its measured round times include it
    too). As in the engine, a round's counters update the chooser after the next round is launched, so a
    choice sees the classes of its own round and the acceptance of the rounds before the last."""
    chooser = _GatedChooser(K_MAX, DRAFT_COST)
    j, remaining = 1, MAX_NEW - 1
    active = remaining > 0 and cont[0] not in EOS
    used, first, t_ms = set(), True, 0.0
    ks_count: dict[int, int] = {}
    verify_rounds = plain_rounds = 0
    pending = None
    while active:
        counts = [0] * NUM_CLASSES
        counts[ngrams[j - 1]] = 1
        k, rounds = chooser.choose(counts, remaining, burst=bursts)
        ks_count[k] = ks_count.get(k, 0) + rounds
        ms = round_ms(tm, k) * rounds + gap_ms
        t_ms += ms
        hists = [[0] * (k + 1) for _ in range(NUM_CLASSES)]
        for _ in range(rounds):  # the rounds of a plain burst commit one token each; rounds past the end cost too
            if not active:
                break
            n = min(table[j - 1], k) if k > 0 else 0
            hists[ngrams[j - 1]][n] += 1
            count, finished = commit_count(cont[j: j + k + 1], n, remaining, EOS)
            j += count
            remaining -= count
            active = not finished and remaining > 0
        verify_rounds += rounds if k > 0 else 0
        plain_rounds += rounds if k == 0 else 0
        captured = none_first_use and k not in used
        used.add(k)
        if pending is not None:
            chooser.update(*pending)
        pending = (k, hists, None if (captured or first) else ms / 1e3 / rounds)
        first = False
    return {"tokens": j, "verify_rounds": verify_rounds, "plain_rounds": plain_rounds, "sim_ms": t_ms,
            "plain_decode_ms": j * TIME_MODELS[tm][0], "ks": ks_count}


def run_gated(rows, tables, ngrams, none_first_use=True):
    res = {}
    for gap, bursts in [(gap, True) for gap in GATED_GAP_MS] + [(GATED_GAP_MS[1], False)]:
        name = f"g_match_gated_gap{gap}" + ("" if bursts else "_no_bursts")
        res[name] = {}
        for tm in TIME_MODELS:
            res[name][tm] = {}
            for cat in CATEGORIES:
                res[name][tm][cat] = summarise([simulate_gated(p, c, t, g, tm, gap, none_first_use, bursts)
                                                for (p, c), t, g in zip(rows[cat], tables[cat], ngrams[cat])])
    return res


def summarise(per: list[dict]) -> dict:
    """One category's totals over its prompts' replays, and the speedup over plain decoding."""
    sim = sum(TTFT_MS + r["sim_ms"] for r in per)
    base = sum(TTFT_MS + r["plain_decode_ms"] for r in per)
    ks: dict[int, int] = {}
    for r in per:
        for k, v in r["ks"].items():
            ks[k] = ks.get(k, 0) + v
    return {"tokens": sum(r["tokens"] for r in per), "verify_rounds": sum(r["verify_rounds"] for r in per),
            "plain_rounds": sum(r["plain_rounds"] for r in per), "sim_ms": round(sim, 3), "plain_ms": round(base, 3),
            "speedup": round(base / sim, 4), "draft_lengths": {str(k): v for k, v in sorted(ks.items())}}


def run_all(rows, tables, ahead=1, none_first_use=True):
    res = {}
    for name, cls in POLICIES.items():
        res[name] = {}
        for tm in TIME_MODELS:
            res[name][tm] = {}
            for cat in CATEGORIES:
                res[name][tm][cat] = summarise([simulate(p, c, t, cls, tm, ahead, none_first_use)
                                                for (p, c), t in zip(rows[cat], tables[cat])])
    for oname, ks in (("z_oracle_all_candidates", _candidates(K_MAX)), ("z_oracle_0_or_15", [0, K_MAX])):
        res[oname] = {}
        for tm in TIME_MODELS:
            res[oname][tm] = {}
            for cat in CATEGORIES:
                per = [oracle(p, c, t, tm, tuple(ks)) for (p, c), t in zip(rows[cat], tables[cat])]
                sim = sum(TTFT_MS + r["sim_ms"] for r in per)
                base = sum(TTFT_MS + r["plain_decode_ms"] for r in per)
                res[oname][tm][cat] = {"tokens": sum(r["tokens"] for r in per), "sim_ms": round(sim, 3),
                                       "plain_ms": round(base, 3), "speedup": round(base / sim, 4),
                                       "note": "clairvoyant ceiling, not a policy"}
    return res


def verdict(res, ref="a_current"):
    out = {}
    for name in res:
        if name == ref or name.startswith("z_oracle"):
            continue
        rel = {tm: {cat: res[name][tm][cat]["speedup"] / res[ref][tm][cat]["speedup"] - 1 for cat in CATEGORIES}
               for tm in TIME_MODELS}
        ok = all(rel[tm]["grounded-code"] >= 0.05 and rel[tm]["grounded-text"] >= -0.02
                 and rel[tm]["open-ended"] >= -0.02 for tm in TIME_MODELS)
        out[name] = {"relative_to_current": {tm: {c: round(v, 4) for c, v in r.items()} for tm, r in rel.items()},
                     "passes_criterion": ok}
    return out


def _git_sha() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "simulate_k_chooser-cpu-20261201.json"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    assert _candidates(K_MAX) == [0, 1, 2, 4, 8, 15], _candidates(K_MAX)
    rows = load_rows()
    both = {c: [match_table(p, ct, with_ngram=True) for p, ct in rows[c]] for c in CATEGORIES}
    tables = {c: [t for t, _ in both[c]] for c in CATEGORIES}
    ngrams = {c: [g for _, g in both[c]] for c in CATEGORIES}
    res = run_all(rows, tables)
    res.update(run_gated(rows, tables, ngrams))
    sens = {"engine_timing_only_first_round_none": run_all(rows, tables, none_first_use=False),
            "no_lag": run_all(rows, tables, ahead=0)}
    ver = verdict(res)
    for name in res:
        print(f"{name:>24} " + "  ".join(
            f"{tm}: " + "/".join(f"{res[name][tm][c]['speedup']:.3f}" for c in CATEGORIES) for tm in TIME_MODELS)
            + ("  PASS" if name in ver and ver[name]["passes_criterion"] else ""))
    for sname, s in sens.items():
        print(f"-- sensitivity: {sname}")
        for name in s:
            if name.startswith("z_oracle"):
                continue
            print(f"{name:>24} " + "  ".join(
                f"{tm}: " + "/".join(f"{s[name][tm][c]['speedup']:.3f}" for c in CATEGORIES) for tm in TIME_MODELS))
    if not args.no_write:
        result = {"meta": {"data": str(DATA.relative_to(ROOT.parent)), "k_max": K_MAX, "candidates": _candidates(K_MAX),
                           "max_new_tokens": MAX_NEW, "ttft_ms": TTFT_MS, "time_models_ms": TIME_MODELS,
                           "draft_cost_prior": DRAFT_COST, "eos": sorted(EOS), "lag": 1,
                           "gated_gap_ms": GATED_GAP_MS, "git_sha": _git_sha(),
                           "shrink": eng._SHRINK, "decay": eng._DECAY,
                           "none_first_use": True,
                           "note": "fp32 CPU greedy continuations replayed; the GPU runs bf16 (outputs differ); "
                                   "round times are a model, not measurements"},
                  "results": res, "verdict_vs_current": ver, "sensitivity": sens}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
