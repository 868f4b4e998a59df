"""argmax_rows and greedy_tail (one-launch argmax and the greedy step's bookkeeping) against PyTorch."""

from __future__ import annotations

import pytest
import torch

from hf_accel.kernels.argmax import BLOCK, argmax_rows, greedy_tail, greedy_tail_ref, scratch_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU


def _logits(seed, rows, vocab, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    for r in range(rows):  # a tie between two columns in different chunks on some rows: the first must win
        if r % 2 == 0 and vocab > BLOCK:
            a, b = sorted(torch.randperm(vocab, generator=g)[:2].tolist())
            x[r, a] = x[r, b] = 30.0
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 97), (3, BLOCK), (4, 2 * BLOCK + 5), (2, 5 * BLOCK - 1)])
def test_argmax_rows_matches_torch(rows, vocab, dtype):
    x = _logits(rows * 1000 + vocab, rows, vocab, dtype)
    scratch = scratch_for(rows, vocab, x.device)
    for _ in range(2):  # the counters are left at zero for the next launch
        got = argmax_rows(x, scratch=scratch)
        assert got.tolist() == x.argmax(dim=-1).tolist()
    assert not scratch[1].any()


def test_argmax_rows_special_values():
    v = 3 * BLOCK
    x = torch.randn(6, v)
    x[0] = float("-inf")  # all -inf: the first column
    x[1, 5], x[1, 2 * BLOCK + 3] = float("nan"), float("inf")  # NaN wins over +inf
    x[2] = -torch.rand(v) - 1.0  # all negative
    x[2, BLOCK + 7] = -0.5
    x[3] = -1.0
    x[3, 9], x[3, 4] = 0.0, -0.0  # -0.0 == +0.0: the first of the two
    x[4, 100], x[4, 2 * BLOCK + 1] = float("inf"), float("inf")
    x[5, v - 1] = 1e30
    x = x.to(DEV)
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [0, 5, BLOCK + 7, 4, 100, v - 1]


def test_argmax_rows_strided_rows():
    base = _logits(7, 3, 2 * (BLOCK + 11))
    x = base[:, : BLOCK + 11]  # row stride != vocab
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="must be \\[rows, vocab\\]"):
        argmax_rows(torch.randn(2, 3, 4, device=DEV))
    with pytest.raises(ValueError, match="must be \\[rows, vocab\\]"):
        argmax_rows(torch.randn(8, 4, device=DEV).t())
    with pytest.raises(ValueError, match="must be \\[rows, vocab\\]"):
        argmax_rows(torch.randint(0, 5, (2, 9), device=DEV))
    with pytest.raises(ValueError, match="partials"):
        argmax_rows(torch.randn(4, 9, device=DEV), scratch=scratch_for(1, 9, DEV))


def _greedy_state(seed, batch, vocab, cap=12):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, cap), generator=g).to(DEV)
    unfinished = (torch.rand(batch, generator=g) < 0.7).to(DEV)
    pad = torch.tensor(vocab + 3, device=DEV)
    logits = _logits(seed, batch, vocab)
    # the argmax of some rows is an EOS id
    eos_ids = logits.argmax(dim=-1)[: max(1, batch // 2)].unique()
    eos = torch.full((8,), -1, dtype=torch.long, device=DEV)
    eos[: eos_ids.numel()] = eos_ids[:8]
    return {"logits": logits, "tokens": tokens, "unfinished": unfinished, "pad": pad, "eos": eos,
            "input_ids": torch.randint(0, vocab, (batch, 1), generator=g).to(DEV),
            "position_ids": torch.randint(0, 50, (batch, 1), generator=g).to(DEV),
            "cache_lens": torch.randint(0, 50, (batch,), generator=g).to(torch.int32).to(DEV),
            "cur": torch.tensor([int(torch.randint(0, cap, (1,), generator=g))], device=DEV),
            "steps_run": torch.tensor(int(torch.randint(0, 9, (1,), generator=g)), device=DEV)}


@pytest.mark.parametrize("batch,vocab", [(1, 97), (3, 2 * BLOCK + 1), (5, BLOCK)])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_tail_matches_reference(seed, batch, vocab):
    ours, ref = _greedy_state(seed, batch, vocab), _greedy_state(seed, batch, vocab)
    scratch = scratch_for(batch, vocab, DEV)
    for step in range(3):  # repeated steps: cur advances, finished rows emit pad, counters reset
        greedy_tail(**ours, scratch=scratch)
        greedy_tail_ref(**ref)
        for name in ref:
            assert torch.equal(ours[name], ref[name]), (step, name)
        assert not scratch[1].any()
        ours["logits"].copy_(_logits(seed + 10 * step + 1, batch, vocab))
        ref["logits"].copy_(ours["logits"])


def test_greedy_tail_counts_no_step_when_all_finished():
    st = _greedy_state(0, 3, 50)
    st["unfinished"].zero_()
    before = st["tokens"].clone()
    greedy_tail(**st, scratch=scratch_for(3, 50, DEV))
    assert int(st["steps_run"]) == int(_greedy_state(0, 3, 50)["steps_run"])
    col = int(_greedy_state(0, 3, 50)["cur"])
    assert (st["tokens"][:, col] == st["pad"]).all()
    assert torch.equal(st["tokens"][:, :col], before[:, :col])


def test_greedy_tail_rejects_mismatched_state():
    st = _greedy_state(1, 2, 40)
    st["cache_lens"] = st["cache_lens"].long()
    with pytest.raises(ValueError, match="cache_lens must be a 1-d torch.int32"):
        greedy_tail(**st, scratch=scratch_for(2, 40, DEV))
    st = _greedy_state(1, 2, 40)
    st["tokens"] = st["tokens"][:1]
    with pytest.raises(ValueError, match="tokens has 1 rows"):
        greedy_tail(**st, scratch=scratch_for(2, 40, DEV))
    st = _greedy_state(1, 2, 40)
    st["position_ids"] = st["position_ids"].repeat(1, 3)
    with pytest.raises(ValueError, match="one-token steps only"):
        greedy_tail(**st, scratch=scratch_for(2, 40, DEV))
