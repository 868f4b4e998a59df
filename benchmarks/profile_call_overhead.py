"""Where the fixed cost of a batch-1 ``generate`` call goes (real SmolLM2 bf16, CUDA): host vs GPU.

For the plain fast path and prompt lookup, on the grounded-text prompts of ``bench_speculative``:

* ``generate_1_ms`` / ``generate_2_ms``: wall time (CUDA-synced, median of 9) of ``generate`` with
  ``max_new_tokens`` 1 and 2; their difference is one decode round, the rest is the call's fixed cost;
* ``start_ms``: ``FastEngine.start`` alone (cache reservation, block tables, bucketed prefill);
* ``prefill_gpu_ms``: the prefill graph's replay alone, timed with CUDA events (GPU time);
* ``wrapper_ms``: from entering ``model.generate`` to entering ``FastEngine.start`` (transformers'
  argument handling, our dispatch and checks), measured by wrapping ``start`` on the instance.

Also writes, under ``$OUT`` (or a temporary folder), cProfile dumps of 20 one-token calls per provider
(``call_<provider>.prof``, read with ``pstats``) and a Chrome trace of one call each
(``trace_<provider>.json``, torch.profiler, CPU + CUDA) for reading offline; with ``--stack``, the trace is of one
128-token call with Python functions recorded too (``with_stack``; ``trace_<provider>.json.gz``).

Also: the prefill graph's GPU time and the host time of its ``replay()`` for ``PREFILL_NUM_SPLITS`` None / 1 / 2,
the host time of a decode step's replay, and with ``--ab-copies`` the call timings again with the EOS ids
copied from pageable host memory at every call, as before ``hf_accel.engine.transfers`` (providers
``*-blocking-copies``; the four providers interleaved, two passes, ``shape['pass']``).

With ``--timings-only`` it skips the prefill variants, the cProfile dumps and the traces, and runs the two
providers ``--passes N`` times, interleaved (default 1): for an A/B of two trees run one after the other.

    python benchmarks/profile_call_overhead.py [--ab-copies] [--timings-only] [--passes N] [--stack]
"""
import argparse
import cProfile
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import require_cuda, write_results  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.engine.fast_generate import prefill_bucket  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402


def sync():
    torch.cuda.synchronize()


