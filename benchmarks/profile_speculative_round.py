"""Where the time of a speculative verify round goes (CUDA, real SmolLM2, bf16, bs1).

Times, with CUDA graphs replayed back to back (median of 50 replays, CUDA events): the plain decode step
(q_len 1), the target forward over q_len = k + 1 tokens, and whole prompt-lookup rounds at k = 0, 8 and 15
(``round_gated_k*``: match-gated rounds at k = 0 and 15, which end with the next round's lookup). Each round
graph starts by restoring the state it was captured from (10 small copies a real round does not run: 8 of int64
tensors and 2 of bool ones, as many as the ``memcpy32_post`` / ``memcpy_post`` kernels per replay in the tables
below), timed alone as ``state_restore_ms``; then
torch.profiler tables of the kernels of the k = 15 round, the match-gated plain round and the plain step.
Writes ``profile_speculative_round-<date>.json``.

    python benchmarks/profile_speculative_round.py [--set NAME=VALUE+...]   # step_switches (A/B)
    python benchmarks/profile_speculative_round.py --ab-verify-inputs     # + rounds with PyTorch verify inputs
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_step_overrides, require_cuda, step_over_blocks, write_results  # noqa: E402


def time_graph(fn, reps=50):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), g


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="", help="switches of hf_accel.engine.step_switches (NAME=VALUE+...)")
    ap.add_argument("--ab-verify-inputs", action="store_true",
                    help="also time the rounds with VERIFY_INPUTS_KERNEL off (metrics suffixed _torch_inputs)")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    with decode_step_overrides(args.set):
        _main(args.ab_verify_inputs)


def _main(ab_verify_inputs: bool = False):
    from pydoc_data.topics import topics

    from hf_accel import SpeculativeConfig, accelerate_model
    from hf_accel.models import load_default_model
    from hf_accel.speculative.registry import engine_for
    from hf_accel.speculative.state import RoundState

    model, tok = load_default_model(dtype="bfloat16", device="cuda")
    accelerate_model(model)
    fast = model._hf_accel_engine
    spec = engine_for(model, fast, SpeculativeConfig("prompt_lookup", num_draft_tokens=8, adaptive=False))
    text = tok.apply_chat_template([{"role": "user", "content": "Summarise:\n\n" + topics["with"][:1000]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].cuda()
    mask = torch.ones_like(ids)
    rows, res, top = [], {}, []
    with torch.inference_mode():
        step, logits = fast.start(ids, mask, 128, lookahead=17)
        nb = step.max_blocks
        prompt_len = ids.shape[1]
        step.cache_lens[:1] = prompt_len
        res["plain_step_ms"], g_plain = time_graph(lambda: step._forward())
        for k in (1, 4, 8, 15, 16):
            v = step_over_blocks(fast, step, ids, k + 1, prompt_len)
            res[f"verify_forward_q{k + 1}_ms"], _ = time_graph(lambda: v._forward())
        st = RoundState(step.batch, nb * step.block_size + 1, model.device, 15)
        st.reset(0)
        st.tokens[0, :prompt_len] = ids[0]
        st.tokens[0, prompt_len] = logits.argmax(-1)[0]
        st.lengths[0] = prompt_len + 1
        st.remaining[0] = 120
        st.active[0] = True
        ctx = {"warp": lambda x: x, "do_sample": False, "block_table": step.block_table, "key_mask": step.key_mask,
               "use_graph": True, "kernels": True, "verify": {k: fast._step_for(1, nb, q_len=k + 1) for k in (0, 8, 15)},
               "gated": False}
        gated_ctx = {**ctx, "gated": True}
        spec._lookup_next(st, gated_ctx)  # the first round's drafts, as generate does after the prefill
        saved = st.snapshot()

        def round_k(k, c=ctx):
            st.restore(saved)
            spec._round(k, st, c)

        # each timed round graph also restores the state (10 small copies) so that replays repeat one round;
        # the restore alone, to subtract from the round_* times
        res["state_restore_ms"], _ = time_graph(lambda: st.restore(saved))
        for k in (0, 8, 15):
            res[f"round_k{k}_ms"], _ = time_graph(lambda: round_k(k))
        graphs = {"k15": None, "gated_k0": None}
        for k in (0, 15):  # match-gated: the next round's lookup and class counts at the end of the round
            res[f"round_gated_k{k}_ms"], g = time_graph(lambda: round_k(k, gated_ctx))
            graphs[f"gated_k{k}"] = g
        if ab_verify_inputs:  # the same rounds with the PyTorch verify inputs, then the default again
            from hf_accel.speculative import engine as spec_engine

            for flag, suffix in ((False, "_torch_inputs"), (True, "_again")):
                spec_engine.VERIFY_INPUTS_KERNEL = flag
                for k in (0, 15):
                    res[f"round_k{k}_ms{suffix}"], _ = time_graph(lambda: round_k(k))
                    res[f"round_gated_k{k}_ms{suffix}"], _ = time_graph(lambda: round_k(k, gated_ctx))
        _, graphs["k15"] = time_graph(lambda: round_k(15), reps=1)
        graphs["plain_step"] = g_plain
        from torch.profiler import ProfilerActivity, profile

        for name in ("k15", "gated_k0", "plain_step"):  # kernels per replay (profiled times are inflated)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    graphs[name].replay()
                torch.cuda.synchronize()
            events = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
            events = [e for e in events if not e.key.startswith(("cuda", "Activity"))]
            print(f"-- {name}: kernels per replay (name, count, profiled us)")
            for e in events[:40]:
                print(f"   {e.key[:80]:80s} {e.count / 10:6.1f} {getattr(e, 'device_time_total', 0) / 10:8.1f}")
            table = [{"name": e.key[:90], "calls_per_round": e.count / 10,
                      "us_per_round": getattr(e, "device_time_total", 0) / 10} for e in events[:40]]
            if name == "k15":
                top = table
            else:
                rows.append({"bench": "profile_speculative_round", "provider": "ours",
                             "shape": {"model": "SmolLM2-135M-Instruct", "bs": 1, "graph": name},
                             "metric": "kernels", "unit": "us per replay", "value": table})
            res[f"kernels_per_round_{name}"] = sum(e.count for e in events) / 10
    shape = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "bs": 1, "prompt_len": prompt_len}
    for key, value in res.items():
        print(f"{key:28s} {value}")
        rows.append({"bench": "profile_speculative_round", "provider": "ours", "shape": shape, "metric": key,
                     "unit": "ms" if key.endswith("_ms") else "count", "value": value})
    rows.append({"bench": "profile_speculative_round", "provider": "ours", "shape": {**shape, "k": 15},
                 "metric": "top_kernels", "unit": "us per round", "value": top})
    write_results("profile_speculative_round", rows)


if __name__ == "__main__":
    main()
