"""Replay study of match-gated prompt-lookup rounds (CPU, float32, real SmolLM2-135M-Instruct): what a better k
policy or launching rounds ahead could gain on the grounded-text prompts of ``bench_speculative``.

The real engine runs (``accelerate_model(model, speculative="prompt_lookup")``, batch 1, greedy, 128 new tokens)
with the round times fixed to the H200 bf16 values measured by ``bench_speculative`` (``--times``; the CPU's own
timings would steer the chooser elsewhere). Each round's draft length k, the match class of its row and the
number of drafts accepted are logged. From that log:

* ``hindsight``: the rounds' time if each round had used the smallest candidate k that holds the drafts it
  accepted (a plain round where none was accepted; censored where all k were accepted: kept), for the same
  tokens: the bound of any k policy over these drafts;
* ``transitions``: after a round of each kind (plain; verify with class c; verify that accepted all its drafts),
  how often the next round was a verify round; and, two rounds ahead, how often round r + 2 was a verify round
  given round r and a verify round r + 1 of class c: what launching round r + 2 before round r + 1's counters
  arrive would have to predict.

``--k-max K --k-max-ms T`` replays with ``num_draft_tokens = K`` and the round of K drafts taking T ms (for a
draft length not timed on the GPU yet; with match gating a verify round drafts K), ``--category`` another prompt
category: comparing ``rounds_ms`` with the default run's (the same greedy tokens) tells up to which round time a
longer draft pays on these prompts.

    .venv/bin/python benchmarks/study_gated_rounds.py [--k-max 31 --k-max-ms 0.70] [--category grounded-code]
    # -> benchmarks/results/study_gated_rounds-cpu-<date>.json
"""
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.kernels.commit_tokens import INFO_CLASS_HIST, MAX_DRAFT, NUM_CLASSES  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402
from hf_accel.speculative import draft_length, engine as spec_engine  # noqa: E402

#: H200 bf16 round times (ms per round by k, host turnaround included) of bench_speculative at 50b3441
TIMES_MS = {0: 0.5232, 1: 0.6363, 2: 0.6013, 4: 0.5930, 8: 0.6333, 15: 0.6555}


class _FixedTimes(dict):
    def get(self, key, default=None):
        return {k: v / 1e3 for k, v in TIMES_MS.items()}


def run_log(k_max: int = 15, category: str = "grounded-text"):
    log, calls = [], []
    update = spec_engine.update_gated  # the engine module's name for round_counters.update_gated

    def logged(chooser, row, k, rounds, captured, timing):
        stride = MAX_DRAFT + 1
        hists = row[INFO_CLASS_HIST: INFO_CLASS_HIST + NUM_CLASSES * stride].reshape(NUM_CLASSES, stride)
        hists = hists[:, : k + 1].tolist()
        cls = [c for c in range(NUM_CLASSES) if any(hists[c])]
        acc = [v for c in range(NUM_CLASSES) for v in range(k + 1) if hists[c][v]]
        log.append((k, rounds, cls[0] if cls else -1, acc[0] if acc else -1))
        return update(chooser, row, k, rounds, captured, timing)

    spec_engine.update_gated = logged
    saved = draft_length._record_time
    draft_length._record_time = lambda times, k, seconds: None  # keep the H200 times
    try:
        model, tok = load_default_model(dtype="float32", device="cpu")
        hf_accel.accelerate_model(model, speculative=hf_accel.SpeculativeConfig("prompt_lookup",
                                                                                num_draft_tokens=k_max))
        (engine,) = model._hf_accel_spec_engines.values()
        engine.round_times = _FixedTimes()
        for text in bs.chat_texts(tok, category):
            ids, mask = bs.encode(tok, [text], "cpu")
            log.clear()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, do_sample=False)
            calls.append(list(log))
    finally:
        spec_engine.update_gated = update
        draft_length._record_time = saved
    return calls


