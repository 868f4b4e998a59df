"""N-gram lookup for prompt-lookup drafting (Saxena 2023, "Prompt Lookup Decoding") in one kernel launch.

Per row: find the first earlier occurrence of the row's last ``n`` tokens (``n = max_ngram .. min_ngram``,
longest first) among its committed tokens and draft the ``k`` tokens that followed it. One program per
row scans the row's committed tokens (not its whole capacity) in blocks; the PyTorch reference,
:func:`ngram_lookup_ref`, takes ~12 launches per n.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import capturing, check_dense, check_launch_device


@triton.jit
def _ngram_lookup_kernel(Tokens, Lengths, Starts, Drafts, Valid, Ngram, Counts, Active, capacity, stride_tb, K,
                         MAX_NGRAM: tl.constexpr, MIN_NGRAM: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_K: tl.constexpr, NUM_CLASSES: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = Tokens + b * stride_tb
    length = tl.load(Lengths + b).to(tl.int32)
    start = tl.load(Starts + b).to(tl.int32)
    found = length * 0 - 1
    matched = length * 0
    # only the committed tokens from the row's first real one are scanned, not the whole capacity (prompt +
    # max_new_tokens): a match starts at or after `start` and ends before `length`
    first_blk = (start // BLOCK) * BLOCK
    for i in tl.static_range(MAX_NGRAM - MIN_NGRAM + 1):  # n = MAX_NGRAM - i (constexpr, written inline)
        best = length * 0 + capacity
        for blk in range(first_blk, length, BLOCK):
            s = blk + tl.arange(0, BLOCK)
            # (scalar conditions broadcast as tensors: Triton's interpreter rejects a scalar-and-tensor mask)
            hit = (s >= start) & (s + (MAX_NGRAM - i) < length) & (s * 0 + length - (MAX_NGRAM - i) >= start)
            for j in tl.static_range(MAX_NGRAM - i):
                want = tl.load(row + tl.maximum(length - (MAX_NGRAM - i) + j, 0))
                got = tl.load(row + s + j, mask=hit, other=-1)
                hit = hit & (got == want)
            best = tl.minimum(best, tl.min(tl.where(hit, s, capacity), axis=0))
        new = (found < 0) & (best < capacity)
        matched = tl.where(new, MAX_NGRAM - i, matched)
        found = tl.where(new, best + (MAX_NGRAM - i), found)
    kk = tl.arange(0, BLOCK_K)
    idx = found + kk
    ok = (idx >= 0) & (kk < K) & (idx < length) & (kk * 0 + found >= 0)
    drafts = tl.load(row + idx, mask=ok, other=0)
    tl.store(Drafts + b * K + kk, drafts, mask=kk < K)
    tl.store(Valid + b * K + kk, ok.to(tl.uint8), mask=kk < K)
    if NUM_CLASSES > 0:  # one row (one program): its class, and the active rows per class
        matched = tl.minimum(matched, NUM_CLASSES - 1)
        cc = tl.arange(0, NUM_CLASSES)
        active = tl.load(Active + b).to(tl.int64)
        tl.store(Counts + cc, tl.where(cc == matched, active, 0))
    tl.store(Ngram + b, matched.to(tl.int64))


def ngram_lookup(tokens: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, k: int, max_ngram: int = 3,
                 min_ngram: int = 1, with_ngram: bool = False, out=None, class_counts: torch.Tensor | None = None,
                 active: torch.Tensor | None = None, check_lengths: bool = True):
    """Prompt-lookup drafts, one launch.

    Args:
        tokens: [batch, capacity] int64, contiguous rows — prompt (left padded) + committed output.
        lengths: [batch] int64 — committed tokens per row, padding included.
        starts: [batch] int64 — first real token per row (matches never start before it).
        k: tokens to draft (>= 1); max_ngram >= min_ngram >= 1.
        with_ngram: also return the length of the n-gram each row matched.
        out: optional (drafts [batch, k] int64, valid [batch, k] bool, ngram [batch] int64) contiguous
            tensors to write (and return) instead of new ones.
        class_counts: optional [num_classes] int64 contiguous tensor, batch 1 only (with ``active``, [1] bool):
            written in the same launch with the match-gated chooser's class counts: ``class_counts[c]`` = 1 if
            the row is active and its class (matched n, clamped to ``num_classes - 1``) is c, else 0; the
            returned ngram is clamped likewise. Replaces a zero fill, a cast and a scatter-add.
        check_lengths: check that ``0 <= starts <= lengths <= capacity`` (one device-to-host read, skipped while a
            CUDA graph is captured; the speculative engine passes False for its own rows): a length past the
            capacity would make the kernel read past the row.

    Returns:
        (drafts [batch, k] int64, valid [batch, k] bool, a prefix per row), as :func:`ngram_lookup_ref`;
        with ``with_ngram`` also ngram [batch] int64: the matched n (0 where nothing matched).

    Raises:
        ValueError: bad shapes, dtypes or n-gram bounds; (``check_lengths``) lengths or starts outside the rows.
    """
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.stride(1) != 1:
        raise ValueError(f"tokens must be [batch, capacity] int64 with contiguous rows, got {tuple(tokens.shape)} "
                         f"{tokens.dtype}")
    b, cap = tokens.shape
    if lengths.shape != (b,) or starts.shape != (b,):
        raise ValueError(f"lengths {tuple(lengths.shape)} and starts {tuple(starts.shape)} must be [{b}]")
    if lengths.dtype != torch.long or starts.dtype != torch.long:
        raise ValueError(f"lengths and starts must be int64, got {lengths.dtype} and {starts.dtype}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (k, max_ngram, min_ngram)):
        raise ValueError(f"k, max_ngram and min_ngram must be ints, got {k!r}, {max_ngram!r}, {min_ngram!r}")
    if k < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram, got {k}, {min_ngram}, {max_ngram}")
    if cap == 0:
        raise ValueError("tokens has no columns (capacity 0)")
    if check_lengths and b and not capturing(lengths):
        lo_len, hi_len = (int(x) for x in torch.aminmax(lengths))
        lo_start, hi_start = (int(x) for x in torch.aminmax(starts))
        if lo_len < 0 or hi_len > cap or lo_start < 0 or bool((starts > lengths).any()):
            raise ValueError(f"lengths must lie in [0, capacity={cap}] and starts in [0, length]; got lengths "
                             f"{lo_len}..{hi_len}, starts {lo_start}..{hi_start}")
    if out is not None:
        drafts, valid, ngram = out
        for name, t, shape, dt in (("drafts", drafts, (b, k), torch.long), ("valid", valid, (b, k), torch.bool),
                                   ("ngram", ngram, (b,), torch.long)):
            if t.shape != shape or t.dtype != dt or not t.is_contiguous() or t.device != tokens.device:
                raise ValueError(f"out {name} must be a contiguous {list(shape)} {dt} tensor on {tokens.device}, "
                                 f"got {tuple(t.shape)} {t.dtype}")
        valid = valid.view(torch.uint8)
    else:
        drafts = torch.empty(b, k, dtype=torch.long, device=tokens.device)
        valid = torch.empty(b, k, dtype=torch.uint8, device=tokens.device)
        ngram = torch.empty(b, dtype=torch.long, device=tokens.device)
    num_classes = 0
    if class_counts is not None:
        num_classes = class_counts.numel()
        if b != 1:
            raise ValueError(f"class_counts takes batch 1, got batch {b}")
        if (class_counts.dim() != 1 or class_counts.dtype != torch.long or not class_counts.is_contiguous()
                or num_classes < 2 or num_classes & (num_classes - 1) or class_counts.device != tokens.device):
            raise ValueError(f"class_counts must be a contiguous 1-d int64 tensor of a power-of-2 size >= 2 on "
                             f"{tokens.device}, got {tuple(class_counts.shape)} {class_counts.dtype}")
        if active is None or active.shape != (1,) or active.dtype != torch.bool or active.device != tokens.device:
            raise ValueError("class_counts needs active: a [1] bool tensor on the tokens' device")
    check_dense("ngram_lookup", lengths=lengths, starts=starts, class_counts=class_counts, active=active)
    check_launch_device(tokens, "ngram_lookup")
    _ngram_lookup_kernel[(b,)](tokens, lengths, starts, drafts, valid, ngram,
                               class_counts if num_classes else ngram,
                               active.view(torch.uint8) if num_classes else valid, cap, tokens.stride(0), k,
                               MAX_NGRAM=max_ngram, MIN_NGRAM=min_ngram,
                               BLOCK=min(1024, triton.next_power_of_2(cap)), BLOCK_K=triton.next_power_of_2(k),
                               NUM_CLASSES=num_classes)
    if out is not None:
        return out
    return (drafts, valid.view(torch.bool), ngram) if with_ngram else (drafts, valid.view(torch.bool))


def ngram_lookup_ref(tokens: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, k: int, max_ngram: int = 3,
                     min_ngram: int = 1, with_ngram: bool = False):
    """PyTorch reference of :func:`ngram_lookup` (same arguments and results)."""
    if tokens.device.type == "cpu" and tokens.shape[0]:
        # only the committed columns can match or be drafted: a capacity of prompt + max_new_tokens (possibly
        # millions) would otherwise be compared in full every round (on CUDA that would take a device read)
        tokens = tokens[:, :max(1, int(lengths.max()))]
    b, cap = tokens.shape
    dev = tokens.device
    found = torch.full((b,), -1, dtype=torch.long, device=dev)
    matched = torch.zeros(b, dtype=torch.long, device=dev)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= cap:
            continue
        suffix_pos = (lengths[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)
        suffix = tokens.gather(1, suffix_pos)  # [b, n]
        windows = tokens.unfold(1, n, 1)  # [b, cap - n + 1, n]
        s = torch.arange(windows.shape[1], device=dev)
        # an earlier occurrence, followed by at least one committed token, not in the padding
        ok = (windows == suffix[:, None, :]).all(dim=-1) & (s + n < lengths[:, None]) & (s >= starts[:, None])
        ok &= (lengths - n >= starts)[:, None]
        first = torch.where(ok, s, cap).amin(dim=1)
        new = (found < 0) & (first < cap)
        matched = torch.where(new, n, matched)
        found = torch.where(new, first + n, found)
    idx = found[:, None] + torch.arange(k, device=dev)
    valid = (found >= 0)[:, None] & (idx < lengths[:, None])
    drafts = torch.where(valid, tokens.gather(1, idx.clamp(0, cap - 1)), 0)
    return (drafts, valid, matched) if with_ngram else (drafts, valid)
