"""Where the time of one fused decode step goes: per-kernel CUDA time of one step (torch.profiler over
an eager run of the same step) next to the replay time of the captured CUDA graph.

Models: the real SmolLM2-135M (bf16, ``HF_ACCEL_GGUF`` or the embedded file) and a Llama-3-8B-shaped
model with random bf16 weights; batch 1, a 512-token context. Output: a table per model (kernel name,
calls per step, total µs per step) and ``profile_decode_step-<date>.json``. ``--ablate`` instead times the
captured step (logits only) with switch overrides or with pieces removed (timing only), side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402


def _models(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not args.skip_smollm2:
        from hf_accel.models.loading import load_model

        model, _ = load_model(None, dtype="bfloat16", device="cuda")
        yield "smollm2-135m", model
    if not args.skip_8b:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                          rope_theta=500000.0)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        yield "llama3-8b-shape", model


def _prepare(model, batch: int, context: int):
    """The captured decode step of a real ``generate`` call with a ``context``-token prompt, its buffers
    left at the state of the last step (the cache pools stay allocated after the call)."""
    from hf_accel import accelerate_model

    accelerate_model(model)
    ids = torch.randint(100, model.config.vocab_size, (batch, context), device="cuda")
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                   eos_token_id=None, pad_token_id=0)
    engine = model._hf_accel_engine
    (step,) = engine.steps.values()
    step.cache = engine.cache
    return step


def profile(name, model, batch, context, rows):
    step = _prepare(model, batch, context)
    graph = step.graph_greedy or step.graph
    torch.cuda.synchronize()
    # graph replay time
    n = 200
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_us = start.elapsed_time(end) / n * 1e3
    # eager step under the profiler: per-kernel device time
    with torch.inference_mode():
        for _ in range(3):
            step._forward()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                step._forward()
            torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = ev.name[:90]
            per[k][0] += 1
            per[k][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    kernels = sorted(((k, c / 5, t / 5) for k, (c, t) in per.items()), key=lambda r: -r[2])
    total = sum(t for _, _, t in kernels)
    launches = sum(c for _, c, _ in kernels)
    print(f"\n{name} bs{batch} ctx{context}: graph replay {replay_us:.1f} us/step "
          f"({1e6 / replay_us:.0f} steps/s); eager-step kernels: {launches:.0f} launches, {total:.1f} us busy")
    for k, c, t in kernels[:25]:
        print(f"  {t:8.1f} us  {c:5.0f}x  {k}")
    shape = {"model": name, "batch": batch, "context": context, "dtype": "bfloat16"}
    rows.append({"bench": "decode_step", "provider": "hf_accel", "shape": shape, "metric": "graph_replay",
                 "unit": "us", "value": replay_us})
    rows.append({"bench": "decode_step", "provider": "hf_accel", "shape": shape, "metric": "kernel_busy",
                 "unit": "us", "value": total, "launches": launches,
                 "kernels": [{"name": k, "calls": c, "us": t} for k, c, t in kernels]})


#: Ablations (``--ablate``): pieces of the step replaced by nothing, for timing only (their outputs are
#: wrong): what each one costs on the step's critical path.
def _skip_rope(q, *args, **kwargs):
    return q


def _skip_attention(q, *args, **kwargs):
    return q.transpose(1, 2)  # [b, t, h, d]: the shape the attention output has


class _StaticPrologue:
    """The modules' rotary tables and cache slots computed once, outside the graph (timing only). It changes
    the step only with ``ROTARY_TABLE=False`` / ``SLOT_KERNEL=False`` (the per-step prologue it removes)."""

    def __init__(self, step):
        self.step = step
        self.saved = None

    def __enter__(self):
        from hf_accel.engine.decode_step import DecodeStep

        step, inner = self.step, self.step.model.model
        n = step.batch * step.q_len
        with torch.inference_mode():
            hidden = inner.embed_tokens(step.input_ids.reshape(n))
            cos, sin = inner.rotary_emb(hidden[:, None], step.position_ids.reshape(n, 1))
            slots = DecodeStep._slots(step, step.cache_lens, step.block_table, step.q_len)
        self.saved = (inner.rotary_emb.forward, DecodeStep._slots)
        inner.rotary_emb.forward = lambda *a, **k: (cos, sin)
        DecodeStep._slots = lambda *a, **k: slots
        return self

    def __exit__(self, *exc):
        from hf_accel.engine.decode_step import DecodeStep

        self.step.model.model.rotary_emb.forward, DecodeStep._slots = self.saved
        return False


ABLATIONS = {"no-rope": {"rope_and_cache": _skip_rope}, "no-attention": {"paged_attention": _skip_attention},
             "no-rope-no-attention": {"rope_and_cache": _skip_rope, "paged_attention": _skip_attention}}


def ablate(name, model, batch, context, rows, variants):
    """Graph replay time of the step (logits only, no sampling) for each variant: ``NAME=VALUE+...`` switch
    overrides of :mod:`hf_accel.engine.step_switches` or an :data:`ABLATIONS` key; the first is ``default``."""
    from common import decode_step_overrides

    from hf_accel.engine import decode_step

    step = _prepare(model, batch, context)
    shape = {"model": name, "batch": batch, "context": context, "dtype": "bfloat16"}
    results = []
    for variant in ["default", *variants] * 2:  # twice, interleaved: run-to-run drift shows
        patches = ABLATIONS.get(variant, {})
        saved = {k: getattr(decode_step, k) for k in patches}
        spec = "" if variant in ("default", "static-prologue") or variant in ABLATIONS else variant
        try:
            for k, v in patches.items():
                setattr(decode_step, k, v)
            with decode_step_overrides(spec), (_StaticPrologue(step) if variant == "static-prologue"
                                               else contextlib.nullcontext()):
                step.graph = None
                step.run()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                times = []
                for _ in range(5):
                    start.record()
                    for _ in range(100):
                        step.graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) * 10)  # us per replay
        finally:
            for k, v in saved.items():
                setattr(decode_step, k, v)
            step.graph = None
        us = sorted(times)[2]
        results.append((variant, us))
        rows.append({"bench": "decode_step_ablation", "provider": "hf_accel", "shape": {**shape, "variant": variant},
                     "metric": "graph_replay", "unit": "us", "value": us})
        print(f"{name} {variant:40s} {us:8.1f} us", flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ablate", default=None,
                    help="only time step variants, ','-separated: switch overrides 'NAME=VALUE+...' or "
                         + ", ".join([*ABLATIONS, "static-prologue"]))
    args = ap.parse_args(argv)
    require_cuda(__file__)
    rows = []
    t0 = time.perf_counter()
    for name, model in _models(args):
        if args.ablate is not None:
            ablate(name, model, args.batch, args.context, rows, list(filter(None, args.ablate.split(","))))
        else:
            profile(name, model, args.batch, args.context, rows)
        del model
        torch.cuda.empty_cache()
    write_results("profile_decode_step", rows, {"seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
