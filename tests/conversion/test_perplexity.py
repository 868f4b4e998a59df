"""hf_accel.evaluation: the fixed pydoc text and the windowed perplexity."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from hf_accel.evaluation import (calibration_text, evaluation_ids, perplexity, pydoc_topics_fingerprint,
                                 pydoc_topics_text)
from hf_accel.evaluation.perplexity import _windows

from gqa_tiny_models import build


@pytest.fixture(scope="module")
def model():
    return build("llama", num_heads=4, num_kv_heads=2, layers=2, dtype=torch.float64)


def test_one_window_equals_transformers_loss(model):
    ids = torch.randint(0, 97, (1, 50))
    res = perplexity(model, ids, context_length=50)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert res.tokens_scored == 49 and res.windows == 1
    assert res.perplexity == pytest.approx(math.exp(float(loss)), rel=1e-6)  # transformers computes its loss in float32


def test_disjoint_windows_average_the_window_losses(model):
    ids = torch.randint(0, 97, (130,))
    res = perplexity(model, ids, context_length=32, batch_size=3)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, 130, 32):
            w = ids[b : b + 32][None]
            if w.shape[1] < 2:
                continue
            total += float(model(input_ids=w, labels=w).loss) * (w.shape[1] - 1)
            count += w.shape[1] - 1
    assert res.tokens_scored == count
    assert res.nll_per_token == pytest.approx(total / count, rel=1e-6)  # transformers computes its loss in float32


def test_overlapping_windows_score_each_token_once_with_more_context(model):
    ids = torch.randint(0, 97, (100,))
    for stride in (1, 7, 16, 31):
        wins = _windows(100, 32, stride)
        scored = [t for _, e, f in wins for t in range(f, e)]
        assert scored == list(range(1, 100))  # every token but the first, once
        assert all(e - b <= 32 for b, e, _ in wins)
    # disjoint windows skip the first token of each window (it has no context)
    assert [t for _, e, f in _windows(100, 32, 32) for t in range(f, e)] == [
        t for t in range(1, 100) if t % 32 != 0]
    res = perplexity(model, ids, context_length=32, stride=8)
    assert res.tokens_scored == 99 and res.stride == 8
    # direct: token t (t >= 32) is predicted from the 31..32 tokens before it, inside its window
    total = 0.0
    with torch.no_grad():
        for b, e, f in _windows(100, 32, 8):
            lp = torch.log_softmax(model(input_ids=ids[None, b:e]).logits[0], -1)
            total -= sum(float(lp[t - b - 1, ids[t]]) for t in range(f, e))
    assert res.nll_per_token == pytest.approx(total / 99, rel=1e-9)
    assert res.perplexity < perplexity(model, ids, context_length=32).perplexity * 10  # sane, finite


def test_bad_inputs_raise(model):
    with pytest.raises(ValueError, match=r"\[n\] or \[1, n\]"):
        perplexity(model, torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(model, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, torch.zeros(10, dtype=torch.long), context_length=4, stride=5)
    with pytest.raises(ValueError, match="batch_size must be >= 1; got 0"):
        perplexity(model, torch.zeros(10, dtype=torch.long), context_length=4, batch_size=0)
    # ids of another type, and lengths that are not ints (were errors from inside torch / Python)
    with pytest.raises(ValueError, match="input_ids must be an int64 tensor of token ids; got torch.float32 tensor"):
        perplexity(model, torch.zeros(10), context_length=4)
    with pytest.raises(ValueError, match="got list"):
        perplexity(model, [1, 2, 3, 4], context_length=4)
    with pytest.raises(ValueError, match="context_length must be an int; got 4.5"):
        perplexity(model, torch.zeros(10, dtype=torch.long), context_length=4.5)
    # windows past the trained positions (the CLI refused them, the function scored them)
    positions = model.config.max_position_embeddings
    ids = torch.zeros(positions + 10, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"context_length={positions + 1} is more than the model's {positions} "):
        perplexity(model, ids, context_length=positions + 1)
    assert perplexity(model, ids, context_length=positions).windows == 2
    # ids outside the vocabulary (an IndexError from inside the embedding)
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {vocab}\) \(the model's vocabulary\); got 1 .. "
                       f"{vocab}"):
        perplexity(model, torch.tensor([1, 2, vocab]), context_length=4)
    with pytest.raises(ValueError, match="got -1 .. 2"):
        perplexity(model, torch.tensor([1, 2, -1]), context_length=4)


def test_default_context_fits_the_model_and_huge_losses_give_inf():
    """The default window is 512 tokens or the model's positions where fewer (a 256-position model was refused
    for any input); a mean NLL past a float's exp range gives perplexity inf (was an OverflowError)."""
    small = build("llama", num_heads=4, num_kv_heads=2, layers=1, dtype=torch.float64)
    assert small.config.max_position_embeddings == 256
    ids = torch.randint(0, 97, (300,))
    res = perplexity(small, ids)
    assert (res.context_length, res.windows, res.tokens_scored) == (256, 2, 298)
    assert res.perplexity == pytest.approx(perplexity(small, ids, context_length=256).perplexity, rel=1e-12)
    with torch.no_grad():
        small.lm_head.weight.mul_(1e4)  # confident and wrong: thousands of nats a token
    res = perplexity(small, ids)
    assert res.nll_per_token > 710 and math.isfinite(res.nll_per_token) and res.perplexity == math.inf


def test_pydoc_text_fingerprint_and_disjoint_calibration():
    text = pydoc_topics_text()
    fp = pydoc_topics_fingerprint()
    assert fp["sha256"] == hashlib.sha256(text.encode()).hexdigest() and fp["chars"] == len(text)
    cal = calibration_text(30_000)
    assert len(cal) >= 30_000 and text.endswith(cal)
    assert text[: len(text) - len(cal)].endswith("\n\n")  # starts at a topic boundary
    with pytest.raises(ValueError, match="overlap"):
        calibration_text(len(text) - 1000)
    with pytest.raises(ValueError, match="max_chars"):
        calibration_text(0)
    # avoid_tokens=0 keeps nothing clear, with or without a tokenizer (with one it read the text's last offset)
    tok = _WordTokenizer()
    assert calibration_text(1000, avoid_tokens=0, tokenizer=tok) == calibration_text(1000, avoid_tokens=0)
    assert calibration_text(1000, avoid_tokens=5, tokenizer=tok) == calibration_text(1000)
    with pytest.raises(ValueError, match="avoid_tokens must be an int >= 0; got -1"):
        calibration_text(1000, avoid_tokens=-1, tokenizer=tok)
    with pytest.raises(ValueError, match="max_chars must be an int; got 100.5"):
        calibration_text(100.5)
    with pytest.raises(ValueError, match="max_tokens must be an int; got 100.5"):
        evaluation_ids(tok, 100.5)


class _WordTokenizer:
    """Whitespace-separated words as tokens, with their character offsets (what ``calibration_text`` reads)."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False, return_tensors=None):
        import re

        spans = [m.span() for m in re.finditer(r"\S+", text)]
        return {"input_ids": list(range(len(spans))), "offset_mapping": spans}
