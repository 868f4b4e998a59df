"""Row-wise argmax over a vocabulary in one kernel launch, and the greedy decode step's pick + bookkeeping
fused into it.

Each program takes one ``BLOCK``-wide chunk of a row and keeps the largest *packed key* of the chunk: the
value's float32 bits mapped to an int32 of the same order (sign-magnitude to two's complement), shifted
up 32 bits, with ``2^31 - 1 - column`` below, so the int64 maximum is the largest value and, among equal
values, the first column (``torch.argmax``'s tie rule). NaN maps above +inf (``torch.argmax`` returns a
NaN's index too) and -0.0 to +0.0. The chunk keys go to a scratch row; the last program of the row to
arrive (:mod:`hf_accel.kernels.arrival`) reduces them. ``torch.argmax`` of one 49k-entry row is a
multi-block reduction kernel; inside the decode step's CUDA graph the greedy pick and its bookkeeping
were ~10 small PyTorch kernels, which :func:`greedy_tail` replaces with one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.arrival import check_counters, last_to_arrive, reset_arrivals
from hf_accel.kernels.device import check_dense, check_launch_device

#: Columns per program: 24 programs per row for a 49152-entry vocabulary, 63 for 128256.
BLOCK = 2048
_NUM_WARPS = 4
_INT64_MIN = tl.constexpr(-9223372036854775807)  # (the most negative int64 + 1: a literal Triton takes as int64)


@triton.jit
def _chunk_key(X, row, chunk, stride_x, vocab, BLOCK: tl.constexpr):
    """The largest packed key of columns ``[chunk * BLOCK, (chunk + 1) * BLOCK)`` of ``row``."""
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)  # -0.0 equals +0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reversed magnitude order
    key = tl.where(x != x, 0x7FFFFFFF, key)  # NaN above +inf
    packed = (key.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    packed = tl.where(cols < vocab, packed, _INT64_MIN)
    return tl.max(packed, axis=0)


@triton.jit
def _row_argmax(Partials, row, num_chunks, BLOCK_C: tl.constexpr):
    """The row's argmax from its chunk keys (by the row's last program; loads past L1)."""
    c = tl.arange(0, BLOCK_C)
    keys = tl.load(Partials + row * num_chunks + c, mask=c < num_chunks, other=_INT64_MIN, cache_modifier=".cg")
    best = tl.max(keys, axis=0)
    return 0x7FFFFFFF - (best & 0xFFFFFFFF)


@triton.jit
def _argmax_kernel(X, Out, Partials, Counters, stride_x, vocab, num_chunks, BLOCK: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    tl.store(Partials + row * num_chunks + chunk, _chunk_key(X, row, chunk, stride_x, vocab, BLOCK))
    if last_to_arrive(Counters + row, num_chunks):
        tl.store(Out + row, _row_argmax(Partials, row, num_chunks, BLOCK_C))
        reset_arrivals(Counters + row)


def _launch_shape(x: torch.Tensor, op: str) -> tuple[int, int, int]:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: x must be [rows, vocab] float32/bfloat16/float16 with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    check_launch_device(x, op, "torch.argmax(x, dim=-1)" if op == "argmax_rows" else None)
    rows, vocab = x.shape
    if rows < 1 or vocab < 1 or vocab >= 2**31:
        raise ValueError(f"{op}: need >= 1 row and 1 <= vocab < 2^31, got {tuple(x.shape)}")
    return rows, vocab, triton.cdiv(vocab, BLOCK)


def scratch_for(rows: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [rows * chunks] int64, counters [rows + 2] int32 zeros): the scratch :func:`argmax_rows` and
    :func:`greedy_tail` take for up to ``rows`` rows of ``vocab`` columns (reusable launch after launch on
    one stream; the kernels leave the counters at zero)."""
    return (torch.empty(rows * triton.cdiv(vocab, BLOCK), dtype=torch.int64, device=device),
            torch.zeros(rows + 2, dtype=torch.int32, device=device))


