"""argmax_rows vs torch.argmax, and an A/B of the one-launch greedy tail / verify argmax in generate (CUDA only).

1. ``argmax_rows`` against ``torch.argmax(dim=-1)`` on [rows, vocab] float32 logits (rows 1 / 16 / 128, vocab
   49152 and 128256): time per call inside a CUDA graph of 20 calls (median of 7), and equality.
2. SmolLM2-135M-Instruct bf16, bs1, the 8 prompts per category of ``bench_speculative.py``, 128 new tokens:
   ``ours`` and ``ours-prompt_lookup`` with the kernels (``GREEDY_TAIL_KERNEL``, ``argmax_rows`` in the verify
   round) and with ``torch.argmax`` + PyTorch bookkeeping, interleaved twice (``bench_speculative.measure``:
   median of 3 passes after a warm-up pass each). Writes ``bench_argmax-<date>.json`` to ``$OUT`` (or ``.``).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import meta, require_cuda  # noqa: E402

import hf_accel.speculative.engine as se  # noqa: E402
from hf_accel.engine import step_switches  # noqa: E402
from hf_accel.kernels.argmax import argmax_rows, scratch_for  # noqa: E402
from hf_accel.models.loading import load_model  # noqa: E402


def graph_time(fn, reps=20):
    """µs per call of ``fn``: ``reps`` calls captured in one CUDA graph, median of 7 timings of 20 replays."""
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20): g.replay()
        b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / (20 * reps))
    return statistics.median(ts)


def kernel_rows(out_rows):
    """Part 1: ``argmax_rows`` against ``torch.argmax``, rows appended to ``out_rows``."""
    for vocab in (49152, 128256):
        for R in (1, 16, 128):
            x = torch.randn(R, vocab, device='cuda')
            sc = scratch_for(R, vocab, 'cuda')
            ok = bool((argmax_rows(x, scratch=sc) == x.argmax(-1)).all())
            t_t = graph_time(lambda: x.argmax(dim=-1)); t_o = graph_time(lambda: argmax_rows(x, scratch=sc))
            r = {"vocab": vocab, "rows": R, "torch_us": round(t_t, 2), "ours_us": round(t_o, 2), "equal": ok}
            print(r, flush=True)
            for prov, us in (("torch", t_t), ("ours", t_o)):
                out_rows.append({"bench": "argmax", "provider": prov, "shape": {"vocab": vocab, "rows": R},
                                 "metric": "latency", "unit": "us", "value": round(us, 2), "equal_torch": ok})


def generate_ab(out_rows):
    """Part 2: the greedy tail / verify argmax A/B in ``generate``, rows appended to ``out_rows``."""
    args = bs.parse_args(["--skip-draft", "--batch-sizes", "1"])
    model, tok = load_model(None, dtype="bfloat16", device="cuda")
    tok.padding_side = "left"
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    model.eval()
    cats = {c: [bs.encode(tok, [t], 'cuda') for t in bs.chat_texts(tok, c)[:8]] for c in bs.CATEGORIES}
    orig = se.argmax_rows
    res = {}
    for rep in range(2):
        for variant in ("kernel", "torch"):
            step_switches.GREEDY_TAIL_KERNEL = variant == "kernel"
            se.argmax_rows = orig if variant == "kernel" else (lambda x, out=None, scratch=None: x.argmax(dim=-1))
            for prov in ("ours", "ours-prompt_lookup"):
                for c, batches in cats.items():
                    wall, tokens, outs, st = bs.measure(prov, model, batches, args, 128, eos_ids, None)
                    res.setdefault((variant, prov, c), []).append((wall, tokens, outs))
                    print(variant, prov, c, f"{tokens / wall:.1f} tok/s ({tokens} tokens, {wall * 1e3:.1f} ms)",
                          flush=True)
    step_switches.GREEDY_TAIL_KERNEL = True; se.argmax_rows = orig
    for (variant, prov, c), v in sorted(res.items()):
        walls = [w for w, _, _ in v]; tokens = v[0][1]
        same = all(o == res[("torch", prov, c)][0][2] for _, _, o in v)
        print(f"{prov:20s} {c:14s} {variant:6s} ms {walls} tok/s best {tokens / min(walls):.1f} "
              f"outputs==torch-variant {same}")
        shape = {"category": c, "variant": variant, "bs": 1, "calls": 8, "max_new_tokens": 128,
                 "model": "smollm2-135m-instruct", "dtype": "bfloat16"}
        out_rows.append({"bench": "greedy_tail_ab", "provider": prov, "shape": shape, "metric": "wall_ms_per_pass",
                         "unit": "ms", "value": [w * 1e3 for w in walls], "tokens": tokens,
                         "outputs_equal_torch_variant": same})


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args(argv)
    require_cuda(__file__)
    out_rows = []
    kernel_rows(out_rows)
    generate_ab(out_rows)
    path = os.path.join(os.environ.get("OUT", "."), f"bench_argmax-{time.strftime('%Y%m%d')}.json")
    with open(path, "w") as f:
        json.dump({"meta": {**meta(), "command": "bench_argmax.py"}, "rows": out_rows}, f, indent=1)


if __name__ == "__main__":
    main()
