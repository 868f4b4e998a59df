"""Commit the tokens of a speculative verify step and update the per-row decoding state, in one launch.

Per row: ``n`` accepted drafts (given, or for greedy verification the length of the prefix where the
draft equals the target's argmax ``out``), then ``count = n + 1`` tokens of ``out`` are committed, cut
after the first EOS id and at the row's remaining budget; finished rows commit nothing. The kernel writes
the tokens, advances ``lengths`` / ``remaining``, clears ``active`` of rows that ended, and writes the
step's counters. :func:`commit_tokens_ref` is the PyTorch reference (~40 launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_dense, check_launch_device

#: Layout of the ``info`` counters (int64): ``[0]`` any row still active, ``[1]`` accepted drafts, ``[2]``
#: drafts examined, ``[3]`` drafts proposed, ``[4]`` largest remaining budget, then ``[INFO_HIST + v]`` rows
#: that accepted exactly v drafts (v = 0..k). With match classes (``classes``, prompt lookup's matched
#: n-gram length per row, clamped to ``NUM_CLASSES - 1``): ``[INFO_CLASS_COUNTS + c]`` (written by the
#: caller: active rows of class c for the next round) and ``[INFO_CLASS_HIST + c * (MAX_DRAFT + 1) + v]``
#: rows of class c that accepted exactly v drafts.
MAX_DRAFT = 32
NUM_CLASSES = 8
INFO_HIST = 5
INFO_CLASS_COUNTS = INFO_HIST + MAX_DRAFT + 1
INFO_CLASS_HIST = INFO_CLASS_COUNTS + NUM_CLASSES
INFO_SIZE = INFO_CLASS_HIST + NUM_CLASSES * (MAX_DRAFT + 1)
#: ``totals`` (int64, accumulated over a call): drafts proposed, drafts accepted, row-steps of verify rounds,
#: tokens they committed, then ``[4 + k]`` rounds with k drafts in which a row was still active.
TOTALS_SIZE = 4 + MAX_DRAFT + 1


@triton.jit
def _commit_kernel(Out, NumAccepted, Drafts, Valid, Tokens, Lengths, Remaining, Active, Eos, Info, Totals, Classes,
                   batch, stride_tok, num_eos, K, GREEDY: tl.constexpr, COUNT_STEP: tl.constexpr,
                   BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, NUM_CLASSES: tl.constexpr,
                   CLASS_HIST: tl.constexpr, CLASS_STRIDE: tl.constexpr, COUNT_TOKENS: tl.constexpr,
                   COUNT_ROUNDS: tl.constexpr):
    rows = tl.arange(0, BLOCK_B)
    j = tl.arange(0, BLOCK_J)
    r2 = rows[:, None]
    j2 = j[None, :]
    in_b = r2 < batch
    out = tl.load(Out + r2 * (K + 1) + j2, mask=in_b & (j2 < K + 1), other=-1)
    valid = tl.load(Valid + r2 * K + j2, mask=in_b & (j2 < K), other=0) != 0
    if GREEDY:
        drafts = tl.load(Drafts + r2 * K + j2, mask=in_b & (j2 < K), other=-2)
        ok = (drafts == out) & valid
        n = tl.min(tl.where(ok, BLOCK_J, j2), axis=1)  # the first position that is not accepted
    else:
        n = tl.load(NumAccepted + rows, mask=rows < batch, other=0).to(tl.int32)
    proposed = tl.sum(valid.to(tl.int32), axis=1)
    count = n + 1
    e = tl.arange(0, BLOCK_E)
    eos = tl.load(Eos + e, mask=e < num_eos, other=-1)
    is_eos = tl.sum(((out[:, :, None] == eos[None, None, :]) & (eos[None, None, :] >= 0)).to(tl.int32), axis=2) > 0
    eos_hit = is_eos & (j2 < count[:, None])
    first_eos = tl.min(tl.where(eos_hit, j2, BLOCK_J), axis=1)
    count = tl.minimum(count, first_eos + 1)
    remaining = tl.load(Remaining + rows, mask=rows < batch, other=0).to(tl.int32)
    was_active = tl.load(Active + rows, mask=rows < batch, other=0) != 0
    limit = tl.minimum(first_eos + 1, remaining)  # tokens this row can commit at most, whatever it accepts
    count = tl.minimum(count, remaining)
    count = tl.where(was_active, count, 0)
    finished = first_eos < count
    lengths = tl.load(Lengths + rows, mask=rows < batch, other=0)
    keep = (j2 < count[:, None]) & in_b
    tl.store(Tokens + r2.to(tl.int64) * stride_tok + lengths[:, None] + j2, out, mask=keep)
    remaining = remaining - count
    active = was_active & (finished == 0) & (remaining > 0)
    tl.store(Lengths + rows, lengths + count, mask=rows < batch)
    tl.store(Remaining + rows, remaining.to(tl.int64), mask=rows < batch)
    tl.store(Active + rows, active.to(tl.uint8), mask=rows < batch)
    w = was_active.to(tl.int64)
    examined = tl.where(n < K, n + 1, n)
    tl.store(Info + 0, tl.max(active.to(tl.int64), axis=0))
    tl.store(Info + 1, tl.sum(n.to(tl.int64) * w, axis=0))
    tl.store(Info + 2, tl.sum(examined.to(tl.int64) * w, axis=0))
    tl.store(Info + 3, tl.sum(proposed.to(tl.int64) * w, axis=0))
    tl.store(Info + 4, tl.max(tl.where(active, remaining, 0).to(tl.int64), axis=0))
    hist = tl.sum(((n[:, None] == j2) & was_active[:, None] & in_b).to(tl.int64), axis=0)
    tl.store(Info + 5 + j, hist, mask=j < K + 1)
    if NUM_CLASSES > 0:
        cls = tl.load(Classes + rows, mask=rows < batch, other=-1)
        for c in tl.static_range(NUM_CLASSES):
            hist_c = tl.sum(((n[:, None] == j2) & was_active[:, None] & in_b & (cls[:, None] == c)).to(tl.int64),
                            axis=0)
            tl.store(Info + CLASS_HIST + c * CLASS_STRIDE + j, hist_c, mask=j < K + 1)
    # drafts that could be committed (before the budget's end and an EOS), and those accepted of them
    tl.store(Totals + 0, tl.load(Totals + 0) + tl.sum(tl.minimum(proposed, limit).to(tl.int64) * w, axis=0))
    tl.store(Totals + 1, tl.load(Totals + 1) + tl.sum(tl.minimum(n, limit).to(tl.int64) * w, axis=0))
    if COUNT_STEP:
        tl.store(Totals + 2, tl.load(Totals + 2) + tl.sum(w, axis=0))
        if COUNT_TOKENS:
            tl.store(Totals + 3, tl.load(Totals + 3) + tl.sum(count.to(tl.int64) * w, axis=0))
    if COUNT_ROUNDS:  # rounds with k drafts in which a row was still active
        tl.store(Totals + 4 + K, tl.load(Totals + 4 + K) + tl.max(w, axis=0))


def _check(out, drafts, valid, tokens, lengths, remaining, active, eos, info, totals, classes=None):
    b, k1 = out.shape
    k = k1 - 1
    if drafts.shape != (b, k) or valid.shape != (b, k) or valid.dtype != torch.bool:
        raise ValueError(f"drafts {tuple(drafts.shape)} / valid {tuple(valid.shape)} {valid.dtype} must be [{b}, {k}] "
                         "(valid bool)")
    if tokens.dim() != 2 or tokens.shape[0] != b or tokens.stride(1) != 1 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be [{b}, capacity] int64 with contiguous rows")
    for name, t, dt in (("lengths", lengths, torch.long), ("remaining", remaining, torch.long),
                        ("active", active, torch.bool)):
        if t.shape != (b,) or t.dtype != dt:
            raise ValueError(f"{name} must be [{b}] {dt}, got {tuple(t.shape)} {t.dtype}")
    if info.numel() < 6 + k or totals.numel() < 3 or eos.dim() != 1:
        raise ValueError(f"info needs {6 + k} entries, totals 3, eos must be 1-D")
    if k > MAX_DRAFT:
        raise ValueError(f"at most {MAX_DRAFT} drafts per row, got {k}")
    if classes is not None:
        if classes.shape != (b,) or classes.dtype != torch.long:
            raise ValueError(f"classes must be [{b}] int64, got {tuple(classes.shape)} {classes.dtype}")
        if info.numel() < INFO_SIZE:
            raise ValueError(f"info needs {INFO_SIZE} entries with classes, got {info.numel()}")


def commit_tokens(out, num_accepted, drafts, valid, tokens, lengths, remaining, active, eos, info, totals,
                  count_step: bool, classes: torch.Tensor | None = None) -> None:
    """Commit one verify step's tokens in place (one launch; batch <= 256).

    Args:
        out: [batch, k + 1] int64 — the target's tokens at each position (argmax for greedy, the
            rejection sampler's output otherwise).
        num_accepted: [batch] int64 accepted drafts per row, or None for greedy verification (then the
            leading positions where ``drafts == out[:, :k]`` and ``valid``).
        drafts / valid: [batch, k] int64 / bool.
        tokens: [batch, capacity] int64 — committed tokens are written at ``lengths + j``.
        lengths / remaining: [batch] int64, updated; active: [batch] bool, updated.
        eos: [num_eos] int64 end-of-sequence ids (-1 entries ignored).
        info: [>= 6 + k] int64, written: any row still active, accepted drafts, drafts examined (accepted +
            the first rejected), drafts proposed (rows active at the step), largest remaining budget, then
            ``info[5 + v]`` = rows that accepted exactly ``v`` drafts (v = 0..k; rows active at the step).
        totals: [3], [4] or [TOTALS_SIZE] int64, accumulated: drafts proposed and drafts accepted, both
            counting only drafts before the row's budget ends and before an accepted EOS (those could be
            committed), row-steps and (with a 4th entry) tokens committed by them (these two only with
            ``count_step``), and (with :data:`TOTALS_SIZE` entries) ``[4 + k]`` rounds of k drafts in which
            a row was still active.
        classes: optional [batch] int64 match class per row, in [0, NUM_CLASSES) (others are not counted):
            also writes the per-class histograms of accepted drafts (``info`` then needs :data:`INFO_SIZE`
            entries; layout at :data:`INFO_CLASS_HIST`).

    Raises:
        ValueError: bad shapes or dtypes, more than :data:`MAX_DRAFT` drafts, or batch > 256.
    """
    _check(out, drafts, valid, tokens, lengths, remaining, active, eos, info, totals, classes)
    b, k1 = out.shape
    out, drafts, valid = out.contiguous(), drafts.contiguous(), valid.contiguous()  # the kernel indexes rows densely
    if b > 256:
        raise ValueError(f"commit_tokens handles at most 256 rows per launch, got {b}")
    check_dense("commit_tokens", num_accepted=num_accepted, lengths=lengths, remaining=remaining, active=active,
                eos=eos, info=info, totals=totals, classes=classes)
    check_launch_device(out, "commit_tokens")
    _commit_kernel[(1,)](out, num_accepted if num_accepted is not None else lengths, drafts, valid.view(torch.uint8),
                         tokens, lengths, remaining, active.view(torch.uint8), eos, info, totals,
                         classes if classes is not None else lengths, b, tokens.stride(0),
                         eos.numel(), k1 - 1, GREEDY=num_accepted is None, COUNT_STEP=bool(count_step),
                         BLOCK_B=max(2, triton.next_power_of_2(b)), BLOCK_J=max(2, triton.next_power_of_2(k1)),
                         BLOCK_E=max(2, triton.next_power_of_2(eos.numel())),
                         NUM_CLASSES=NUM_CLASSES if classes is not None else 0, CLASS_HIST=INFO_CLASS_HIST,
                         CLASS_STRIDE=MAX_DRAFT + 1, COUNT_TOKENS=totals.numel() >= 4,
                         COUNT_ROUNDS=totals.numel() >= TOTALS_SIZE)


def commit_tokens_ref(out, num_accepted, drafts, valid, tokens, lengths, remaining, active, eos, info, totals,
                      count_step: bool, classes: torch.Tensor | None = None) -> None:
    """PyTorch reference of :func:`commit_tokens` (same arguments and effects)."""
    _check(out, drafts, valid, tokens, lengths, remaining, active, eos, info, totals, classes)
    k = drafts.shape[1]
    if num_accepted is None:
        num_accepted = ((drafts == out[:, :k]) & valid).long().cumprod(dim=1).sum(dim=1)
    n = num_accepted
    j = torch.arange(k + 1, device=out.device)
    count = n + 1
    eos_hit = torch.isin(out, eos) & (j < count[:, None])  # token ids are never -1
    first_eos = torch.where(eos_hit.any(dim=1), eos_hit.long().argmax(dim=1), k + 1)
    limit = torch.minimum(first_eos + 1, remaining)
    count = torch.minimum(count, limit)
    was_active = active.clone()
    count = torch.where(was_active, count, 0)
    keep = j < count[:, None]
    finished = (eos_hit & keep).any(dim=1)
    idx = (lengths[:, None] + j).clamp(max=tokens.shape[1] - 1)
    tokens.scatter_(1, idx, torch.where(keep, out, tokens.gather(1, idx)))
    lengths += count
    remaining -= count
    active &= ~finished & (remaining > 0)
    examined = torch.where(n < k, n + 1, n)
    proposed = valid.sum(dim=1)
    w = was_active.long()
    info[0] = active.any()
    info[1] = (n * w).sum()
    info[2] = (examined * w).sum()
    info[3] = (proposed * w).sum()
    info[4] = (remaining * active).amax()
    info[5: 6 + k] = torch.zeros(k + 1, dtype=info.dtype, device=info.device).scatter_add_(0, n, w)
    if classes is not None:
        stride = MAX_DRAFT + 1
        in_range = (classes >= 0) & (classes < NUM_CLASSES)
        flat = torch.zeros(NUM_CLASSES * stride, dtype=info.dtype, device=info.device)
        flat.scatter_add_(0, classes.clamp(0, NUM_CLASSES - 1) * stride + n, w * in_range)
        info[INFO_CLASS_HIST: INFO_SIZE].view(NUM_CLASSES, stride)[:, : k + 1] = flat.view(NUM_CLASSES, stride)[:, : k + 1]
    totals[0] += (torch.minimum(proposed, limit) * w).sum()
    totals[1] += (torch.minimum(n, limit) * w).sum()
    if count_step:
        totals[2] += w.sum()
        if totals.numel() >= 4:
            totals[3] += (count * w).sum()
    if totals.numel() >= TOTALS_SIZE:
        totals[4 + k] += w.amax() if w.numel() else 0