def _check_scratch(partials, counters, rows, chunks, device, op):
    if partials.dtype != torch.int64 or partials.device != device or partials.numel() < rows * chunks:
        raise ValueError(f"{op}: partials must be int64 with >= {rows * chunks} elements on {device}, got "
                         f"{partials.dtype} {tuple(partials.shape)} on {partials.device}")
    check_counters(counters, rows + 2, device)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, scratch=None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor in one launch (same result: first index of the maximum, NaN
    counted as the maximum).

    Args:
        x: [rows, vocab] float32 / bfloat16 / float16, rows contiguous (a row stride is fine).
        out: optional [rows] int64 output.
        scratch: optional ``(partials, counters)`` from :func:`scratch_for` (needed for CUDA-graph capture:
            made here otherwise).

    Returns:
        [rows] int64.

    Raises:
        ValueError: other shapes / dtypes, bad scratch, or a CPU tensor outside Triton's interpreter.
    """
    rows, vocab, chunks = _launch_shape(x, "argmax_rows")
    partials, counters = scratch if scratch is not None else scratch_for(rows, vocab, x.device)
    _check_scratch(partials, counters, rows, chunks, x.device, "argmax_rows")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or out.device != x.device:
        raise ValueError(f"argmax_rows: out must be a [{rows}] int64 tensor on {x.device}; got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    check_dense("argmax_rows", out=out)
    _argmax_kernel[(rows, chunks)](x, out, partials, counters, x.stride(0), vocab, chunks, BLOCK=BLOCK,
                                   BLOCK_C=triton.next_power_of_2(chunks), num_warps=_NUM_WARPS)
    return out


@triton.jit
def _greedy_tail_kernel(X, Partials, Counters, Tokens, Unfinished, Pad, Eos, InputIds, PositionIds, CacheLens, Cur,
                        StepsRun, stride_x, vocab, num_chunks, batch, stride_tok, stride_in, stride_pos, num_eos,
                        BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    tl.store(Partials + row * num_chunks + chunk, _chunk_key(X, row, chunk, stride_x, vocab, BLOCK))
    if last_to_arrive(Counters + row, num_chunks):
        nxt = _row_argmax(Partials, row, num_chunks, BLOCK_C)
        reset_arrivals(Counters + row)
        was = tl.load(Unfinished + row) != 0
        tok = tl.where(was, nxt, tl.load(Pad))
        cur = tl.load(Cur)
        tl.store(Tokens + row.to(tl.int64) * stride_tok + cur, tok)
        e = tl.arange(0, BLOCK_E)
        eos = tl.load(Eos + e, mask=e < num_eos, other=-1)
        hit = tl.sum(((eos == tok) & (eos >= 0)).to(tl.int32), axis=0) > 0
        tl.store(Unfinished + row, (was & (hit == 0)).to(tl.uint8))
        tl.store(InputIds + row * stride_in, tok)
        tl.store(PositionIds + row * stride_pos, tl.load(PositionIds + row * stride_pos) + 1)
        tl.store(CacheLens + row, tl.load(CacheLens + row) + 1)
        # rows done: the last one counts the step (if any row was unfinished before it) and advances ``cur``
        tl.atomic_max(Counters + batch + 1, was.to(tl.int32))
        if last_to_arrive(Counters + batch, batch):
            any_unfinished = tl.atomic_xchg(Counters + batch + 1, 0)
            tl.store(StepsRun, tl.load(StepsRun) + any_unfinished.to(tl.int64))
            tl.store(Cur, cur + 1)
            reset_arrivals(Counters + batch)


def greedy_tail(logits: torch.Tensor, tokens: torch.Tensor, unfinished: torch.Tensor, pad: torch.Tensor,
                eos: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_lens: torch.Tensor,
                cur: torch.Tensor, steps_run: torch.Tensor, scratch) -> None:
    """The greedy decode step's pick and end-of-sequence bookkeeping (transformers' greedy loop) in one
    launch, on the device; :func:`greedy_tail_ref` is the PyTorch version. For each row ``r``:
    ``nxt = argmax(logits[r])``, or ``pad`` once the row has finished; ``tokens[r, cur] = nxt``; the row
    finishes on an EOS id; ``input_ids[r, 0] = nxt``; ``position_ids[r, 0]`` and ``cache_lens[r]`` + 1. Then
    ``steps_run`` + 1 if any row was unfinished before the step, and ``cur`` + 1.

    Args:
        logits: [batch, vocab] float32 / bfloat16 (rows contiguous).
        tokens: [batch, capacity] int64 — prompt + output so far; column ``cur`` is written.
        unfinished: [batch] bool.  pad: [] int64.  eos: [num_eos] int64 (-1 = unused).
        input_ids: [batch, 1] int64.  position_ids: [batch, 1] int64.  cache_lens: [batch] int32.
        cur: [1] int64 — the column written (< capacity).  steps_run: [] int64.
        scratch: ``(partials, counters)`` from :func:`scratch_for` for ``batch`` rows.

    Raises:
        ValueError: mismatched shapes or dtypes, or a CPU tensor outside Triton's interpreter.
    """
    batch, vocab, chunks = _launch_shape(logits, "greedy_tail")
    dev = logits.device
    want = {"tokens": (tokens, torch.int64, 2), "unfinished": (unfinished, torch.bool, 1), "pad": (pad, torch.int64, 0),
            "eos": (eos, torch.int64, 1), "input_ids": (input_ids, torch.int64, 2),
            "position_ids": (position_ids, torch.int64, 2), "cache_lens": (cache_lens, torch.int32, 1),
            "cur": (cur, torch.int64, 1), "steps_run": (steps_run, torch.int64, 0)}
    for name, (t, dtype, dim) in want.items():
        if t.dtype != dtype or t.dim() != dim or t.device != dev:
            raise ValueError(f"greedy_tail: {name} must be a {dim}-d {dtype} tensor on {dev}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    for name in ("tokens", "unfinished", "input_ids", "position_ids", "cache_lens"):
        if want[name][0].shape[0] != batch:
            raise ValueError(f"greedy_tail: {name} has {want[name][0].shape[0]} rows, logits {batch}")
    if input_ids.shape[1] != 1 or position_ids.shape[1] != 1:
        raise ValueError(f"greedy_tail: one-token steps only: input_ids {tuple(input_ids.shape)}, position_ids "
                         f"{tuple(position_ids.shape)} must be [batch, 1]")
    if tokens.stride(1) != 1 or not unfinished.is_contiguous() or not cache_lens.is_contiguous():
        raise ValueError("greedy_tail: tokens needs contiguous rows; unfinished and cache_lens must be contiguous")
    check_dense("greedy_tail", eos=eos)
    partials, counters = scratch
    _check_scratch(partials, counters, batch, chunks, dev, "greedy_tail")
    _greedy_tail_kernel[(batch, chunks)](
        logits, partials, counters, tokens, unfinished.view(torch.uint8), pad, eos, input_ids, position_ids,
        cache_lens, cur, steps_run, logits.stride(0), vocab, chunks, batch, tokens.stride(0), input_ids.stride(0),
        position_ids.stride(0), eos.numel(), BLOCK=BLOCK, BLOCK_C=triton.next_power_of_2(chunks),
        BLOCK_E=max(2, triton.next_power_of_2(eos.numel())), num_warps=_NUM_WARPS)


def greedy_tail_ref(logits, tokens, unfinished, pad, eos, input_ids, position_ids, cache_lens, cur, steps_run) -> None:
    """PyTorch version of :func:`greedy_tail` (same arguments but ``scratch``; ~10 launches)."""
    nxt = logits.argmax(dim=-1)
    steps_run += unfinished.any()
    nxt = torch.where(unfinished, nxt, pad)
    tokens.scatter_(1, cur.expand(tokens.shape[0], 1), nxt[:, None])
    unfinished &= ~torch.isin(nxt, eos)
    input_ids[:, 0].copy_(nxt)
    position_ids += 1
    cache_lens += 1
    cur += 1
