"""Per-program timeline of the batch-1 decode attention: when each program starts, finishes its tile loop and
ends, against the read-only reference on the same grid.

B1, GQA 32/8, head_dim 128, bf16, block_size 16, a scattered block table, 32 KV splits (256 attention
programs), the shape where ``paged_attention`` stays below 3.8 TB/s. ``probe_decode_fixed_cost.py`` found the
gap in fixed cost (ramp, tail, merge), not in the streaming rate; this probe shows where inside the call it
lies. Every program of the attention kernel, the split-merge kernel and ``bench_decode``'s read-only kernel
records ``%globaltimer`` (device-wide ns) at its start, after its tile loop (read with an operand computed by
the loop, so it cannot run before the loop's loads returned) and after its stores, with its SM (``%smid``)
and per-SM cycle counts (``%clock64``). The kernels are those of ``hf_accel/kernels/paged_attention.py`` and
``bench_decode.py`` with only these reads and stores added: their source is copied into a temporary module
and edited (each edit must match exactly once, or the probe stops).

Ten back-to-back calls are captured in one CUDA graph (as ``bench_decode.py`` times them), each writing its
own stamps; the graph is replayed and the stamps of the last replay are read. For the middle calls the probe
prints, relative to the call's first attention program start: the spread of program starts, of loop ends and
of program ends, the merge kernel's programs passing their wait and ending, and the gap to the next call.
Programs are also grouped by how many programs of the kernel ran on their SM.

Writes ``probe_decode_timeline-<date>.json`` (summaries per reader; ``--raw`` adds every program's stamps).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

import bench_decode  # noqa: E402

H, H_KV, D, BLOCK = 32, 8, 128, 16
SPLITS = 32
REPS = 10
SLOTS = 8  # per program: start, loop end, end (globaltimer ns), smid, the same three in clock64 cycles, unused

_TIMERS = '''

@triton.jit
def _now(x):
    """%globaltimer (ns); ``x`` orders the read after whatever computed it."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _clock(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid(x):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _record(Stamps, pid, t0, c0, t1, c1):
    t2 = _now(pid)
    c2 = _clock(pid)
    base = Stamps + pid.to(tl.int64) * 8
    tl.store(base, t0)
    tl.store(base + 1, t1)
    tl.store(base + 2, t2)
    tl.store(base + 3, _smid(pid).to(tl.int64))
    tl.store(base + 4, c0)
    tl.store(base + 5, c1)
    tl.store(base + 6, c2)


