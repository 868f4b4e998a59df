"""What does reading a speculative round's counters on the host cost the GPU? Synthetic rounds (CUDA; no model).

A round is a CUDA graph of ``--kernels`` small Triton kernels launched with programmatic dependent launch, as the
decode step's are (~0.3-0.5 ms, as a SmolLM2 round). The host reads each round's counters (``--counters`` int64)
in one of these ways, as µs per round over ``--iters`` rounds, timed in turns over ``--passes``:

* ``queued``: rounds replayed back to back, nothing read (the floor);
* ``ahead1_copy``: today's ungated rounds, one per queued item: after each replay the counters are copied to
  page-locked memory without blocking and a timing CUDA event is recorded; the host keeps one item queued and
  waits for the oldest one's event, then reads its counters and the two events' elapsed time;
* ``ahead1_copy_small``: the same copying only the first ``--small`` counters, with events made once, no timing;
* ``burst8_copy``: as ``ahead1_copy`` with 8 replays per item (the ungated plain bursts before);
* ``ahead1_event``: a timing event per round and the host's wait for the oldest one, no copy (nothing read);
* ``ahead1_mapped``: the round graph ends with a kernel that writes the counters and a sequence number into a
  page-locked ring (a kernel store to host memory, no copy, no event); the host keeps one round queued and
  polls the oldest round's sequence number;
* ``ahead1_mapped_timed``: as ``ahead1_mapped`` with a timing event per round (the rounds' times);
* ``ahead1_mapped_fence`` / ``gated_mapped_fence``: as the mapped ones with plain stores and a system-scope fence
  before the round number instead of an atomic exchange;
* ``gated_copy``: the host waits for each round before it launches the next (match-gated prompt lookup): copy,
  event, wait;
* ``gated_mapped``: the same, polling the sequence number that the round's last kernel wrote.

Every variant is checked: the rounds ran (the kernels' count) and each read saw its own round's counters.
Writes ``profile_round_readback-<date>.json``.

    python benchmarks/profile_round_readback.py [--kernels 200] [--iters 400] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, time_in_turns, write_results  # noqa: E402

from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl  # noqa: E402

RING = 4


@triton.jit
def _link_kernel(X, Info, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(X, tl.load(X) + 1.0)


@triton.jit
def _count_kernel(Info, PDL: tl.constexpr):
    """The round's counters: info[0] = rounds run so far, info[1:] = info[0] * index (checked on the host)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.load(Info) + 1
    tl.store(Info, r)
    offs = tl.arange(0, 512)
    tl.store(Info + 1 + offs, r * (offs + 1), mask=offs < 309)


