"""Counters that a kernel writes straight into page-locked host memory, for the host to poll (no copy).

A decode loop that reads a few device counters after each round (a speculative round's accepted counts, whether
any row is still active) usually copies them to page-locked memory and waits on a CUDA event. On an H100 that
copy cost the GPU 11.1-11.4 µs per round (stream order: the copy engine starts after the round's last kernel and
the next round waits for it), against 1.5-2.4 µs for a kernel at the end of the round that stores the counters into
page-locked host memory itself; a round trip in which the host waits for each round before launching the next took
12.0-15.4 µs with the copy and an event, 6.0-6.7 µs polling that memory
(``benchmarks/profile_round_readback.py``, ``profile_round_readback-*-h100-20261206-e2234c8.json``). The same
scheme for the match-gated rounds alone was built and reverted on 3 December (3fc1e09, 2835f61): their round trip
did not shrink end to end, and its poll held Python's GIL; :meth:`HostCounters.wait` now releases it between reads.

:class:`HostCounters` holds a ring of :data:`RING` rows in page-locked memory and a device round number.
:func:`publish_counters` (one program) increments the round number ``s``, writes the counters into row
``s % RING`` and then, after a system-scope fence (PTX ``fence.sc.sys``), ``s`` into the row's first column, so
the host that sees ``s`` there sees that round's counters. Page-locked memory allocated through CUDA is
addressable from the device under unified virtual addressing (CUDA C++ Programming Guide, "Mapped Memory"), which
is what makes the kernel's stores land in host memory. The host reads the number, then the counters, relying on
its loads staying in program order (x86-64 does; other hosts copy the counters instead,
:func:`host_counters_available`). On a CPU (Triton's interpreter, or the PyTorch reference) the ring is ordinary
memory and the writes are done when the call returns.
"""

from __future__ import annotations

import platform
import time

import numpy as np
import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_launch_device, kernels_interpreted

#: Rows of the ring: a round's row is rewritten RING rounds later, so the host must read a round's counters
#: before RING - 1 more rounds have run (the speculative engine keeps at most one queued item of up to 8 rounds).
RING = 16
#: Seconds :meth:`HostCounters.wait` polls before it raises (a round takes milliseconds).
WAIT_TIMEOUT_S = 60.0


@triton.jit
def _publish_kernel(Src, Seq, Ring, n, stride_ring, R: tl.constexpr, BLOCK: tl.constexpr, FENCE: tl.constexpr):
    s = tl.load(Seq) + 1
    tl.store(Seq, s)
    slot = s % R
    offs = tl.arange(0, BLOCK)
    vals = tl.load(Src + offs, mask=offs < n, other=0).to(tl.int64)
    tl.store(Ring + slot * stride_ring + 1 + offs, vals, mask=offs < n)
    tl.debug_barrier()  # every thread's counter stores are issued before the fence below
    if FENCE:  # the counters reach host memory before the round number does
        s = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [s], dtype=tl.int64,
                                      is_pure=False, pack=1)
    tl.store(Ring + slot * stride_ring, s)


def publish_counters(src: torch.Tensor, seq: torch.Tensor, ring: torch.Tensor) -> None:
    """One launch: ``seq += 1``, then ``ring[seq % RING, 1 : n + 1] = src`` and ``ring[seq % RING, 0] = seq``
    (the round number last, after a system-scope fence on CUDA).

    Args:
        src: [n] integer or bool device tensor, contiguous (the round's counters), n <= ring.shape[1] - 1.
        seq: [1] int64 device tensor, the round number (0 before the first round).
        ring: [RING, >= n + 1] int64, contiguous: page-locked host memory for a CUDA ``src`` (what the host polls),
            any CPU tensor for a CPU ``src``.

    Raises:
        ValueError: wrong shapes or dtypes, or a CPU ``src`` without Triton's interpreter
            (:func:`publish_counters_ref` is the PyTorch version).
    """
    n = src.numel()
    if ring.dim() != 2 or ring.shape[0] != RING or ring.shape[1] < n + 1 or ring.dtype != torch.int64:
        raise ValueError(f"publish_counters: ring must be int64 [{RING}, >= {n + 1}], got {ring.dtype} "
                         f"{tuple(ring.shape)}")
    if seq.numel() != 1 or seq.dtype != torch.int64:
        raise ValueError(f"publish_counters: seq must be one int64, got {seq.dtype} {tuple(seq.shape)}")
    if not (src.is_contiguous() and ring.is_contiguous()):
        raise ValueError("publish_counters: src and ring must be contiguous")
    if src.is_cuda and not ring.is_pinned():
        raise ValueError("publish_counters: a CUDA src needs a page-locked ring (torch.zeros(..., pin_memory=True))")
    check_launch_device(src, "publish_counters")
    _publish_kernel[(1,)](src, seq, ring, n, ring.stride(0), R=RING, BLOCK=triton.next_power_of_2(max(n, 1)),
                          FENCE=src.is_cuda and not kernels_interpreted())


