"""Replay study of prompt lookup at batch > 1 (CPU, float32, real SmolLM2-135M-Instruct): how the draft-length
chooser's acceptance model decides whether verify rounds pay when the rows of a batch accept differently.

At batch > 1 the rounds run for every active row together, so a call lasts as many rounds as its slowest row
needs; the chooser (:class:`~hf_accel.speculative.draft_length._KChooser`) models acceptance from the
histogram of accepted drafts over the active rows, the slowest ``BATCH_ROWS_FRACTION`` of them. This study runs the real engine
(``accelerate_model(model, speculative="prompt_lookup")``, the ``bench_speculative`` prompts of a category as
one left-padded batch, greedy, 128 new tokens) with the round times fixed to H200 bf16 values of batch 8
(``--times``) and replays it with the acceptance model fed

* ``mean``: every active row (``BATCH_ROWS_FRACTION = 1``, the chooser before 3 December);
* ``slowest-<q>``: only the fraction ``q`` of active rows that accepted the fewest drafts in each round
  (``BATCH_ROWS_FRACTION = q``; the library's default is 0.5).

For each, ``rounds_ms`` (sum of the fixed round times over the rounds run) against ``plain_ms`` (the longest
row's new tokens x the plain round time: float32 greedy is the plain path's output, so a plain decode needs
exactly that many steps). Their ratio is the speedup the rounds alone would give on the GPU.

    .venv/bin/python benchmarks/study_batch_rounds.py [--category grounded-code] [--policies mean,slowest-0.25]
    # -> benchmarks/results/study_batch_rounds-cpu-<date>.json
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402
from hf_accel.speculative import draft_length  # noqa: E402

#: H200 bf16 round times at batch 8 (ms per round by k), bench_speculative at 3da9682 (round_ms, passages / code)
TIMES_MS = {0: 0.62, 1: 0.95, 2: 0.96, 4: 1.03, 8: 1.08, 15: 1.15}


def run(model, tok, category: str, policy: str, batch: int):
    log = []
    orig_fraction = draft_length.BATCH_ROWS_FRACTION
    draft_length.BATCH_ROWS_FRACTION = 1.0 if policy == "mean" else float(policy.split("-", 1)[1])
    orig_choose = draft_length._KChooser.choose

    def choose(self, max_remaining, burst=True):
        self.times = {k: v / 1e3 for k, v in TIMES_MS.items()}  # the fixed times, whatever the CPU measured
        out = orig_choose(self, max_remaining, burst)
        log.append(out)
        return out

    draft_length._KChooser.choose = choose
    try:
        ids, mask = bs.encode(tok, bs.chat_texts(tok, category)[:batch], "cpu")
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, do_sample=False)
    finally:
        draft_length._KChooser.choose = orig_choose
        draft_length.BATCH_ROWS_FRACTION = orig_fraction
    generated = out.shape[1] - ids.shape[1]
    rounds_ms, ks = 0.0, {}
    for k, rounds in log:  # every choice of the call: k and how many rounds of it
        rounds_ms += rounds * TIMES_MS[k]
        ks[k] = ks.get(k, 0) + rounds
    return {"rounds_ms": rounds_ms, "plain_ms": generated * TIMES_MS[0], "generated": generated,
            "speedup": generated * TIMES_MS[0] / rounds_ms, "rounds_per_k": ks, "out": out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--categories", default="grounded-text,grounded-code,open-ended")
    ap.add_argument("--policies", default="mean,slowest-0.25,slowest-0.5")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    model, tok = load_default_model(dtype="float32", device="cpu")
    tok.padding_side = "left"
    hf_accel.accelerate_model(model, speculative=hf_accel.SpeculativeConfig("prompt_lookup"))
    rows = []
    for category in args.categories.split(","):
        ref = None
        for policy in args.policies.split(","):
            r = run(model, tok, category, policy, args.batch)
            out = r.pop("out")
            same = ref is None or torch.equal(ref, out)
            ref = out if ref is None else ref
            print(f"{category:14s} {policy:13s} rounds {r['rounds_ms']:7.1f} ms  plain {r['plain_ms']:7.1f} ms  "
                  f"speedup {r['speedup']:.2f}  rounds/k {r['rounds_per_k']}  same tokens {same}")
            shape = {"model": "smollm2-135m", "dtype": "float32", "device": "cpu", "bs": args.batch,
                     "category": category, "max_new_tokens": 128, "round_times_ms": TIMES_MS, "policy": policy}
            for m in ("rounds_ms", "plain_ms", "speedup", "generated", "rounds_per_k"):
                rows.append({"bench": "study_batch_rounds", "provider": "ours-prompt_lookup", "shape": shape,
                             "metric": m, "unit": "ms" if m.endswith("_ms") else "count", "value": r[m],
                             "same_tokens_as_first_policy": same})
    path = write_results("study_batch_rounds", rows)
    path.rename(path.with_name(path.name.replace("study_batch_rounds-", "study_batch_rounds-cpu-")))


if __name__ == "__main__":
    main()