@triton.jit
def _publish_kernel(Info, Ring, n, R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, ATOMIC: tl.constexpr):
    """Ring[slot, 1:n+1] = Info[:n], then Ring[slot, 0] = the round number, with slot = round number % R; Ring is
    page-locked host memory. ``ATOMIC``: the number by a system-scope release exchange; else plain stores, a
    system-scope fence (PTX ``fence.sc.sys``), then the number."""
    if PDL:
        gdc_wait()
    r = tl.load(Info)
    slot = r % R
    offs = tl.arange(0, BLOCK)
    vals = tl.load(Info + offs, mask=offs < n)
    tl.store(Ring + slot * (BLOCK + 1) + 1 + offs, vals, mask=offs < n)
    tl.debug_barrier()
    if ATOMIC:
        tl.atomic_xchg(Ring + slot * (BLOCK + 1), r, sem="release", scope="sys")
    else:
        r = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [r], dtype=tl.int64,
                                      is_pure=False, pack=1)
        tl.store(Ring + slot * (BLOCK + 1), r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--iters", type=int, default=400, help="rounds per timed run (a multiple of 8)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--counters", type=int, default=310, help="int64 counters a round writes (today's info)")
    ap.add_argument("--small", type=int, default=38, help="counters the small copy and the mapped ring carry")
    ap.add_argument("--no-mapped", action="store_true", help="leave out the variants writing to host memory")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    dev = "cuda"
    x = torch.zeros(1, device=dev)
    info = torch.zeros(max(args.counters, 310), dtype=torch.long, device=dev)
    pdl = use_pdl(True, x)
    launch = {"launch_pdl": True} if pdl else {}
    block = triton.next_power_of_2(args.small)
    ring = torch.zeros(RING, block + 1, dtype=torch.long, pin_memory=True)
    ring_np = ring.numpy()

    def body():
        for _ in range(args.kernels - 1):
            _link_kernel[(1,)](x, info, PDL=pdl, **launch)
        _count_kernel[(1,)](info, PDL=pdl, **launch)

    def body_mapped():
        body()
        _publish_kernel[(1,)](info, ring, args.small, R=RING, BLOCK=block, PDL=pdl, ATOMIC=True, **launch)

    def body_fence():
        body()
        _publish_kernel[(1,)](info, ring, args.small, R=RING, BLOCK=block, PDL=pdl, ATOMIC=False, **launch)

    def capture(fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    mapped_error = fence_error = None
    graph = capture(body)
    graph_mapped = graph_fence = None
    if not args.no_mapped:
        try:
            graph_mapped = capture(body_mapped)
        except Exception as e:  # noqa: BLE001 (reported: Triton or the driver may refuse a host pointer)
            mapped_error = f"{type(e).__name__}: {e}"
            print(f"mapped: unavailable: {mapped_error}", flush=True)
        try:
            graph_fence = capture(body_fence)
        except Exception as e:  # noqa: BLE001 (reported)
            fence_error = f"{type(e).__name__}: {e}"
            print(f"mapped fence: unavailable: {fence_error}", flush=True)

    pinned = torch.zeros(3, info.numel(), dtype=torch.long, pin_memory=True)
    pinned_np = pinned.numpy()
    bad = []  # reads that saw another round's counters

    def reset():
        torch.cuda.synchronize()
        x.zero_()
        info.zero_()
        ring.zero_()
        torch.cuda.synchronize()

    def check_row(row, want_round, n):
        if int(row[0]) != want_round or int(row[n - 1]) != want_round * (n - 1):
            bad.append((want_round, int(row[0])))

    def queued(n):
        for _ in range(n):
            graph.replay()

    def copy_loop(n, burst, small, timing):
        inflight, slot, done, last = [], 0, 0, None
        cols = args.small if small else info.numel()
        events = [torch.cuda.Event() for _ in range(3)] if not timing else None
        for i in range(n // burst):
            for _ in range(burst):
                graph.replay()
            pinned[slot, :cols].copy_(info[:cols], non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True) if timing else events[slot]
            ev.record()
            inflight.append((ev, slot))
            slot = (slot + 1) % 3
            if len(inflight) <= 1:
                continue
            ev, s = inflight.pop(0)
            ev.synchronize()
            done += burst
            check_row(pinned_np[s], done, cols)
            if timing and last is not None:
                last.elapsed_time(ev)
            last = ev
        for ev, s in inflight:
            ev.synchronize()
            done += burst
            check_row(pinned_np[s], done, cols)

    def mapped_loop(n, ahead, timing=False, g=None):
        g = g or graph_mapped
        launched = done = 0
        events, last = [], None
        while done < n:
            while launched < n and launched - done <= ahead:
                g.replay()
                if timing:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    events.append(ev)
                launched += 1
            want = done + 1
            slot = want % RING
            deadline = time.perf_counter() + 5.0
            while ring_np[slot, 0] != want:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"round {want}'s counters did not reach the host in 5 s "
                                       f"(slot holds {int(ring_np[slot, 0])})")
            check_row(ring_np[slot, 1:], want, args.small)
            done += 1
            if timing:  # the round's time from its event (recorded after the publish, so complete by now)
                ev = events.pop(0)
                ev.synchronize()
                if last is not None:
                    last.elapsed_time(ev)
                last = ev

    def event_loop(n):
        inflight, last = [], None
        for i in range(n):
            graph.replay()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            inflight.append(ev)
            if len(inflight) <= 1:
                continue
            ev = inflight.pop(0)
            ev.synchronize()
            if last is not None:
                last.elapsed_time(ev)
            last = ev
        torch.cuda.synchronize()

    def gated_copy(n):
        ev = torch.cuda.Event()
        for i in range(n):
            graph.replay()
            pinned[0, : args.small].copy_(info[: args.small], non_blocking=True)
            ev.record()
            ev.synchronize()
            check_row(pinned_np[0], i + 1, args.small)

    variants = {
        "queued": queued,
        "ahead1_copy": lambda n: copy_loop(n, 1, False, True),
        "ahead1_copy_small": lambda n: copy_loop(n, 1, True, False),
        "burst8_copy": lambda n: copy_loop(n, 8, False, True),
        "ahead1_event": event_loop,
        "gated_copy": gated_copy,
    }
    if graph_mapped is not None:
        variants["ahead1_mapped"] = lambda n: mapped_loop(n, 1)
        variants["ahead1_mapped_timed"] = lambda n: mapped_loop(n, 1, timing=True)
        variants["gated_mapped"] = lambda n: mapped_loop(n, 0)
    if graph_fence is not None:
        variants["ahead1_mapped_fence"] = lambda n: mapped_loop(n, 1, g=graph_fence)
        variants["gated_mapped_fence"] = lambda n: mapped_loop(n, 0, g=graph_fence)

    checks, failed = {}, {}
    for name, fn in list(variants.items()):
        reset()
        bad.clear()
        try:
            fn(args.iters)
        except TimeoutError as e:
            failed[name] = str(e)
            print(f"check {name}: FAILED: {e}", flush=True)
            del variants[name]
            continue
        torch.cuda.synchronize()
        ok = int(x[0]) == args.iters * (args.kernels - 1) and int(info[0]) == args.iters and not bad
        checks[name] = ok
        print(f"check {name}: {'ok' if ok else 'WRONG'} (kernels {int(x[0])}, rounds {int(info[0])}, "
              f"bad reads {bad[:3]})", flush=True)
    times = time_in_turns(variants, args.iters, args.passes, reset=reset)
    base = statistics.median(times["queued"])
    rows = []
    print("-- us per round (median over passes); overhead = minus queued")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"   {name:>18}: {med:8.2f}  overhead {med - base:6.2f}  {'ok' if checks[name] else 'WRONG'}")
        shape = {"graph_kernels": args.kernels, "iters": args.iters, "variant": name, "pdl": pdl,
                 "counters": args.counters, "small": args.small}
        rows.append({"bench": "profile_round_readback", "provider": "ours", "shape": shape,
                     "metric": "us_per_round", "unit": "us", "value": v})
        rows.append({"bench": "profile_round_readback", "provider": "ours", "shape": shape,
                     "metric": "overhead_us", "unit": "us", "value": med - base})
        rows.append({"bench": "profile_round_readback", "provider": "ours", "shape": shape,
                     "metric": "correct", "unit": "bool", "value": checks[name]})
    errors = {k: v for k, v in (("mapped_error", mapped_error), ("fence_error", fence_error), ("failed", failed)) if v}
    write_results("profile_round_readback", rows, errors or None)


if __name__ == "__main__":
    main()
