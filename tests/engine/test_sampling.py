"""Sampling on generate's fast decode path draws from the same distribution as stock transformers.

A tiny random llama (float32) gets two left-padded prompts, each repeated over many rows of one batch,
so one ``generate`` call gives thousands of independent draws. The token counts of the fast path and of
stock transformers (different seeds) are compared with a chi-squared test of homogeneity on the 2 x K
table; a wrong temperature, top-k or top-p shows up as p << 1e-3 (the power check below makes sure the
test can see a small difference). The first token comes from the prefill logits, the second from the
decode step's logits after the first draw, so both halves of the path are covered.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_accel import accelerate_model
from stat_tests import homogeneity_p

ROWS = 4000  # draws per prompt and per side
P_MIN = 1e-3
LENGTHS = (9, 4)  # two prompts, the second left padded

SETTINGS = {
    "temperature": dict(temperature=0.7, top_k=0),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.6, top_k=0),
    "combined": dict(temperature=1.3, top_k=20, top_p=0.8),
}


@pytest.fixture
def models(tiny):
    """(stock model, accelerated copy, prompt ids, attention mask, pad id)."""
    stock = tiny.model("llama", seed=3)
    fast = accelerate_model(copy.deepcopy(stock))
    ids, mask = tiny.batch(seed=4, lengths=LENGTHS)
    return stock, fast, ids, mask, tiny.PAD


def _draw(model, ids, mask, pad, seed, max_new_tokens, **sampling):
    """``ROWS`` samples per prompt: the generated tokens, [prompts, ROWS, max_new_tokens]."""
    batch_ids = ids.repeat_interleave(ROWS, 0)
    batch_mask = mask.repeat_interleave(ROWS, 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=batch_ids, attention_mask=batch_mask, do_sample=True,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=pad,
                             **sampling)
    assert out.shape == (len(ids) * ROWS, ids.shape[1] + max_new_tokens)
    return out[:, ids.shape[1]:].view(len(ids), ROWS, max_new_tokens)


def test_homogeneity_test_has_power_and_accepts_equal_samples():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, generator=g), 0)
    draw = lambda probs, n: torch.multinomial(probs, n, replacement=True, generator=g)  # noqa: E731
    assert homogeneity_p(draw(p, ROWS), draw(p, ROWS)) > P_MIN
    assert homogeneity_p(draw(p, ROWS), draw(torch.softmax(p.log() / 0.8, 0), ROWS)) < P_MIN


@pytest.mark.parametrize("name", list(SETTINGS))
def test_first_token_distribution_matches_stock(name, models, decode_steps):
    stock, fast, ids, mask, pad = models
    sampling = SETTINGS[name]
    ours = _draw(fast, ids, mask, pad, seed=11, max_new_tokens=1, **sampling)
    theirs = _draw(stock, ids, mask, pad, seed=12, max_new_tokens=1, **sampling)
    assert fast._hf_accel_engine.steps, "the fast path did not run"
    for prompt in range(len(ids)):
        p = homogeneity_p(ours[prompt], theirs[prompt])
        assert p > P_MIN, f"{name}, prompt {prompt}: p = {p:.2e}"
    if name == "top_k":
        # Never a token outside stock's top 5 (the next-token logits of stock transformers).
        with torch.no_grad():
            logits = stock(input_ids=ids, attention_mask=mask).logits[:, -1]
        top5 = logits.topk(5, dim=-1).indices
        for prompt in range(len(ids)):
            assert set(ours[prompt].unique().tolist()) <= set(top5[prompt].tolist())
            assert set(theirs[prompt].unique().tolist()) <= set(top5[prompt].tolist())


def test_statistical_test_sees_a_wrong_temperature(models):
    """The same comparison with stock at temperature 0.85 instead of 0.7 must fail: the test has teeth."""
    stock, fast, ids, mask, pad = models
    ours = _draw(fast, ids, mask, pad, seed=21, max_new_tokens=1, temperature=0.7, top_k=0)
    wrong = _draw(stock, ids, mask, pad, seed=22, max_new_tokens=1, temperature=0.85, top_k=0)
    assert max(homogeneity_p(ours[i], wrong[i]) for i in range(len(ids))) < P_MIN


def test_second_token_from_the_decode_step_matches_stock(models, decode_steps):
    """Two tokens per row: the second is drawn from the decode step's logits after the first draw; the
    joint distribution of (first, second) pooled over rows must match stock."""
    stock, fast, ids, mask, pad = models
    sampling = SETTINGS["combined"]
    ours = _draw(fast, ids, mask, pad, seed=31, max_new_tokens=2, **sampling)
    assert decode_steps, "the fast path's decode step did not run"
    theirs = _draw(stock, ids, mask, pad, seed=32, max_new_tokens=2, **sampling)
    vocab = stock.config.vocab_size
    for prompt in range(len(ids)):
        p_second = homogeneity_p(ours[prompt, :, 1], theirs[prompt, :, 1])
        pairs = lambda t: t[:, 0] * vocab + t[:, 1]  # noqa: E731
        p_pairs = homogeneity_p(pairs(ours[prompt]), pairs(theirs[prompt]))
        assert p_second > P_MIN and p_pairs > P_MIN, f"prompt {prompt}: p = {p_second:.2e} / {p_pairs:.2e}"
