"""What a host round trip between two CUDA-graph replays costs, and which part of it the counters' copy is
(CUDA; synthetic graphs, no model).

A match-gated speculative round ends with a device-to-host copy of its counters, a CUDA event, the host
waiting for that event, reading the counters and replaying the next round's graph. This times that pattern
on a stand-in graph (``--kernels`` small kernels in a chain, as a round's ~200) and variants of it, as the
mean wall time per iteration over ``--iters`` iterations, in turns over ``--rounds``:

* ``queued``: replays queued back to back, no host wait (the graph's own time on the GPU);
* ``copy_event``: replay, counters copied to page-locked memory (a separate ``copy_``), event, wait (today);
* ``copy_in_graph``: the copy captured as the graph's last node; event, wait;
* ``event_only``: no copy; event, wait (the floor of an event-based round trip);
* ``kernel_write_spin``: the graph's last kernel (Triton) writes the counters and a sequence number straight
  into page-locked host memory; the host spins on the sequence number (no copy, no event).

The round trip of a variant = its time per iteration - ``queued``. Writes ``profile_sync_turnaround-<date>.json``.

    python benchmarks/profile_sync_turnaround.py [--kernels 200] [--iters 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, time_in_turns, write_results  # noqa: E402

INFO = 300  # int64 counters, about a round's ``info`` row


@triton.jit
def _mailbox_kernel(Src, Dst, Seq, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Dst + 1 + offs, tl.load(Src + offs, mask=offs < n), mask=offs < n)
    seq = tl.load(Seq) + 1
    tl.store(Seq, seq)
    tl.debug_barrier()
    tl.atomic_xchg(Dst, seq, sem="release", scope="sys")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    require_cuda(__file__)
    dev = "cuda"
    x = torch.zeros(256, device=dev)
    info = torch.arange(INFO, dtype=torch.long, device=dev)
    seq = torch.zeros(1, dtype=torch.long, device=dev)
    pinned = torch.zeros(INFO, dtype=torch.long, pin_memory=True)
    mailbox = torch.zeros(INFO + 1, dtype=torch.long, pin_memory=True)
    box = mailbox.numpy()

    def body():
        for _ in range(args.kernels):
            x.add_(1.0)
        info.add_(1)

    graphs = {}
    for name in ("plain", "copy", "mailbox"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                body()
                if name == "copy":
                    pinned.copy_(info, non_blocking=True)
                elif name == "mailbox":
                    _mailbox_kernel[(1,)](info, mailbox, seq, INFO, BLOCK=512)
        except Exception as e:  # noqa: BLE001 (a variant this machine cannot capture is reported, not fatal)
            print(f"{name}: capture failed: {type(e).__name__}: {e}", flush=True)
            g = None
        graphs[name] = g
    torch.cuda.synchronize()

    def queued(n):
        for _ in range(n):
            graphs["plain"].replay()
        torch.cuda.synchronize()

    def copy_event(n):
        for _ in range(n):
            graphs["plain"].replay()
            pinned.copy_(info, non_blocking=True)
            e = torch.cuda.Event()
            e.record()
            e.synchronize()
            _ = int(pinned[3])

    def copy_in_graph(n):
        for _ in range(n):
            graphs["copy"].replay()
            e = torch.cuda.Event()
            e.record()
            e.synchronize()
            _ = int(pinned[3])

    def event_only(n):
        for _ in range(n):
            graphs["plain"].replay()
            e = torch.cuda.Event()
            e.record()
            e.synchronize()

    def kernel_write_spin(n):
        want = int(box[0])
        for _ in range(n):
            graphs["mailbox"].replay()
            want += 1
            while box[0] != want:
                pass
            _ = int(box[4])

    variants = {"queued": queued, "copy_event": copy_event, "copy_in_graph": copy_in_graph, "event_only": event_only}
    if graphs["mailbox"] is not None:
        variants["kernel_write_spin"] = kernel_write_spin
    if graphs["copy"] is None:
        del variants["copy_in_graph"]
    for fn in variants.values():  # warm-up
        fn(20)
    torch.cuda.synchronize()
    if "kernel_write_spin" in variants:  # the mailbox really holds the counters
        torch.cuda.synchronize()
        assert int(box[1 + 5]) == int(info[5]), (int(box[1 + 5]), int(info[5]))
    times = time_in_turns(variants, args.iters, args.rounds, label="round")
    base = statistics.median(times["queued"])
    rows = []
    print("-- us per iteration (median over rounds); round trip = minus queued")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"   {name:>18}: {med:8.2f}  round trip {med - base:6.2f}")
        rows.append({"bench": "profile_sync_turnaround", "provider": "ours",
                     "shape": {"graph_kernels": args.kernels, "iters": args.iters, "variant": name},
                     "metric": "us_per_iteration", "unit": "us", "value": v})
        rows.append({"bench": "profile_sync_turnaround", "provider": "ours",
                     "shape": {"graph_kernels": args.kernels, "iters": args.iters, "variant": name},
                     "metric": "round_trip_us", "unit": "us", "value": med - base})
    write_results("profile_sync_turnaround", rows)


if __name__ == "__main__":
    main()