STAMP_BUFFERS = [None, None, None]  # attention, merge, read-only: int64 [programs * 8], set before each launch
'''

_PID3 = "((tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0))"


def _edit(text: str, old: str, new: str, within: str | None = None) -> str:
    """``text`` with ``old`` replaced by ``new``; ``within``: only inside the function of that name (from its
    ``def`` to the next top-level definition). Stops the probe unless ``old`` occurs there exactly once."""
    start, end = 0, len(text)
    if within is not None:
        start = text.index(f"\ndef {within}(")
        following = [i for i in (text.find("\n@triton.jit", start + 1), text.find("\ndef ", start + 1)) if i >= 0]
        end = min(following, default=len(text))
    region = text[start:end]
    if region.count(old) != 1:
        raise SystemExit(f"probe_decode_timeline: expected one {old!r} in the kernel source, found {region.count(old)}")
    return text[:start] + region.replace(old, new) + text[end:]


def stamped_module():
    """A copy of ``hf_accel.kernels.paged_attention`` plus ``bench_decode``'s read-only kernel, with stamps."""
    import hf_accel.kernels.paged_attention as pa

    src = Path(pa.__file__).read_text()
    src = _edit(src, "from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl\n",
                "from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl\n" + _TIMERS)
    # attention kernel
    src = _edit(src, "Out, PartOut, PartLse, Counters,\n", "Out, PartOut, PartLse, Counters, Stamps,\n")
    src = _edit(src, "    TRIGGER_AFTER_KEYS: tl.constexpr,\n):\n",
                f"    TRIGGER_AFTER_KEYS: tl.constexpr,\n):\n    pid_lin = {_PID3}\n"
                "    t0 = _now(pid_lin)\n    c0 = _clock(pid_lin)\n")
    src = _edit(src, "    if TRIGGER_AFTER_KEYS:\n        gdc_launch_dependents()  # every K/V",
                "    loop_done = tl.sum(l_i, 0).to(tl.int32)\n    t1 = _now(loop_done)\n    c1 = _clock(loop_done)\n"
                "    if TRIGGER_AFTER_KEYS:\n        gdc_launch_dependents()  # every K/V")
    src = _edit(src, "        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=io_mask)\n",
                "        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=io_mask)\n"
                "    _record(Stamps, pid_lin, t0, c0, t1, c1)\n", within="_paged_attention_kernel")
    src = _edit(src, "merge_counters if fused_merge else seq_lens,\n",
                "merge_counters if fused_merge else seq_lens, STAMP_BUFFERS[0],\n")
    # merge kernel: start, past its PDL wait, end
    src = _edit(src, "    PartOut, PartLse, Out,\n    stride_ps", "    PartOut, PartLse, Out, Stamps,\n    stride_ps")
    src = _edit(src, "    if PDL:\n        gdc_launch_dependents()  # tiny kernel",
                "    t0 = _now(tl.program_id(0))\n    c0 = _clock(tl.program_id(0))\n"
                "    if PDL:\n        gdc_launch_dependents()  # tiny kernel")
    src = _edit(src, "    r = tl.program_id(0).to(tl.int64)  # flat (b, m, h) row\n",
                "    t1 = _now(tl.program_id(0))\n    c1 = _clock(tl.program_id(0))\n"
                "    r = tl.program_id(0).to(tl.int64)  # flat (b, m, h) row\n")
    merge_store = "    tl.store(Out + r * stride_or + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)\n"
    src = _edit(src, merge_store, merge_store + "    _record(Stamps, tl.program_id(0), t0, c0, t1, c1)\n")
    src = _edit(src, "            part_out, part_lse, target,\n",
                "            part_out, part_lse, target, STAMP_BUFFERS[1],\n")
    # read-only reference kernel
    ro = inspect.getsource(bench_decode._read_kv_kernel.fn)
    ro = _edit(ro, "def _read_kv_kernel(KC, VC, BlockTable, Out,",
               "def _read_kv_kernel(KC, VC, BlockTable, Out, Stamps,")
    ro = _edit(ro, "    pid_bh = tl.program_id(0)\n",
               "    pid_lin = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)\n"
               "    t0 = _now(pid_lin)\n    c0 = _clock(pid_lin)\n    pid_bh = tl.program_id(0)\n")
    ro = _edit(ro, "    tl.store(Out + (pid_bh", "    loop_done = tl.sum(tl.sum(acc, 0), 0).to(tl.int32)\n"
               "    t1 = _now(loop_done)\n    c1 = _clock(loop_done)\n    tl.store(Out + (pid_bh")
    ro = ro.rstrip("\n") + "\n    _record(Stamps, pid_lin, t0, c0, t1, c1)\n"
    src += "\n\n" + ro
    path = Path(tempfile.mkdtemp()) / "paged_attention_stamped.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("paged_attention_stamped", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _q(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p * (len(values) - 1) + 0.5))]


def summarize(stamps, merge_stamps, origin):
    """Times in µs relative to ``origin`` (ns) of one kernel launch's stamps [programs, 8]."""
    s = stamps.tolist()
    start = [r[0] - origin for r in s]
    loop = [r[1] - origin for r in s]
    end = [r[2] - origin for r in s]
    per_sm = {}
    for r in s:
        per_sm.setdefault(r[3], []).append(r)
    load = {}
    for rows in per_sm.values():
        for r in rows:
            load.setdefault(len(rows), []).append(r)
    out = {
        "programs": len(s), "sms_used": len(per_sm),
        "start_us": [_q(start, p) / 1e3 for p in (0, 0.5, 1)],
        "loop_end_us": [_q(loop, p) / 1e3 for p in (0, 0.1, 0.5, 0.9, 1)],
        "end_us": [_q(end, p) / 1e3 for p in (0, 0.1, 0.5, 0.9, 1)],
        "duration_cycles_median": statistics.median(r[6] - r[4] for r in s),
        "loop_cycles_median": statistics.median(r[5] - r[4] for r in s),
        "epilogue_cycles_median": statistics.median(r[6] - r[5] for r in s),
        "by_programs_per_sm": {
            str(n): {"programs": len(rows),
                     "end_us_median": statistics.median(r[2] - origin for r in rows) / 1e3,
                     "end_us_max": max(r[2] - origin for r in rows) / 1e3,
                     "duration_cycles_median": statistics.median(r[6] - r[4] for r in rows)}
            for n, rows in sorted(load.items())},
    }
    if merge_stamps is not None:
        m = merge_stamps.tolist()
        out["merge_start_us"] = [_q([r[0] - origin for r in m], p) / 1e3 for p in (0, 1)]
        out["merge_past_wait_us"] = [_q([r[1] - origin for r in m], p) / 1e3 for p in (0, 1)]
        out["merge_end_us"] = [_q([r[2] - origin for r in m], p) / 1e3 for p in (0, 1)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--raw", action="store_true", help="write every program's stamps too")
    args = ap.parse_args()
    require_cuda(__file__)
    import triton

    mod = stamped_module()
    S = args.seq_len
    k_cache, v_cache, table, seq_lens, q = bench_decode.b1_case(S, seed=0)
    ref = bench_decode.sdpa_reference(q, *bench_decode.contiguous_kv(k_cache, v_cache, table, S))
    programs = H_KV * SPLITS
    attn = torch.zeros(REPS, programs * SLOTS, dtype=torch.int64, device="cuda")
    merge = torch.zeros(REPS, H * SLOTS, dtype=torch.int64, device="cuda")
    ro = torch.zeros(REPS, programs * SLOTS, dtype=torch.int64, device="cuda")
    tps = triton.cdiv(triton.cdiv(S, SPLITS), 64) * 64
    ro_out = torch.empty(H_KV * SPLITS * D, device="cuda", dtype=torch.float32)

    def ours(i):
        mod.STAMP_BUFFERS[0], mod.STAMP_BUFFERS[1] = attn[i], merge[i]
        return mod.paged_attention(q, k_cache, v_cache, table, seq_lens, S, num_splits=SPLITS, check_blocks=False)

    def read_only(i):
        mod.STAMP_BUFFERS[2] = ro[i]
        mod._read_kv_kernel[(H_KV, SPLITS)](
            k_cache, v_cache, table, ro_out, ro[i], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            table.stride(0), H_KV, tps, S, BLOCK_N=64, HEAD_DIM=D, BLOCK_SIZE=BLOCK, PAGED=True,
            num_warps=4, num_stages=3)

    err = (ours(0).float() - ref).abs().max().item()
    assert err < 2e-2, f"stamped kernel error {err}"
    results = {}
    for name, fn, bufs in (("ours", ours, (attn, merge)), ("read-only", read_only, (ro,))):
        fn(0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(REPS):
                fn(i)
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        graph.replay()  # the stamps read below are this replay's
        torch.cuda.synchronize()
        main_buf = bufs[0].view(REPS, -1, SLOTS).cpu()
        merge_buf = bufs[1].view(REPS, -1, SLOTS).cpu() if len(bufs) > 1 else None
        calls = []
        for i in range(2, REPS - 1):
            origin = int(main_buf[i, :, 0].min())
            summary = summarize(main_buf[i], merge_buf[i] if merge_buf is not None else None, origin)
            last_end = int((merge_buf[i] if merge_buf is not None else main_buf[i])[:, 2].max())
            summary["call_us"] = (int(main_buf[i + 1, :, 0].min()) - origin) / 1e3
            summary["gap_to_next_call_us"] = (int(main_buf[i + 1, :, 0].min()) - last_end) / 1e3
            calls.append(summary)
        results[name] = {"calls": calls}
        if args.raw:
            results[name]["raw"] = main_buf.tolist()
            if merge_buf is not None:
                results[name]["raw_merge"] = merge_buf.tolist()
        graph = None
    rows = []
    for name, r in results.items():
        print(f"\n== {name} (calls 2..{REPS - 2}; µs from the call's first program start)")
        for c in r["calls"]:
            line = (f"call {c['call_us']:6.2f} | start max {c['start_us'][2]:5.2f} | loop end min/p50/max "
                    f"{c['loop_end_us'][0]:6.2f}/{c['loop_end_us'][2]:6.2f}/{c['loop_end_us'][4]:6.2f} | end p50/max "
                    f"{c['end_us'][2]:6.2f}/{c['end_us'][4]:6.2f}")
            if "merge_end_us" in c:
                line += (f" | merge start {c['merge_start_us'][0]:6.2f} past wait {c['merge_past_wait_us'][0]:6.2f}"
                         f"-{c['merge_past_wait_us'][1]:6.2f} end {c['merge_end_us'][1]:6.2f}")
            line += f" | gap {c['gap_to_next_call_us']:5.2f}"
            print(line)
        c = r["calls"][len(r["calls"]) // 2]
        print(f"   SMs used {c['sms_used']}, by programs per SM: " + ", ".join(
            f"{n}: {v['programs']} progs end p50 {v['end_us_median']:.2f} max {v['end_us_max']:.2f} "
            f"dur {v['duration_cycles_median']:.0f} cyc" for n, v in c["by_programs_per_sm"].items()))
        print(f"   cycles median: whole {c['duration_cycles_median']:.0f}, loop {c['loop_cycles_median']:.0f}, "
              f"after loop {c['epilogue_cycles_median']:.0f}")
        rows.append({"bench": "probe_decode_timeline", "provider": name,
                     "shape": {"B": 1, "H": H, "H_kv": H_KV, "S": S, "D": D, "block_size": BLOCK, "splits": SPLITS,
                               "dtype": "bfloat16"},
                     "metric": "timeline", "unit": "us", "value": r})
    write_results("probe_decode_timeline", rows, {"timing": "cuda_graph_stamps", "reps": REPS})


if __name__ == "__main__":
    main()
