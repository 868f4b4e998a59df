"""Can the device choose each speculative round's graph itself? CUDA-graph conditional (IF) nodes against
the host's round trip, on synthetic rounds (CUDA; no model).

A match-gated round today ends with its counters copied to the host, which waits for them, picks the next
round's graph (plain step or verify pass) and replays it: the GPU idles ~30 µs per round. Here a round is a
chain of ``--kernels`` small Triton kernels (launched with programmatic dependent launch, as the decode
step's are, unless ``--no-pdl``), in two kinds A and B that stand for the plain and the verify round; a
deterministic pattern of "match classes" picks the kind of every round. Variants, as µs per round over
``--iters`` rounds, in turns over ``--passes``:

* ``queued``: rounds of kind A replayed back to back, nothing chosen (the floor);
* ``host_gated``: the host reads the round's class (copy to page-locked memory, CUDA event, wait) and
  replays the graph of the kind it picks (today's pattern);
* ``cond_r<R>``: one graph of R rounds; each round is a tiny kernel that reads the class, looks the kind up
  in a device table and writes two predicates, then ``IF(A) {round A}`` and ``IF(B) {round B}``
  (PyTorch's ``CUDAGraph.begin_capture_to_if_node``, where this PyTorch has it), replayed back to back;
* ``switch_r<R>``: ``GraphSwitch`` of benchmarks/graph_switch.py (a SWITCH node built through the driver API,
  for PyTorch releases without conditional nodes) over the graphs of rounds A and B, each ending with a kernel
  that writes the next round's kind as the switch's index; R rounds per launch, replayed back to back.

Every variant is checked: the counts of A and B rounds it ran equal the pattern's. The overhead of a
device-chosen round = ``cond_r<R>`` - ``queued``; the host's round trip = ``host_gated`` - ``queued``.
Writes ``profile_conditional_rounds-<date>.json``. NVIDIA, CUDA Programming Guide, "Conditional Graph Nodes".

    python benchmarks/profile_conditional_rounds.py [--kernels 200] [--iters 240] [--passes 3] [--no-pdl]
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

from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl  # noqa: E402

CLASSES = 4
TABLE = (0, 1, 1, 0)  # class -> kind (0: A, 1: B)


@triton.jit
def _link_kernel(X, slot, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(X + slot, tl.load(X + slot) + 1.0)


@triton.jit
def _choose_kernel(Cls, Table, Preds, Counts, PDL: tl.constexpr):
    """preds = (kind == A, kind == B) of the current class; the class advances (a fixed pattern)."""
    if PDL:
        gdc_wait()
    c = tl.load(Cls)
    kind = tl.load(Table + c)
    tl.store(Preds, kind == 0)
    tl.store(Preds + 1, kind == 1)
    tl.store(Counts + kind, tl.load(Counts + kind) + 1)
    tl.store(Cls, (c * 5 + 3) % 4)


@triton.jit
def _choose_index_kernel(Cls, Table, Index, PDL: tl.constexpr):
    """Index = kind of the current class (the switch's next branch); the class advances (the same pattern)."""
    if PDL:
        gdc_wait()
    c = tl.load(Cls)
    tl.store(Index, tl.load(Table + c).to(tl.int32))
    tl.store(Cls, (c * 5 + 3) % 4)


def _pattern(n: int, c0: int = 0) -> list[int]:
    kinds, c = [], c0
    for _ in range(n):
        kinds.append(TABLE[c])
        c = (c * 5 + 3) % 4
    return kinds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--iters", type=int, default=240, help="rounds per timed run (a multiple of every R)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--rounds-per-graph", default="1,4,8")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--no-switch", action="store_true", help="skip the switch_r<R> variants")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    dev = "cuda"
    x = torch.zeros(2, device=dev)
    pdl = use_pdl(not args.no_pdl, x)
    launch = {"launch_pdl": True} if pdl else {}
    cls = torch.zeros(1, dtype=torch.long, device=dev)
    table = torch.tensor(TABLE, dtype=torch.long, device=dev)
    preds = torch.zeros(2, dtype=torch.bool, device=dev)
    counts = torch.zeros(2, dtype=torch.long, device=dev)

    def body(kind: int):
        for _ in range(args.kernels):
            _link_kernel[(1,)](x, kind, PDL=pdl, **launch)

    def choose():
        _choose_kernel[(1,)](cls, table, preds, counts, PDL=pdl, **launch)

    def capture(fn, keep=False):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    graphs = {"A": capture(lambda: body(0)), "B": capture(lambda: body(1)), "choose": capture(choose)}
    rs = [int(r) for r in args.rounds_per_graph.split(",")]
    cond_error = None
    for r in rs:
        def rounds(r=r):
            g = torch.cuda.CUDAGraph.get_currently_capturing_graph() if torch.cuda.is_current_stream_capturing() else None
            for _ in range(r):
                choose()
                for kind in (0, 1):
                    if g is None:  # warm-up outside the capture
                        body(kind)
                        continue
                    g.begin_capture_to_if_node(preds[kind])
                    try:
                        body(kind)
                    finally:
                        g.end_capture_to_conditional_node()
        try:
            graphs[f"cond_r{r}"] = capture(rounds)
        except Exception as e:  # noqa: BLE001 (reported: this torch / driver may lack conditional nodes)
            cond_error = f"{type(e).__name__}: {e}"
            print(f"cond_r{r}: capture failed: {cond_error}", flush=True)
            break

    index = torch.zeros(1, dtype=torch.int32, device=dev)
    switch_error = None
    if not args.no_switch:
        from graph_switch import GraphSwitch, switch_unavailable

        switch_error = switch_unavailable()
        if switch_error is None:
            def branch(kind):
                body(kind)
                _choose_index_kernel[(1,)](cls, table, index, PDL=pdl, **launch)
            try:
                kept = [capture(lambda: branch(0), keep=True), capture(lambda: branch(1), keep=True)]
                for r in rs:
                    graphs[f"switch_r{r}"] = GraphSwitch(kept, index, rounds=r)
            except Exception as e:  # noqa: BLE001 (reported: the driver may refuse a node type in a body)
                switch_error = f"{type(e).__name__}: {e}"
        if switch_error:
            print(f"switch: unavailable: {switch_error}", flush=True)

    def reset():
        torch.cuda.synchronize()
        x.zero_()
        cls.zero_()
        counts.zero_()
        if "switch_r1" in graphs:  # the first round's index, as the round before it would have written it
            _choose_index_kernel[(1,)](cls, table, index, PDL=False)
        torch.cuda.synchronize()

    def queued(n):
        for _ in range(n):
            graphs["A"].replay()

    preds_pinned = torch.zeros(2, dtype=torch.bool, pin_memory=True)

    def host_gated(n):
        for _ in range(n):
            graphs["choose"].replay()
            preds_pinned.copy_(preds, non_blocking=True)
            e = torch.cuda.Event()
            e.record()
            e.synchronize()
            graphs["B" if bool(preds_pinned[1]) else "A"].replay()

    variants = {"queued": queued, "host_gated": host_gated}
    for r in rs:
        if f"cond_r{r}" in graphs:
            variants[f"cond_r{r}"] = (lambda n, r=r: [graphs[f"cond_r{r}"].replay() for _ in range(n // r)])
    for r in rs:
        if f"switch_r{r}" in graphs:
            variants[f"switch_r{r}"] = (lambda n, r=r: [graphs[f"switch_r{r}"].replay() for _ in range(n // r)])

    # correctness: every variant that chooses ran the pattern's kinds
    checks = {}
    for name, fn in variants.items():
        reset()
        fn(args.iters)
        torch.cuda.synchronize()
        kinds = _pattern(args.iters)
        want_b = sum(kinds)
        if name == "queued":
            ok = int(x[0]) == args.iters * args.kernels
        elif name.startswith("switch"):  # the kinds are chosen by the rounds themselves (no counts kept)
            ok = int(x[1]) == want_b * args.kernels and int(x[0]) == (args.iters - want_b) * args.kernels
        else:
            ok = (int(x[1]) == want_b * args.kernels and int(x[0]) == (args.iters - want_b) * args.kernels
                  and int(counts[1]) == want_b)
        checks[name] = ok
        print(f"check {name}: {'ok' if ok else 'WRONG'} (A {int(x[0])}, B {int(x[1])}, want B rounds {want_b})",
              flush=True)
    times = time_in_turns(variants, args.iters, args.passes, reset=reset)
    base = statistics.median(times["queued"])
    rows = []
    print("-- us per round (median over passes); overhead = minus queued")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"   {name:>12}: {med:8.2f}  overhead {med - base:6.2f}  {'ok' if checks[name] else 'WRONG'}")
        shape = {"graph_kernels": args.kernels, "iters": args.iters, "variant": name, "pdl": pdl}
        rows.append({"bench": "profile_conditional_rounds", "provider": "ours", "shape": shape,
                     "metric": "us_per_round", "unit": "us", "value": v})
        rows.append({"bench": "profile_conditional_rounds", "provider": "ours", "shape": shape,
                     "metric": "overhead_us", "unit": "us", "value": med - base})
        rows.append({"bench": "profile_conditional_rounds", "provider": "ours", "shape": shape,
                     "metric": "correct", "unit": "bool", "value": checks[name]})
    meta = {k: v for k, v in (("conditional_capture_error", cond_error), ("switch_error", switch_error)) if v}
    write_results("profile_conditional_rounds", rows, meta or None)


if __name__ == "__main__":
    main()
