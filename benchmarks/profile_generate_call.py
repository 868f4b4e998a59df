"""Where a batch-1 ``generate`` call's time goes on the real SmolLM2 (bf16, CUDA), plain fast path and prompt
lookup, and what pieces of a 16-token verify forward cost.

Per grounded-text prompt (the first 4 of ``bench_speculative``): wall time (CUDA-synced, median of 3-5) of
``generate`` with ``max_new_tokens`` 128, 1 and 2 (the 1-token call is the fixed cost: host work + prefill),
``fast.start`` alone (prefill), cProfile tables of the host side; then the verify forward over 16 tokens
(CUDA graph, median of 50 replays) at the default split count and 1 / 2 / 4 splits, without the RoPE kernel
and / or the attention (timing only: those outputs are wrong), without PDL, and over 2 / 4 / 8 / 16 tokens.
Rows: ``generate_<n>_ms`` per prompt and provider (``ours`` / ``ours-prompt_lookup``), ``new_tokens`` of the
128-token call, ``start_ms`` (prefill alone), ``plain_step_ms`` and ``q<L>_*_ms`` of the verify forwards,
``*_maxdiff`` (largest logit difference to the default split count); ``profile_generate_call-<date>.json``.

    python benchmarks/profile_generate_call.py
"""
import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import require_cuda, write_results  # noqa: E402
from profile_speculative_round import time_graph  # noqa: E402

import hf_accel  # noqa: E402
import hf_accel.engine.decode_step as ds  # noqa: E402
from hf_accel.engine import step_switches  # noqa: E402
from hf_accel.models import load_default_model  # noqa: E402


def to_rows(res: dict) -> list[dict]:
    """The measurements as result rows (one shape per prompt; scalars under the first prompt's shape)."""
    rows = []
    base = {"model": "smollm2-135m", "dtype": "bfloat16", "bs": 1}
    units = {"t128_ms": "generate_128_ms", "t1_ms": "generate_1_ms", "t2_ms": "generate_2_ms", "new": "new_tokens"}
    for key, value in res.items():
        if isinstance(value, dict):  # "<plain|lookup>_p<i>": one prompt's call times
            name, _, idx = key.partition("_p")
            provider = "ours" if name == "plain" else "ours-prompt_lookup"
            shape = {**base, "prompt_len": value["prompt"], "prompt_index": int(idx)}
            for k, metric in units.items():
                rows.append({"bench": "profile_generate_call", "provider": provider, "shape": shape, "metric": metric,
                             "unit": "tokens" if k == "new" else "ms", "value": value[k]})
        else:
            unit = "ms" if key.endswith("_ms") else ("abs" if key.endswith("maxdiff") else "count")
            rows.append({"bench": "profile_generate_call", "provider": "ours", "shape": {**base, "prompt_len": 324},
                         "metric": key, "unit": unit, "value": value})
    return rows


def sync():
    torch.cuda.synchronize()