def publish_counters_ref(src: torch.Tensor, seq: torch.Tensor, ring: torch.Tensor) -> None:
    """PyTorch version of :func:`publish_counters` (CPU tensors: synchronous host writes)."""
    seq += 1
    s = int(seq)
    ring[s % RING, 1: src.numel() + 1] = src.to(torch.int64)
    ring[s % RING, 0] = s


class HostCounters:
    """The ring of :func:`publish_counters` and the round numbers on both sides, for ``n`` counters.

    The host numbers the rounds it launches (:meth:`expect`) and waits for a number to appear in its row
    (:meth:`wait`). Before a round whose number the host will wait for is launched, :meth:`expect` marks its row
    unwritten, so a value left there by an earlier call (whose numbers started at 1 too) is never taken for it.

    Attributes:
        seq: [1] int64 on ``device``: the last round number published.
        ring: [RING, n + 1] int64 host tensor (page-locked for a CUDA ``device``); ``ring_np`` its numpy view.
        launched: the host's count of publishing rounds launched since :meth:`reset`.
    """

    def __init__(self, n: int, device):
        device = torch.device(device)
        self.n = n
        self.seq = torch.zeros(1, dtype=torch.long, device=device)
        self.ring = torch.zeros(RING, n + 1, dtype=torch.long, pin_memory=device.type == "cuda")
        self.ring_np = self.ring.numpy()
        self.launched = 0

    def reset(self) -> None:
        """Round numbers start again at 1 (a device fill, queued)."""
        self.seq.zero_()
        self.launched = 0

    def expect(self, rounds: int) -> int:
        """Before launching ``rounds`` rounds that each publish: the number the last of them will write, its row
        marked unwritten."""
        if not 1 <= rounds < RING:
            raise ValueError(f"expect: rounds must be in 1..{RING - 1} (the ring's rows), got {rounds}")
        self.launched += rounds
        self.ring_np[self.launched % RING, 0] = -1
        return self.launched

    def wait(self, number: int) -> np.ndarray:
        """Poll until round ``number`` has published (releasing the GIL between reads); returns a copy of its ``n``
        counters.

        Raises:
            RuntimeError: nothing arrived within :data:`WAIT_TIMEOUT_S` seconds, or the row was rewritten while
                it was read (more than ``RING - 1`` later rounds ran).
        """
        row = self.ring_np[number % RING]
        if row[0] != number:
            deadline = time.perf_counter() + WAIT_TIMEOUT_S
            while row[0] != number:
                # a CUDA event wait releases the GIL; a poll holds it unless it lets go between reads (other Python
                # threads, a server's or a streamer consumer's, would otherwise wait for the switch interval)
                time.sleep(0)
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"round {number}'s counters did not reach page-locked host memory within "
                                       f"{WAIT_TIMEOUT_S:.0f} s (the row holds round {int(row[0])})")
        out = row[1: self.n + 1].copy()
        if row[0] != number:
            raise RuntimeError(f"round {number}'s counters were overwritten while they were read: more than "
                               f"{RING - 1} rounds ran after it")
        return out


_AVAILABLE: dict = {}


def host_counters_available(device) -> bool:
    """Whether :func:`publish_counters` reaches page-locked host memory from ``device`` (checked once per CUDA
    device with one launch and a synchronize; always True for a CPU). Where it does not, or the host is not x86-64
    (see the module's notes), the reason is logged once and callers copy their counters instead."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _AVAILABLE:
        from hf_accel._logging import log_once
        from hf_accel.kernels.device import on_device

        reason = None
        if platform.machine().lower() not in ("x86_64", "amd64"):
            reason = (f"the host is {platform.machine()}, whose loads may be reordered (the counters could be read "
                      f"before the round number that guards them)")
        try:
            if reason is None:
                with on_device(torch.device("cuda", index)):
                    probe = HostCounters(1, torch.device("cuda", index))
                    src = torch.full((1,), 7, dtype=torch.long, device=probe.seq.device)
                    publish_counters(src, probe.seq, probe.ring)
                    torch.cuda.synchronize(index)
                    if probe.ring_np[1, 0] != 1 or probe.ring_np[1, 1] != 7:
                        reason = f"the probe's counters did not arrive (row {probe.ring_np[1, :2].tolist()})"
        except Exception as e:  # noqa: BLE001 (any failure means: copy instead; logged)
            reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            log_once(f"host_counters:{index}", f"hf-accel: round counters are copied to the host after each round "
                     f"(a kernel could not write them into page-locked memory on cuda:{index}: {reason})")
        _AVAILABLE[index] = reason is None
    return _AVAILABLE[index]
