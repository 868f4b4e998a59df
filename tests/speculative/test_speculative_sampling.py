"""Speculative ``generate`` on CPU: sampling (rejection sampling).

The tokens drawn through rejection sampling have the plain fast path's distribution (chi-squared, every
proposer and match-gated prompt lookup); num_return_sequences decodes speculatively; sampling with plain
rounds between verify steps draws valid tokens; a fixed k repeats its draws under a seed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, _messages, repetitive_batch, spec_arg
from stat_tests import homogeneity_p

from hf_accel import SpeculativeConfig, accelerate_model, speculative_stats


P_MIN = 1e-3
ROWS = 3000


@pytest.mark.parametrize("method", ["early_exit", "prompt_lookup", "prompt_lookup-gated", "draft_model"])
def test_sampling_keeps_the_distribution(method, tiny, request):
    """Three tokens per row over ROWS copies of one prompt: tokens 2 and 3 come out of a verify step
    (accepted drafts, resampled rejections, bonus tokens); their distributions and the joint (2, 3) must
    match the plain fast path's. A 16-token vocabulary, so that prompt lookup's copied drafts are accepted
    often enough (about 4% here) to exercise both branches. ``prompt_lookup-gated``: match-gated rounds
    (drafts looked up at the end of the round before) verifying whenever a row matched."""
    vocab = 16
    model = tiny.model("llama", seed=3, num_hidden_layers=LAYERS, vocab_size=vocab)
    ids = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    big_ids, big_mask = ids.repeat(ROWS, 1), mask.repeat(ROWS, 1)
    kwargs = dict(do_sample=True, temperature=1.5, top_k=0, max_new_tokens=3, eos_token_id=None,
                  pad_token_id=tiny.PAD)

    def draw(m, seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return m.generate(input_ids=big_ids, attention_mask=big_mask, **kwargs)[:, ids.shape[1]:]

    plain = draw(accelerate_model(copy.deepcopy(model)), 1)
    gated = method == "prompt_lookup-gated"
    if gated:
        request.getfixturevalue("verify_on_match")
        spec_cfg = SpeculativeConfig("prompt_lookup", num_draft_tokens=2, match_gated=True)
    else:
        spec_cfg = spec_arg(method, model, num_draft_tokens=2, adaptive=False)
    spec_model = accelerate_model(copy.deepcopy(model), speculative=spec_cfg)
    spec = draw(spec_model, 2)
    stats = speculative_stats(spec_model)
    assert stats["draft_tokens"] > 0 and 0.02 < stats["acceptance_rate"] < 0.98, stats
    assert stats["match_gated"] is gated
    for pos in (1, 2):
        p = homogeneity_p(spec[:, pos], plain[:, pos])
        assert p > P_MIN, f"token {pos + 1}: p = {p:.2e}"
    p = homogeneity_p(spec[:, 1] * vocab + spec[:, 2], plain[:, 1] * vocab + plain[:, 2])
    assert p > P_MIN, f"tokens (2, 3): p = {p:.2e}"


def test_num_return_sequences_decodes_speculatively(tiny, hf_log):
    """Sampling with num_return_sequences: n rows per prompt in transformers' order, decoded by the speculative
    engine (rejection sampling over the expanded batch), not transformers' loop."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", adaptive=False,
                                                                                num_draft_tokens=2))
    torch.manual_seed(0)
    with torch.no_grad():
        out = ours.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=2,
                            max_new_tokens=6, eos_token_id=None, pad_token_id=tiny.PAD)
    assert out.shape == (6, ids.shape[1] + 6) and torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(2, 0))
    stats = speculative_stats(ours)
    assert stats is not None and stats["verify_steps"] > 0, stats
    assert not _messages(hf_log, "not used")


@pytest.mark.parametrize("method", ["early_exit", "draft_model", "prompt_lookup"])
def test_sampling_with_plain_rounds(method, tiny, alternating_k):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative=spec_arg(method, model, num_draft_tokens=3))
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(ours.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=20,
                                      top_p=0.95, max_new_tokens=12, eos_token_id=None, pad_token_id=tiny.PAD))
    new = outs[0][:, ids.shape[1]:]
    assert new.shape == (3, 12) and ((new >= 0) & (new < model.config.vocab_size)).all()
    assert not torch.equal(outs[0], outs[1])
    assert speculative_stats(ours)["backed_off_steps"] > 0


def test_sampling_with_a_fixed_k_repeats_under_a_seed(tiny, hf_log):
    """adaptive=False: the same k every round, so a seed draws the same samples on every call; the log says that
    speculative sampling's draws are not transformers' for the same seed."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=3,
                                                                               adaptive=False))
    outs = []
    for _ in range(2):
        torch.manual_seed(1234)
        with torch.no_grad():
            outs.append(ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=True,
                                      pad_token_id=tiny.PAD))
    assert torch.equal(outs[0], outs[1])
    assert speculative_stats(ours)["verify_steps"] > 0
    assert _messages(hf_log, "a seed gives other draws than transformers' sampling loop")
