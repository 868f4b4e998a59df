"""A prompt's inputs for the bucketed prefill graph and the first decode step, in one launch.

Before the prefill of a call on the fast path, the prompt ``input_ids`` [batch, prompt_len] (left padded, with its
``attention_mask``) is staged into static buffers of the bucketed length ``L`` >= prompt_len that the captured
prefill graph reads, and the decode step's buffers are reset. Per row ``r`` of the bucket's ``rows`` >= batch,
with ``m`` the row's mask and ``c[j]`` the number of ones in ``m[0..j]``:

* ``ids[r, j]`` = ``input_ids[r, j]`` for j < prompt_len, 0 after (and in rows >= batch);
* ``positions[r, j]`` = ``c[j] - 1`` where ``m[j]`` is 1 and 1 where it is 0 (transformers' positions of a
  left-padded row), then ``p + 1, p + 2, ...`` for the padding columns j >= prompt_len after the last prompt
  position ``p``; 0 in rows >= batch;
* ``key_mask[r, :]`` (uint8, the step's capacity) = ``m`` over the prompt, 1 after it; 0 in rows >= batch;
* ``cache_lens[r]`` (int32) = prompt_len, ``step_positions[r, 0]`` = ``c[prompt_len - 1]`` (the first new token's
  position), ``step_ids[r, :]`` = 0; 0 in rows >= batch; ``index[0]`` = prompt_len - 1 (the position whose logits
  the prefill returns).

:func:`prefill_inputs_ref` is the PyTorch version: ~20 launches (a cumsum, fills, slice copies, a cast ...),
each paid in host time while the GPU waits for the prefill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_accel.kernels.device import check_launch_device


@triton.jit
def _prefill_inputs_kernel(InputIds, Mask, Ids, Positions, KeyMask, CacheLens, StepPositions, StepIds, Index,
                           batch, prompt_len, length, capacity, q_len, stride_in, stride_mask,
                           BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr):
    r = tl.program_id(0)
    live = r < batch
    n = tl.where(live, prompt_len, 0)  # prompt columns this row reads (none in rows >= batch)
    r64 = r.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # ones of the row's mask over the prompt, and whether its last column is 1 (then p = ones - 1, else p = 1)
    ones = tl.zeros((BLOCK,), dtype=tl.int64)
    for c0 in range(0, prompt_len, BLOCK):
        j = c0 + cols
        m = tl.load(Mask + r64 * stride_mask + j, mask=j < n, other=0)
        ones += (m != 0).to(tl.int64)
    ones_sum = tl.sum(ones, axis=0)
    last_m = tl.load(Mask + r64 * stride_mask + (n - 1) + cols, mask=cols < tl.minimum(n, 1), other=0)
    last_pos = tl.where(tl.max(last_m, axis=0) != 0, ones_sum - 1, 1)
    run = ones_sum * 0
    for c0 in range(0, length, BLOCK):
        j = c0 + cols
        m = (tl.load(Mask + r64 * stride_mask + j, mask=j < n, other=0) != 0).to(tl.int64)
        c = tl.cumsum(m, axis=0) + run
        run += tl.sum(m, axis=0)
        pos = tl.where(j < prompt_len, tl.where(m != 0, c - 1, 1), last_pos + (j - prompt_len + 1))
        ids = tl.load(InputIds + r64 * stride_in + j, mask=j < n, other=0)
        tl.store(Ids + r64 * length + j, ids, mask=j < length)
        tl.store(Positions + r64 * length + j, tl.where(live, pos, 0), mask=j < length)
    for c0 in range(0, capacity, BLOCK):
        j = c0 + cols
        m = tl.load(Mask + r64 * stride_mask + j, mask=j < n, other=0) != 0
        key = tl.where(j < prompt_len, m, live)
        tl.store(KeyMask + r64 * capacity + j, key.to(tl.uint8), mask=j < capacity)
    tl.store(CacheLens + r, tl.where(live, prompt_len, 0).to(tl.int32))
    q = tl.arange(0, BLOCK_Q)
    first = tl.where(live, ones_sum, 0)
    tl.store(StepPositions + r64 * q_len + q, tl.where(q == 0, first, 0), mask=q < q_len)
    tl.store(StepIds + r64 * q_len + q, tl.zeros((BLOCK_Q,), dtype=tl.int64), mask=q < q_len)
    if r == 0:
        tl.store(Index, (prompt_len - 1).to(tl.int64))


def _check(input_ids, attention_mask, ids, positions, key_mask, cache_lens, step_positions, step_ids, index):
    batch, prompt_len = input_ids.shape if input_ids.dim() == 2 else (-1, -1)
    rows, length = ids.shape if ids.dim() == 2 else (-1, -1)
    tensors = (input_ids, attention_mask, ids, positions, key_mask, cache_lens, step_positions, step_ids, index)
    ok = (input_ids.dim() == 2 and attention_mask.shape == input_ids.shape and 0 < batch <= rows
          and 0 < prompt_len <= length and positions.shape == ids.shape and key_mask.dim() == 2
          and key_mask.shape[0] == rows and key_mask.shape[1] >= prompt_len and cache_lens.shape == (rows,)
          and step_positions.dim() == 2 and step_positions.shape[0] == rows and step_ids.shape == step_positions.shape
          and index.numel() == 1
          and input_ids.dtype == torch.int64 and ids.dtype == torch.int64 and positions.dtype == torch.int64
          and key_mask.dtype == torch.uint8 and cache_lens.dtype == torch.int32
          and step_positions.dtype == torch.int64 and step_ids.dtype == torch.int64 and index.dtype == torch.int64
          and not attention_mask.dtype.is_floating_point and not attention_mask.dtype.is_complex
          and input_ids.stride(1) == 1 and attention_mask.stride(1) == 1
          and all(t.is_contiguous() for t in tensors[2:]) and len({t.device for t in tensors}) == 1)
    if not ok:
        raise ValueError(
            "prefill_inputs: need int64 input_ids [batch, prompt_len] and an integer or bool attention_mask of the "
            "same shape (unit column stride), and contiguous buffers on their device: ids / positions [rows, L] "
            "int64 (rows >= batch, L >= prompt_len), key_mask [rows, capacity >= prompt_len] uint8, cache_lens "
            "[rows] int32, step_positions / step_ids [rows, q_len] int64, index [1] int64; got "
            + ", ".join(f"{tuple(t.shape)} {t.dtype} {t.device}" for t in tensors))


def prefill_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                   key_mask: torch.Tensor, cache_lens: torch.Tensor, step_positions: torch.Tensor,
                   step_ids: torch.Tensor, index: torch.Tensor) -> None:
    """Write a prompt's prefill inputs and reset the first decode step's buffers, in place (module docstring).

    Args:
        input_ids: [batch, prompt_len] int64, left padded (unit column stride).
        attention_mask: [batch, prompt_len] bool or integer (0 = padding), unit column stride.
        ids, positions: [rows, L] int64 (rows >= batch, L >= prompt_len): the prefill graph's inputs.
        key_mask: [rows, capacity] uint8 (capacity >= prompt_len): the decode step's key mask.
        cache_lens: [rows] int32; step_positions, step_ids: [rows, q_len] int64: the decode step's buffers.
        index: [1] int64: the prompt's last position.

    Raises:
        ValueError: other shapes, dtypes, strides or devices, or CPU tensors outside Triton's interpreter.
    """
    _check(input_ids, attention_mask, ids, positions, key_mask, cache_lens, step_positions, step_ids, index)
    check_launch_device(input_ids, "prefill_inputs")
    batch, prompt_len = input_ids.shape
    rows, length = ids.shape
    mask = attention_mask.view(torch.uint8) if attention_mask.dtype == torch.bool else attention_mask
    q_len = step_positions.shape[1]
    _prefill_inputs_kernel[(rows,)](input_ids, mask, ids, positions, key_mask, cache_lens, step_positions, step_ids,
                                    index, batch, prompt_len, length, key_mask.shape[1], q_len, input_ids.stride(0),
                                    mask.stride(0), BLOCK=1024, BLOCK_Q=max(2, triton.next_power_of_2(q_len)),
                                    num_warps=4)


def prefill_inputs_ref(input_ids, attention_mask, ids, positions, key_mask, cache_lens, step_positions, step_ids,
                       index) -> None:
    """PyTorch version of :func:`prefill_inputs` (same arguments and effects)."""
    batch, prompt_len = input_ids.shape
    pos = attention_mask.long().cumsum(-1) - 1
    pos.masked_fill_(attention_mask == 0, 1)
    ids.zero_()
    ids[:batch, :prompt_len] = input_ids
    positions.zero_()
    positions[:batch, :prompt_len] = pos
    tail = torch.arange(1, ids.shape[1] - prompt_len + 1, device=ids.device)
    positions[:batch, prompt_len:] = pos[:, -1:] + tail
    key_mask.zero_()
    key_mask[:batch, :prompt_len] = attention_mask.to(torch.uint8)
    key_mask[:batch, prompt_len:] = 1
    cache_lens.zero_()
    cache_lens[:batch] = prompt_len
    step_positions.zero_()
    step_positions[:batch, 0] = attention_mask.long().sum(-1)
    step_ids.zero_()
    index.fill_(prompt_len - 1)
