"""Host time of each CUDA-graph ``replay()`` and the GPU's idle time between consecutive replays, inside whole
``generate`` calls (real SmolLM2 bf16, CUDA; the 8 prompts of a ``bench_speculative`` category, grounded-text by
default, one per call at ``--bs 1`` or all 8 left-padded in one call at ``--bs 8``; 128 new tokens), plain fast
path vs prompt lookup. No profiler: ``torch.cuda.CUDAGraph.replay`` is wrapped
to read ``time.perf_counter`` around the call and to record a CUDA event right before and right after it
on the current stream.

Per provider (summed over the 8 calls, after two warm-up passes):

* ``replays``; ``replay_host_us`` (median, p90, sum in ms): host time inside ``replay()``;
* ``replay_gpu_ms_sum`` / ``replay_gpu_us_median``: GPU time from the event before a replay to the one after it
  (the graph's own run, once the GPU reached it); ``outside_ms``: ``call_ms`` minus the graphs' GPU time and
  the gaps between them (host time before the first replay and after the last one, and GPU work outside the
  graphs);
* ``gpu_gap_ms``: sum over consecutive replays of a call of (event before replay i+1) - (event after
  replay i), on the GPU's clock: when the host queued replay i+1 after replay i had finished on the GPU,
  that is GPU idle time (the host's turnaround plus whatever the host queued in between, which is small);
  ``gpu_gap_us`` median / p90 per gap;
* ``host_between_us``: median host time from the end of ``replay()`` i to the start of ``replay()`` i+1;
* ``sync_to_replay_us``: median host time from the return of the last ``torch.cuda.Event.synchronize`` to the
  next ``replay()`` (the host's own turnaround between rounds, where it waits for each round; wrapped too);
* ``first_replay_ms``: summed host time from entering ``generate`` to the first ``replay()`` (the prefill's):
  transformers' argument handling, our dispatch and checks, the cache set-up;
* ``call_ms``: wall time of the calls with the wrapper on (it adds two event records per replay).

Providers ``*-no-memo`` run with ``hf_accel.integrations.generation_config.REMEMBER = False`` (transformers
prepares the generation config on every call); the providers of ``--providers`` (default all four) in turns,
two passes (``shape['pass']``).

    python benchmarks/profile_replay_gaps.py [--bs 1|8] [--category grounded-text] [--providers ours,...]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402
import hf_accel.integrations.generation_config as gcm  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402


class ReplayLog:
    def __init__(self):
        self.on = False
        self.items = []  # (host t0, host t1, event before, event after)
        self.turnaround = []  # host seconds from an event sync's return to the next replay
        self.synced = None
        self._orig = torch.cuda.CUDAGraph.replay
        self._orig_sync = torch.cuda.Event.synchronize
        log = self

        def synchronize(event):
            out = log._orig_sync(event)
            log.synced = time.perf_counter()
            return out

        def replay(graph):
            if not log.on:
                return log._orig(graph)
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            if log.synced is not None:
                log.turnaround.append(t0 - log.synced)
                log.synced = None
            out = log._orig(graph)
            t1 = time.perf_counter()
            e1.record()
            log.items.append((t0, t1, e0, e1))
            return out

        torch.cuda.CUDAGraph.replay = replay
        torch.cuda.Event.synchronize = synchronize


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


ALL_VARIANTS = [("ours", None, True), ("ours-prompt_lookup", "prompt_lookup", True),
                ("ours-no-memo", None, False), ("ours-prompt_lookup-no-memo", "prompt_lookup", False)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--bs", type=int, choices=(1, 8), default=1)
    ap.add_argument("--category", default="grounded-text")
    ap.add_argument("--providers", default=",".join(v[0] for v in ALL_VARIANTS))
    args = ap.parse_args(argv)
    require_cuda(__file__)
    log = ReplayLog()
    model, tok = load_default_model(dtype="bfloat16", device="cuda")
    tok.padding_side = "left"  # a batch of prompts, as bench_speculative pads them
    texts = bs.chat_texts(tok, args.category)
    if args.bs == 1:
        batches = [bs.encode(tok, [t], "cuda") for t in texts]
    else:
        batches = [bs.encode(tok, texts[: args.bs], "cuda")]
    base = {"model": "smollm2-135m", "dtype": "bfloat16", "bs": args.bs, "category": args.category,
            "max_new_tokens": 128, "prompts": len(texts) if args.bs == 1 else args.bs}
    rows = []
    wanted = args.providers.split(",")
    variants = [v for v in ALL_VARIANTS if v[0] in wanted]
    seen = set()
    for provider, spec, memo in variants * 2:
        pass_ = int(provider in seen)
        seen.add(provider)
        gcm.REMEMBER = memo
        hf_accel.accelerate_model(model, **({"speculative": spec} if spec else {}))

        def gen(ids, mask):
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, do_sample=False)

        for _ in range(2):
            for ids, mask in batches:
                gen(ids, mask)
        host, gaps, between, call_ms, replays, first = [], [], [], 0.0, 0, 0.0
        graph_us = []
        log.turnaround = []
        for ids, mask in batches:
            log.items = []
            torch.cuda.synchronize()
            log.synced = None
            log.on = True
            t = time.perf_counter()
            gen(ids, mask)
            torch.cuda.synchronize()
            call_ms += 1e3 * (time.perf_counter() - t)
            log.on = False
            items = log.items
            if not items:
                raise SystemExit(f"{provider}: the call replayed no CUDA graph (not on the fast path?)")
            first += 1e3 * (items[0][0] - t)
            replays += len(items)
            host += [1e6 * (t1 - t0) for t0, t1, _, _ in items]
            graph_us += [1e3 * e0.elapsed_time(e1) for _, _, e0, e1 in items]
            for (_, a1, _, ea), (b0, _, eb, _) in zip(items, items[1:]):
                gaps.append(1e3 * ea.elapsed_time(eb))
                between.append(1e6 * (b0 - a1))
        vals = {"replays": replays, "call_ms": call_ms, "first_replay_ms": first,
                "replay_host_us_median": statistics.median(host), "replay_host_us_p90": pct(host, 0.9),
                "replay_host_ms_sum": sum(host) / 1e3,
                "gpu_gap_ms_sum": sum(gaps) / 1e3, "gpu_gap_us_median": statistics.median(gaps),
                "gpu_gap_us_p90": pct(gaps, 0.9),
                "replay_gpu_ms_sum": sum(graph_us) / 1e3, "replay_gpu_us_median": statistics.median(graph_us),
                "outside_ms": call_ms - sum(graph_us) / 1e3 - sum(gaps) / 1e3,
                "host_between_us_median": statistics.median(between),
                "host_between_us_p90": pct(between, 0.9),
                "sync_to_replay_us_median": 1e6 * statistics.median(log.turnaround) if log.turnaround else float("nan"),
                "sync_to_replay_us_p90": 1e6 * pct(log.turnaround, 0.9) if log.turnaround else float("nan"),
                "sync_to_replay_count": len(log.turnaround)}
        print(provider, pass_, {k: round(v, 2) for k, v in vals.items()}, flush=True)
        for metric, value in vals.items():
            unit = "count" if metric in ("replays", "sync_to_replay_count") else ("ms" if "_ms" in metric else "us")
            rows.append({"bench": "profile_replay_gaps", "provider": provider, "shape": {**base, "pass": pass_},
                         "metric": metric,
                         "unit": unit, "value": value})
        hf_accel.revert_model(model)
    write_results("profile_replay_gaps", rows)


if __name__ == "__main__":
    main()
