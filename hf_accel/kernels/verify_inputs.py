"""The inputs of a speculative verify pass in one launch: each row's last committed token followed by its
drafts, their rotary positions, and the cache length before them.

Per row ``r`` with ``length = lengths[r]`` committed tokens (left padding included) and ``starts[r]``
padding tokens: ``ids[r] = [tokens[r, length - 1], drafts[r, 0..k-1]]``, ``positions[r, j] = length - 1 -
starts[r] + j`` and ``cache_lens[r] = length - 1`` (int32). :func:`verify_inputs_ref` is the PyTorch
version (~9 launches: a subtraction, a cast, a gather, a concatenation, ...), which a verify round inside
its CUDA graph paid for every round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_launch_device


@triton.jit
def _verify_inputs_kernel(Tokens, Lengths, Starts, Drafts, Ids, Positions, CacheLens, stride_tok, stride_dr, K,
                          BLOCK_J: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    last = tl.load(Lengths + r) - 1
    pos0 = last - tl.load(Starts + r)
    j = tl.arange(0, BLOCK_J)
    x0 = tl.load(Tokens + r * stride_tok + last)
    drafts = tl.load(Drafts + r * stride_dr + (j - 1), mask=(j >= 1) & (j <= K), other=0)
    ids = tl.where(j == 0, x0, drafts)
    tl.store(Ids + r * (K + 1) + j, ids, mask=j <= K)
    tl.store(Positions + r * (K + 1) + j, pos0 + j, mask=j <= K)
    tl.store(CacheLens + r, last.to(tl.int32))


def verify_inputs(tokens: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor):
    """Inputs of the verify pass over each row's last committed token and its ``k`` drafts.

    Args:
        tokens: [batch, capacity] int64, rows contiguous — prompt (left padded) + committed tokens.
        lengths: [batch] int64 — committed tokens per row, padding included (>= 1).
        starts: [batch] int64 — left-padding tokens per row.
        drafts: [batch, k] int64, k >= 0 (rows contiguous; a column slice of a wider buffer is fine).

    Returns:
        (ids [batch, k + 1] int64, positions [batch, k + 1] int64, cache_lens [batch] int32).

    Raises:
        ValueError: other shapes, dtypes or devices, or a CPU tensor outside Triton's interpreter.
    """
    b = tokens.shape[0] if tokens.dim() == 2 else -1
    ok = (tokens.dim() == 2 and drafts.dim() == 2 and drafts.shape[0] == b and lengths.shape == (b,)
          and starts.shape == (b,) and all(t.dtype == torch.int64 for t in (tokens, lengths, starts, drafts))
          and len({t.device for t in (tokens, lengths, starts, drafts)}) == 1 and tokens.stride(1) == 1
          and (drafts.shape[1] == 0 or drafts.stride(1) == 1) and lengths.is_contiguous() and starts.is_contiguous())
    if not ok:
        raise ValueError("verify_inputs: need int64 tokens [batch, capacity], lengths [batch], starts [batch] and "
                         f"drafts [batch, k] on one device with contiguous rows; got {tuple(tokens.shape)}, "
                         f"{tuple(lengths.shape)}, {tuple(starts.shape)}, {tuple(drafts.shape)} "
                         f"({tokens.dtype}, {lengths.dtype}, {starts.dtype}, {drafts.dtype})")
    check_launch_device(tokens, "verify_inputs")
    k = drafts.shape[1]
    ids = torch.empty(b, k + 1, dtype=torch.int64, device=tokens.device)
    positions = torch.empty_like(ids)
    cache_lens = torch.empty(b, dtype=torch.int32, device=tokens.device)
    if b:
        _verify_inputs_kernel[(b,)](tokens, lengths, starts, drafts, ids, positions, cache_lens, tokens.stride(0),
                                    drafts.stride(0) if k else 0, k,
                                    BLOCK_J=max(2, triton.next_power_of_2(k + 1)), num_warps=1)
    return ids, positions, cache_lens


def verify_inputs_ref(tokens, lengths, starts, drafts):
    """PyTorch version of :func:`verify_inputs` (same arguments and results)."""
    last = lengths - 1
    x0 = tokens.gather(1, last[:, None])
    ids = torch.cat([x0, drafts], dim=1)
    positions = (last - starts)[:, None] + torch.arange(drafts.shape[1] + 1, device=tokens.device)
    return ids, positions, last.to(torch.int32)
