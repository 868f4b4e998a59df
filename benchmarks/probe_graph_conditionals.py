"""Can a speculative round be chosen on the GPU? A probe of CUDA graph conditional (IF) nodes, for the plan in
docs/speculative-performance.md ("Where the remaining time goes"): one graph per round holding the plain round and
each verify round as IF nodes whose predicates a kernel sets from the round's match class, so that the host queues
rounds ahead instead of waiting ~33 µs per match-gated round for the counters.

PyTorch exposes IF nodes as ``CUDAGraph.begin_capture_to_if_node(pred)`` / ``end_capture_to_conditional_node()``
(the capture behind ``torch.cond`` in CUDA graphs) in recent releases; this script says whether the installed one
has them and, where it does, measures on the GPU (each a CUDA graph replayed back to back, µs per replay):

- ``plain``: a chain of N small Triton kernels (a round is a graph of ~150 kernels) captured plainly;
- ``if_true`` / ``if_false``: the same chain inside one IF node whose predicate is true / false (the cost of a
  taken and of a skipped branch);
- ``choose_1_of_K``: K IF nodes over K such chains, the predicates set by a kernel in the graph from a device
  tensor (one taken): a round graph holding K round variants;
- ``pdl_in_if``: the chain launched with programmatic dependent launch (as the decode step launches its kernels)
  inside an IF body: captured or refused, and whether its result is right.

    python benchmarks/probe_graph_conditionals.py [--kernels 150] [--variants 6]

Writes ``probe_graph_conditionals-<date>.json`` (to ``$OUT`` or benchmarks/results/, GPU runs only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from hf_accel.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl  # noqa: E402


@triton.jit
def _add_one(X, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(X + offs, tl.load(X + offs, mask=m) + 1.0, mask=m)


@triton.jit
def _set_predicates(Choice, Preds, k):
    """Preds[i] = (i == Choice[0]) for i < k (bool as uint8)."""
    offs = tl.arange(0, 64)
    c = tl.load(Choice)
    tl.store(Preds + offs, (offs == c).to(tl.uint8), mask=offs < k)


def chain(x: torch.Tensor, n: int, pdl: bool = False) -> None:
    """``n`` dependent launches of a one-program kernel adding 1 to ``x`` (64 floats)."""
    extra = {"launch_pdl": True} if pdl else {}
    for _ in range(n):
        _add_one[(1,)](x, x.numel(), BLOCK=64, PDL=pdl, **extra)


def replay_us(graph: torch.cuda.CUDAGraph, reps: int = 200) -> float:
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def capture(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=150, help="kernels per chain (a round's graph has ~150)")
    ap.add_argument("--variants", type=int, default=6, help="IF nodes of the choose-1-of-K graph (round variants)")
    args = ap.parse_args()
    has_if = hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
    print(f"torch {torch.__version__}: CUDAGraph.begin_capture_to_if_node {'present' if has_if else 'absent'}")
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing measured")
        return 0
    rows = [{"bench": "probe_graph_conditionals", "provider": "torch", "shape": {}, "metric": "if_nodes_available",
             "unit": "bool", "value": has_if}]
    n, k = args.kernels, args.variants
    x = torch.zeros(64, device="cuda")

    def row(metric, value, unit="us"):
        rows.append({"bench": "probe_graph_conditionals", "provider": "torch",
                     "shape": {"kernels": n, "variants": k}, "metric": metric, "unit": unit, "value": value})
        print(f"{metric:28} {value}")

    row("plain", replay_us(capture(lambda: chain(x, n))))
    if not has_if:
        write_results("probe_graph_conditionals", rows)
        return 0

    def if_graph(pred: torch.Tensor, pdl: bool = False):
        def body():
            g = torch.cuda.CUDAGraph.get_currently_capturing_graph()
            g.begin_capture_to_if_node(pred)
            try:
                chain(x, n, pdl)
            finally:
                g.end_capture_to_conditional_node()
        return capture(body)

    true, false = torch.ones((), dtype=torch.bool, device="cuda"), torch.zeros((), dtype=torch.bool, device="cuda")
    row("if_true", replay_us(if_graph(true)))
    row("if_false", replay_us(if_graph(false)))

    choice = torch.zeros(1, dtype=torch.int32, device="cuda")
    preds = torch.zeros(k, dtype=torch.uint8, device="cuda")

    def choose():
        _set_predicates[(1,)](choice, preds, k)
        g = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        for i in range(k):
            g.begin_capture_to_if_node(preds[i].bool())
            try:
                chain(x, n)
            finally:
                g.end_capture_to_conditional_node()

    graph = capture(choose)
    x.zero_()
    choice.fill_(k - 1)
    graph.replay()
    torch.cuda.synchronize()
    row("choose_1_of_K_result_ok", bool((x == n).all()), "bool")
    row("choose_1_of_K", replay_us(graph))

    pdl = use_pdl(True, x)
    try:
        g = if_graph(true, pdl=pdl)
        x.zero_()
        g.replay()
        torch.cuda.synchronize()
        row("pdl_in_if_captured", True, "bool")
        row("pdl_in_if_result_ok", bool((x == n).all()), "bool")
        row("pdl_in_if", replay_us(g))
        row("pdl_plain", replay_us(capture(lambda: chain(x, n, pdl))))
    except Exception as e:  # the answer is what matters: record it
        row("pdl_in_if_captured", f"{type(e).__name__}: {e}"[:300], "text")
    write_results("probe_graph_conditionals", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
