"""Host time of a batch-1 ``generate`` call by phase, without a profiler's per-op overhead (real SmolLM2 bf16, CUDA).

The functions a call passes through on the fast path (the ``generate`` wrapper's decisions, ``FastEngine.check``,
``start``, the prefill replay, the speculative engine's set-up ...) are wrapped with ``time.perf_counter`` stamps
(~1 us each). For each of the 8 grounded-text prompts of ``bench_speculative`` and each provider (our plain fast
path, prompt lookup), one-token and 128-token calls run ``--reps`` times after a warm-up; reported per function:
the median inclusive host time per call (``<name>_us``) and, per call, the time from entering ``generate`` to the
prefill graph's launch (``to_prefill_launch_us``), to the first decode graph's launch
(``to_first_decode_launch_us``), and the call's wall time (CUDA-synced at its end: ``wall_us``). The prefill runs
on the GPU from its launch, so everything before it is time the GPU waits for the host.

    python benchmarks/profile_call_phases.py [--reps 5]        # -> $OUT/profile_call_phases-<date>.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402

STAMPS: list[tuple[str, str, float]] = []


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)
    if getattr(fn, "_phase_wrapped", False):
        return

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        STAMPS.append((label, "in", time.perf_counter()))
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((label, "out", time.perf_counter()))

    wrapper._phase_wrapped = True
    setattr(owner, name, wrapper)


def install() -> None:
    from hf_accel.cache import paged_cache
    from hf_accel.engine import decode_step, eligibility, fast_generate
    from hf_accel.integrations import generate, patch
    from hf_accel.speculative import engine as spec_engine
    from hf_accel.speculative import registry

    targets = [
        (patch, "revert_if_lora_changed"), (generate, "assisted_config"), (generate, "_foreign_attention"),
        (generate, "_prepared_or_none"), (generate, "_skip_reason"), (generate, "_try_fast"),
        (generate, "_check_passed_length"), (generate, "expand_return_sequences"), (generate, "_run_fast"),
        (registry, "engine_for"), (eligibility, "snapshot_intact"),
        (eligibility.CallChecks, "check"), (eligibility.CallChecks, "_model_reason"),
        (fast_generate.FastEngine, "generate"),
        (fast_generate.FastEngine, "start"), (fast_generate.FastEngine, "_ensure_cache"),
        (fast_generate.FastEngine, "_step_for"), (fast_generate.FastEngine, "_prefill_bucketed"),
        (fast_generate.FastEngine, "_greedy_in_graph"), (fast_generate.FastEngine, "_output"),
        (fast_generate, "call_inputs"), (paged_cache.PagedCache, "memory_stats"),
        (paged_cache.PagedCache, "release"), (paged_cache.PagedCache, "allocate_pools"),
        (spec_engine.SpeculativeEngine, "check"), (spec_engine.SpeculativeEngine, "_generate"),
        (spec_engine.SpeculativeEngine, "_lookup_next"), (decode_step.DecodeStep, "init_greedy"),
    ]
    for owner, name in targets:
        if hasattr(owner, name):
            _wrap(owner, name, name)
    # graph launches: the prefill's and the decode steps' / rounds' replays
    orig_replay = torch.cuda.CUDAGraph.replay
    if getattr(orig_replay, "_phase_wrapped", False):
        return

    def replay(self):
        STAMPS.append(("graph_replay", "in", time.perf_counter()))
        return orig_replay(self)

    replay._phase_wrapped = True
    torch.cuda.CUDAGraph.replay = replay


def phases(stamps, t_enter: float) -> dict[str, float]:
    """Inclusive µs per wrapped function (summed over its calls), and the launch times relative to t_enter."""
    out: dict[str, float] = defaultdict(float)
    open_at: dict[str, list[float]] = defaultdict(list)
    replays = [t for label, kind, t in stamps if label == "graph_replay"]
    for label, kind, t in stamps:
        if label == "graph_replay":
            continue
        if kind == "in":
            open_at[label].append(t)
        elif open_at[label]:
            out[f"{label}_us"] += 1e6 * (t - open_at[label].pop())
    if replays:
        out["to_prefill_launch_us"] = 1e6 * (replays[0] - t_enter)
    if len(replays) > 1:
        out["to_first_decode_launch_us"] = 1e6 * (replays[1] - t_enter)
    out["graph_replays"] = len(replays)
    return dict(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script (float32, no fused path)")
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args(argv)
    if args.device != "cpu":
        require_cuda(__file__, "--device cpu checks the script on the CPU")
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, tok = load_default_model(dtype="bfloat16" if cuda else "float32", device=args.device)
    batches = [bs.encode(tok, [t], args.device) for t in bs.chat_texts(tok, "grounded-text")[: args.prompts]]
    rows = []
    for provider, spec in (("ours", None), ("ours-prompt_lookup", "prompt_lookup")):
        hf_accel.accelerate_model(model, **({"speculative": spec} if spec else {}))
        for ids, mask in batches:  # warm-up: graph captures, Triton compilation
            for n in (128, 1, 2) if cuda else (1,):
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        install()
        for new in (1, 128) if cuda else (1,):
            per: dict[str, list[float]] = defaultdict(list)
            for _ in range(args.reps):
                for ids, mask in batches:
                    sync()
                    STAMPS.clear()
                    t = time.perf_counter()
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
                    sync()
                    wall = 1e6 * (time.perf_counter() - t)
                    ph = phases(list(STAMPS), t)
                    ph["wall_us"] = wall
                    for k, v in ph.items():
                        per[k].append(v)
            shape = {"model": "smollm2-135m", "dtype": str(next(model.parameters()).dtype).split(".")[-1], "bs": 1,
                     "category": "grounded-text",
                     "max_new_tokens": new, "calls": len(per["wall_us"])}
            print(f"== {provider} max_new_tokens={new} ({len(per['wall_us'])} calls): median us", flush=True)
            for k in sorted(per, key=lambda k: -statistics.median(per[k])):
                med = statistics.median(per[k])
                print(f"{med:10.1f}  {k}", flush=True)
                rows.append({"bench": "profile_call_phases", "provider": provider, "shape": shape, "metric": k,
                             "unit": "count" if k == "graph_replays" else "us", "value": med})
        hf_accel.revert_model(model)
    write_results("profile_call_phases", rows)


if __name__ == "__main__":
    main()
