"""prefill_inputs (a prompt's bucketed-prefill inputs and the first decode step's buffers in one launch) against its
PyTorch reference, which is what the engine ran before."""

from __future__ import annotations

import pytest
import torch

from hf_accel.kernels.prefill_inputs import prefill_inputs, prefill_inputs_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU
NAMES = ("ids", "positions", "key_mask", "cache_lens", "step_positions", "step_ids", "index")


def _buffers(g, rows, length, capacity, q_len):
    """Buffers holding junk (a previous call's values): everything the kernel does not overwrite would show."""
    return [torch.randint(-9, 99, (rows, length), generator=g), torch.randint(-9, 99, (rows, length), generator=g),
            torch.randint(0, 2, (rows, capacity), generator=g, dtype=torch.uint8),
            torch.randint(0, 99, (rows,), generator=g, dtype=torch.int32),
            torch.randint(-9, 99, (rows, q_len), generator=g), torch.randint(-9, 99, (rows, q_len), generator=g),
            torch.randint(0, 99, (1,), generator=g)]


@pytest.mark.parametrize("mask_dtype", [torch.long, torch.int32, torch.bool])
@pytest.mark.parametrize("batch, rows, prompt_len, length, capacity, q_len", [
    (1, 1, 7, 16, 32, 1),  # one row, padding columns after the prompt
    (3, 4, 20, 32, 48, 1),  # rows past the batch (the batch bucket)
    (2, 2, 1500, 2048, 2100, 1),  # several column blocks
    (1, 2, 5, 5, 5, 2),  # the prompt fills the bucket and the capacity; a step of two tokens
])
@pytest.mark.parametrize("seed", range(2))
def test_matches_reference(seed, batch, rows, prompt_len, length, capacity, q_len, mask_dtype):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (batch, prompt_len), generator=g)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    for b in range(batch):  # left padding of random widths, and a hole in the first row
        mask[b, : int(torch.randint(0, max(1, prompt_len // 2), (), generator=g))] = 0
    if prompt_len > 3:
        mask[0, prompt_len // 3] = 0
    mask = mask.to(mask_dtype)
    got = [t.to(DEV) for t in _buffers(g, rows, length, capacity, q_len)]
    want = [t.clone() for t in got]
    prefill_inputs(ids.to(DEV), mask.to(DEV), *got)
    prefill_inputs_ref(ids.to(DEV), mask.to(DEV), *want)
    for a, b, name in zip(got, want, NAMES):
        assert torch.equal(a, b), name
    # the values themselves, independently of the reference: a row's first new position is its number of tokens
    assert got[4][:batch, 0].tolist() == mask.long().sum(-1).tolist()
    assert got[3].tolist() == [prompt_len] * batch + [0] * (rows - batch)
    assert int(got[6]) == prompt_len - 1


def test_last_column_padding_position():
    """A row whose last prompt column is padding (refused by the engine, but the kernel still follows the
    reference): its positions there are 1 and the columns after the prompt continue from 1."""
    ids = torch.arange(6).view(1, 6).to(DEV)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0]], device=DEV)
    got = [t.to(DEV) for t in _buffers(torch.Generator().manual_seed(0), 1, 8, 8, 1)]
    want = [t.clone() for t in got]
    prefill_inputs(ids, mask, *got)
    prefill_inputs_ref(ids, mask, *want)
    assert got[1][0].tolist() == [1, 0, 1, 2, 3, 1, 2, 3]
    for a, b, name in zip(got, want, NAMES):
        assert torch.equal(a, b), name


def test_rejects_bad_input():
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(2, 4, dtype=torch.long, device=DEV)
    mask = torch.ones(2, 4, dtype=torch.long, device=DEV)
    bufs = [t.to(DEV) for t in _buffers(g, 2, 8, 8, 1)]
    with pytest.raises(ValueError, match="prefill_inputs"):  # more rows than the buffers
        prefill_inputs(torch.zeros(3, 4, dtype=torch.long, device=DEV), torch.ones(3, 4, device=DEV).long(), *bufs)
    with pytest.raises(ValueError, match="prefill_inputs"):  # a prompt longer than the bucket
        prefill_inputs(torch.zeros(2, 9, dtype=torch.long, device=DEV), torch.ones(2, 9, device=DEV).long(), *bufs)
    with pytest.raises(ValueError, match="prefill_inputs"):  # int32 ids
        prefill_inputs(ids.int(), mask, *bufs)
    with pytest.raises(ValueError, match="prefill_inputs"):  # a float mask
        prefill_inputs(ids, mask.float(), *bufs)
    bad = list(bufs)
    bad[3] = bad[3].long()  # cache_lens not int32
    with pytest.raises(ValueError, match="prefill_inputs"):
        prefill_inputs(ids, mask, *bad)