def median_ms(fn, reps):
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def time_replay(graph, reps):
    """(GPU ms, host ms): medians over ``reps`` replays of a captured graph, synced before each; the GPU time from
    CUDA events around the replay, the host time of the ``replay()`` call itself."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    gpu, host = [], []
    for _ in range(reps):
        sync()
        ev[0].record()
        t = time.perf_counter()
        graph.replay()
        host.append(1e3 * (time.perf_counter() - t))
        ev[1].record()
        sync()
        gpu.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(gpu), statistics.median(host)


def blocking_fill(dst, values, pad):
    """The EOS write as before ``transfers.fill_from_host``: from a pageable host tensor, so PyTorch syncs the
    stream (the host waits for the queued prefill)."""
    values = list(values)
    dst.copy_(torch.tensor(values + [pad] * (dst.numel() - len(values)), dtype=dst.dtype))
    return dst


def set_blocking_copies(on: bool):
    import hf_accel.engine.decode_step as ds
    import hf_accel.speculative.engine as se
    from hf_accel.engine.transfers import fill_from_host
    for mod in (ds, se):
        mod.fill_from_host = blocking_fill if on else fill_from_host


def forget_eos(model):
    """Make the next call write its EOS ids again (they are kept while unchanged): the blocking variant then
    pays its copy every call, as before."""
    for step in model._hf_accel_engine.steps.values():
        step._greedy_eos = None
    for engine in model.__dict__.get("_hf_accel_spec_engines", {}).values():
        for st in engine.states.values():
            st.eos_ids = None


def prefill_variants(model, batches, rows, base):
    """GPU time of the bucketed prefill graph (CUDA events, median of 20 replays) and host time of its
    ``replay()`` call, for PREFILL_NUM_SPLITS None (the kernel's default) / 1 / 2; the host time of a decode
    step's replay."""
    from hf_accel.engine import step_switches
    hf_accel.accelerate_model(model)
    fast = model._hf_accel_engine
    saved = step_switches.PREFILL_NUM_SPLITS
    for splits in (None, 1, 2):
        step_switches.PREFILL_NUM_SPLITS = splits
        for step in fast.steps.values():
            for key in [k for k in step.graphs if isinstance(k, tuple) and k and k[0] == "prefill"]:
                del step.graphs[key]
        for i, (ids, mask) in enumerate(batches[:4]):
            with torch.inference_mode():
                step, _ = fast.start(ids, mask, 128)  # captures this variant's prefill graph
                graph, _ = step.graphs[("prefill", prefill_bucket(ids.shape[1]))]
                gpu, host = time_replay(graph, 20)
                fast.cache.release()
            shape = {**base, "prompt_len": ids.shape[1], "prompt_index": i,
                     "prefill_len": prefill_bucket(ids.shape[1]), "prefill_num_splits": splits}
            vals = {"prefill_gpu_ms": gpu, "prefill_replay_host_ms": host}
            print("prefill splits", splits, i, {k: round(v, 4) for k, v in vals.items()}, flush=True)
            for metric, value in vals.items():
                rows.append({"bench": "profile_call_overhead", "provider": "ours", "shape": shape, "metric": metric,
                             "unit": "ms", "value": value})
    step_switches.PREFILL_NUM_SPLITS = saved
    # host time of one decode-step graph launch (the greedy step of the last prompt's shape)
    ids, mask = batches[0]
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    step = next(s for s in fast.steps.values() if s.graph_greedy is not None)
    host = []
    for _ in range(20):
        sync()
        t = time.perf_counter()
        step.graph_greedy.replay()
        host.append(1e3 * (time.perf_counter() - t))
        sync()
    rows.append({"bench": "profile_call_overhead", "provider": "ours", "shape": {**base, "step": "decode"},
                 "metric": "decode_replay_host_ms", "unit": "ms", "value": statistics.median(host)})
    print("decode step replay host ms", statistics.median(host), flush=True)
    hf_accel.revert_model(model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ab-copies", action="store_true",
                    help="the call timings again with the EOS ids copied from pageable host memory")
    ap.add_argument("--timings-only", action="store_true", help="no prefill variants, cProfile dumps or traces")
    ap.add_argument("--passes", type=int, default=1, help="interleaved passes of the two providers")
    ap.add_argument("--stack", action="store_true", help="trace one 128-token call with Python functions")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp())
    model, tok = load_default_model(dtype="bfloat16", device="cuda")
    batches = [bs.encode(tok, [t], "cuda") for t in bs.chat_texts(tok, "grounded-text")]
    rows = []
    base = {"model": "smollm2-135m", "dtype": "bfloat16", "bs": 1}

    blocking_now = [False]

    def gen(ids, mask, n):
        if blocking_now[0]:
            forget_eos(model)
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)

    timings_only, passes = args.timings_only, args.passes
    if not timings_only:
        prefill_variants(model, batches, rows, base)
    variants = [("ours", None, False), ("ours-prompt_lookup", "prompt_lookup", False)] * passes
    if args.ab_copies:  # interleaved, twice: the GPU host's speed drifts between passes
        variants = [("ours", None, False), ("ours-blocking-copies", None, True),
                    ("ours-prompt_lookup", "prompt_lookup", False),
                    ("ours-prompt_lookup-blocking-copies", "prompt_lookup", True)] * 2
    seen = {}
    for provider, spec, blocking in variants:
        n_pass = seen.get(provider, 0)
        repeat = n_pass > 0
        seen[provider] = n_pass + 1
        set_blocking_copies(blocking)
        blocking_now[0] = blocking
        hf_accel.accelerate_model(model, **({"speculative": spec} if spec else {}))
        fast = model._hf_accel_engine
        for ids, mask in batches:  # warm-up: graph captures, Triton compilation
            gen(ids, mask, 128)
            gen(ids, mask, 1)
            gen(ids, mask, 2)
        # entry into the engine's start (both paths call it first): wrap it on this instance
        enter = {}
        orig_start = fast.start

        def wrapped(*a, **k):
            enter["t"] = time.perf_counter()
            return orig_start(*a, **k)

        fast.start = wrapped
        for i, (ids, mask) in enumerate(batches[:4]):
            shape = {**base, "prompt_len": ids.shape[1], "prompt_index": i, "pass": n_pass}
            t1 = median_ms(lambda: gen(ids, mask, 1), 9)
            t2 = median_ms(lambda: gen(ids, mask, 2), 9)
            wr = []
            for _ in range(9):
                sync()
                t = time.perf_counter()
                gen(ids, mask, 1)
                wr.append(1e3 * (enter["t"] - t))
            vals = {"generate_1_ms": t1, "generate_2_ms": t2, "wrapper_ms": statistics.median(wr)}
            if spec is None:
                @torch.inference_mode()
                def start():
                    fast.start(ids, mask, 128)
                    fast.cache.release()
                vals["start_ms"] = median_ms(start, 9)
                with torch.inference_mode():
                    step, _ = fast.start(ids, mask, 128)
                    graph, _ = step.graphs[("prefill", prefill_bucket(ids.shape[1]))]
                    vals["prefill_gpu_ms"] = time_replay(graph, 9)[0]
                    fast.cache.release()
            print(provider, i, {k: round(v, 3) for k, v in vals.items()}, flush=True)
            for metric, value in vals.items():
                rows.append({"bench": "profile_call_overhead", "provider": provider, "shape": shape,
                             "metric": metric, "unit": "ms", "value": value})
        del fast.start
        ids, mask = batches[0]
        if blocking or repeat or timings_only:
            hf_accel.revert_model(model)
            continue
        pr = cProfile.Profile()
        sync()
        pr.enable()
        for _ in range(20):
            gen(ids, mask, 1)
        sync()
        pr.disable()
        pr.dump_stats(str(out_dir / f"call_{provider}.prof"))
        from torch.profiler import ProfilerActivity, profile
        stack = args.stack  # Python functions in the trace too (with_stack): a host timeline
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
            gen(ids, mask, 128 if stack else 1)
            sync()
        trace = out_dir / f"trace_{provider}.json"
        prof.export_chrome_trace(str(trace))
        if stack:  # large: compressed
            import gzip
            import shutil
            with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
        hf_accel.revert_model(model)
    set_blocking_copies(False)
    blocking_now[0] = False
    write_results("profile_call_overhead", rows)


if __name__ == "__main__":
    main()