def timed(fn, reps=3):
    ts = []
    out = None
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def host_profile(fn, calls, sort, lines):
    """Print a cProfile table of ``calls`` calls of ``fn`` (host side; synced at the end)."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(lines)
    print(s.getvalue()[:9000])


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    require_cuda(__file__)
    res = {}
    model, tok = load_default_model(dtype="bfloat16", device="cuda")
    eos = [2]
    texts = bs.chat_texts(tok, "grounded-text")
    batches = [bs.encode(tok, [t], "cuda") for t in texts]

    def gen(ids, mask, n, **kw):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)

    for name, spec in (("plain", None), ("lookup", "prompt_lookup")):
        hf_accel.accelerate_model(model, **({"speculative": spec} if spec else {}))
        for ids, mask in batches:
            gen(ids, mask, 128)
            gen(ids, mask, 1)
            gen(ids, mask, 2)
        for i, (ids, mask) in enumerate(batches[:4]):
            t128, out = timed(lambda: gen(ids, mask, 128))
            n = len(bs.count_new(out, ids.shape[1], eos)[0])
            t1, _ = timed(lambda: gen(ids, mask, 1), 5)
            t2, _ = timed(lambda: gen(ids, mask, 2), 5)
            res[f"{name}_p{i}"] = {"prompt": ids.shape[1], "new": n, "t128_ms": t128 * 1e3, "t1_ms": t1 * 1e3,
                                   "t2_ms": t2 * 1e3}
            if spec:
                res[f"{name}_p{i}"]["stats"] = hf_accel.speculative_stats(model)
            print(name, i, res[f"{name}_p{i}"], flush=True)
        if name == "plain":
            fast = model._hf_accel_engine
            ids, mask = batches[0]
            # prefill alone
            @torch.inference_mode()
            def start():
                step, lg = fast.start(ids, mask, 128)
                fast.cache.release()
                return lg
            res["start_ms"], _ = timed(start, 5)
            res["start_ms"] *= 1e3
            host_profile(lambda: gen(ids, mask, 1), 10, "cumulative", 45)
            host_profile(lambda: gen(ids, mask, 128), 3, "tottime", 25)
        hf_accel.revert_model(model)

    # verify forward variants at q16 (timing only where pieces are removed)
    hf_accel.accelerate_model(model)
    fast = model._hf_accel_engine
    ids, mask = batches[0]
    with torch.inference_mode():
        step, logits = fast.start(ids, mask, 128, lookahead=17)
        nb = step.max_blocks
        P = ids.shape[1]
        step.cache_lens[:1] = P
        res["plain_step_ms"], _ = time_graph(lambda: step._forward())
        v = fast._step_for(1, nb, q_len=16)
        v.input_ids.copy_(ids[:, :16])
        v.position_ids.copy_(torch.arange(P, P + 16, device="cuda")[None])
        v.cache_lens.fill_(P)
        v.block_table.copy_(step.block_table)
        v.key_mask.copy_(step.key_mask)
        res["verify_splits_default"] = v.num_splits
        fwd = lambda **kw: v.forward_tokens(v.input_ids, v.position_ids, v.cache_lens, v.block_table, v.key_mask, **kw)
        ref = fwd().clone()
        res["q16_default_ms"], _ = time_graph(lambda: fwd())
        for s in (1, 2, 4):
            o = fwd(num_splits=s)
            res[f"q16_splits{s}_maxdiff"] = float((o - ref).abs().max())
            res[f"q16_splits{s}_ms"], _ = time_graph(lambda: fwd(num_splits=s))
        res["q16_last_only_ms"], _ = time_graph(lambda: fwd(last_only=True))
        orig_rope, orig_attn = ds.rope_and_cache, ds.paged_attention
        ds.rope_and_cache = lambda q, *a, **k: q
        res["q16_no_rope_ms"], _ = time_graph(lambda: fwd())
        bufs = {}

        def fake_attn(q, *a, **k):
            key = tuple(q.shape)
            if key not in bufs:
                bufs[key] = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype, device=q.device)
            return bufs[key]

        ds.paged_attention = fake_attn
        res["q16_no_rope_no_attn_ms"], _ = time_graph(lambda: fwd())
        ds.rope_and_cache = orig_rope
        res["q16_no_attn_ms"], _ = time_graph(lambda: fwd())
        ds.paged_attention = orig_attn
        for flag, val in (("DECODE_PDL", False), ("ATTENTION_PDL", False)):
            old = getattr(step_switches, flag)
            setattr(step_switches, flag, val)
            res[f"q16_{flag}_{val}_ms"], _ = time_graph(lambda: fwd())
            setattr(step_switches, flag, old)
        # rows sweep
        for q in (2, 4, 8, 16):
            w = fast._step_for(1, nb, q_len=q)
            w.input_ids.copy_(ids[:, :q])
            w.position_ids.copy_(torch.arange(P, P + q, device="cuda")[None])
            w.cache_lens.fill_(P)
            w.block_table.copy_(step.block_table)
            w.key_mask.copy_(step.key_mask)
            res[f"q{q}_fwd_ms"], _ = time_graph(lambda: w.forward_tokens(w.input_ids, w.position_ids, w.cache_lens,
                                                                          w.block_table, w.key_mask))
        fast.cache.release()
    for k_, v_ in res.items():
        if not isinstance(v_, dict):
            print(f"{k_:32s} {v_}")
    write_results("profile_generate_call", to_rows(res))


if __name__ == "__main__":
    main()