def time_of(k: int) -> float:
    """Round time (ms) of k drafts: TIMES_MS, or linear between the nearest timed draft lengths around k."""
    if k in TIMES_MS:
        return TIMES_MS[k]
    lo = max(c for c in TIMES_MS if 0 < c < k)
    hi = min((c for c in TIMES_MS if c > k), default=lo)
    return TIMES_MS[lo] if hi == lo else TIMES_MS[lo] + (TIMES_MS[hi] - TIMES_MS[lo]) * (k - lo) / (hi - lo)


def analyse(calls):
    t_actual = t_hind = 0.0
    tokens = 0
    for log in calls:
        for k, rounds, _, acc in log:
            if k == 0:
                t_actual += rounds * TIMES_MS[0]
                t_hind += rounds * TIMES_MS[0]
                tokens += rounds
                continue
            t_actual += time_of(k)
            tokens += acc + 1
            if acc == 0:
                t_hind += TIMES_MS[0]
            elif acc == k:
                t_hind += time_of(k)
            else:
                t_hind += TIMES_MS[min(c for c in TIMES_MS if c >= acc)]
    nxt = collections.defaultdict(lambda: [0, 0])
    ahead = collections.defaultdict(lambda: [0, 0])
    for log in calls:
        for (k, _, c, a), (k2, *_) in zip(log, log[1:]):
            kind = "plain" if k == 0 else ("verify-all-accepted" if a == k else f"verify-class{c}")
            nxt[kind][0] += 1
            nxt[kind][1] += k2 > 0
        for x, y, z in zip(log, log[1:], log[2:]):
            if y[0] > 0:
                kind = f"{'plain' if x[0] == 0 else 'verify-all-accepted' if x[3] == x[0] else 'verify'}" \
                       f"-then-verify-class{y[2]}"
                ahead[kind][0] += 1
                ahead[kind][1] += z[0] > 0
    return {"rounds_ms": t_actual, "hindsight_ms": t_hind, "tokens": tokens,
            "next_round_verify": {k: {"rounds": n, "next_verify": v} for k, (n, v) in sorted(nxt.items())},
            "two_ahead_verify": {k: {"rounds": n, "verify_two_ahead": v} for k, (n, v) in sorted(ahead.items())}}


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--k-max", type=int, default=15)
    ap.add_argument("--k-max-ms", type=float, default=None, help="round time of k-max drafts (if not in TIMES_MS)")
    ap.add_argument("--category", default="grounded-text")
    args = ap.parse_args(argv)
    if args.k_max_ms is not None:
        TIMES_MS[args.k_max] = args.k_max_ms
    if args.k_max not in TIMES_MS:
        ap.error(f"no round time for k = {args.k_max}: give --k-max-ms")
    calls = run_log(args.k_max, args.category)
    result = analyse(calls)
    print({k: v for k, v in result.items() if not isinstance(v, dict)})
    for name in ("next_round_verify", "two_ahead_verify"):
        for k, v in result[name].items():
            print(f"  {name} {k}: {v}")
    shape = {"model": "smollm2-135m", "dtype": "float32", "device": "cpu", "bs": 1, "category": args.category,
             "max_new_tokens": 128, "prompts": len(calls), "round_times_ms": TIMES_MS, "k_max": args.k_max}
    rows = [{"bench": "study_gated_rounds", "provider": "ours-prompt_lookup", "shape": shape, "metric": m,
             "unit": "ms" if m.endswith("_ms") else "count", "value": v} for m, v in result.items()]
    rows.append({"bench": "study_gated_rounds", "provider": "ours-prompt_lookup", "shape": shape,
                 "metric": "round_log", "unit": "(k, rounds, class, accepted) per host sync", "value": calls})
    path = write_results("study_gated_rounds", rows)
    path.rename(path.with_name(path.name.replace("study_gated_rounds-", "study_gated_rounds-cpu-")))


if __name__ == "__main__":
    main()
