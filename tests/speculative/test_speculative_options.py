"""The ``speculative=`` options: bad options raise clear errors and leave the model untouched.

SpeculativeConfig validates its fields (also when edited after construction; accelerate_model keeps its own copy),
exit_layer is for early exit only, and accelerating again with other speculative options raises.
"""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, _messages, greedy, repetitive_batch, truncated

import hf_accel
from hf_accel import SpeculativeConfig, accelerate_model, revert_model, speculative_stats


def test_accelerating_again_with_other_speculative_options_raises(tiny):
    """Another draft model or other draft settings on an accelerated model raise (revert first); the same
    options again are a no-op."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = truncated(model, LAYERS)
    spec = SpeculativeConfig("draft_model", draft_model=draft, num_draft_tokens=4)
    ours = accelerate_model(copy.deepcopy(model), speculative=spec)
    assert accelerate_model(ours, speculative=SpeculativeConfig("draft_model", draft_model=draft,
                                                                num_draft_tokens=4)) is ours
    for other in (SpeculativeConfig("draft_model", draft_model=truncated(model, LAYERS), num_draft_tokens=4),
                  SpeculativeConfig("draft_model", draft_model=draft, num_draft_tokens=2),
                  SpeculativeConfig("draft_model", draft_model=draft, num_draft_tokens=4, adaptive=False)):
        with pytest.raises(ValueError, match="already accelerated"):
            accelerate_model(ours, speculative=other)
    # the draft, accelerated by hf-accel for that model: the message says so (the caller never accelerated it)
    with pytest.raises(ValueError, match="already accelerated as the draft model of a LlamaForCausalLM's "
                                         "speculative decoding"):
        accelerate_model(draft, speculative="prompt_lookup")
    revert_model(ours)
    with pytest.raises(ValueError, match=r"^model already accelerated with") as refused:  # no draft mention
        other = accelerate_model(copy.deepcopy(model))
        accelerate_model(other, speculative="prompt_lookup")
    assert "as the draft model" not in str(refused.value)


def test_speculative_stats_are_a_deep_copy(tiny):
    """Changing the returned dict, nested dicts included, changes nothing the next read returns."""
    model = accelerate_model(tiny.model("llama", num_hidden_layers=LAYERS), speculative="prompt_lookup")
    ids, mask = repetitive_batch(tiny)
    greedy(model, ids, mask, tiny.PAD, max_new_tokens=8)
    stats = speculative_stats(model)
    want = copy.deepcopy(stats)
    stats["draft_lengths"]["999"] = 1
    stats["round_ms"].clear()
    stats["verify_steps"] = -5
    assert speculative_stats(model) == want and want["draft_lengths"]


def test_bad_options_raise_and_leave_the_model_untouched(tiny):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="speculative method must be one of"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig(method="prompt_lookup", num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft_model is required"):
        SpeculativeConfig(method="draft_model")
    for bad in (dict(max_ngram=True), dict(max_ngram=17), dict(min_ngram=0), dict(min_ngram=3, max_ngram=2),
                dict(max_ngram=2.0)):
        with pytest.raises(ValueError, match="min_ngram <= max_ngram <= 16"):
            SpeculativeConfig(method="prompt_lookup", **bad)
    with pytest.raises(ValueError, match="match_gated must be True, False or None"):
        SpeculativeConfig(method="prompt_lookup", match_gated="yes")
    # options the method would ignore are refused, as exit_layer with prompt lookup is
    with pytest.raises(ValueError, match="match_gated applies to method 'prompt_lookup' only, not 'early_exit'"):
        SpeculativeConfig(method="early_exit", match_gated=True)
    with pytest.raises(ValueError, match="max_ngram / min_ngram apply to method 'prompt_lookup' only"):
        SpeculativeConfig(method="draft_model", draft_model=model, max_ngram=5)
    with pytest.raises(ValueError, match="match_gated=True needs adaptive=True"):
        SpeculativeConfig(method="prompt_lookup", adaptive=False, match_gated=True)
    with pytest.raises(ValueError, match="exit_layer applies to method 'early_exit' only"):
        SpeculativeConfig(method="prompt_lookup", exit_layer=2)
    SpeculativeConfig(method="early_exit", max_ngram=3, min_ngram=1)  # the defaults, given: nothing ignored
    SpeculativeConfig(method="prompt_lookup", adaptive=False, match_gated=False)
    with pytest.raises(TypeError, match="speculative must be") as refused:
        accelerate_model(model, speculative=3)
    # the names a string may take ('draft_model' needs the model itself)
    assert "'prompt_lookup' or 'early_exit', or a draft model" in str(refused.value)
    assert "'draft_model'" not in str(refused.value)
    other_vocab = tiny.model("llama", vocab_size=96)
    with pytest.raises(ValueError, match="vocab_size"):
        accelerate_model(model, speculative=other_vocab)
    with pytest.raises(ValueError, match="exit_layer must be <"):
        accelerate_model(model, speculative=SpeculativeConfig("early_exit", exit_layer=LAYERS))
    with pytest.raises(ValueError, match="fast_decode"):
        accelerate_model(model, speculative="prompt_lookup", fast_decode=False)
    with pytest.raises(ValueError, match="target itself"):
        accelerate_model(model, speculative=model)
    assert not hf_accel.is_accelerated(model)


def test_a_config_edited_after_construction_is_checked_and_copied(tiny):
    """accelerate_model validates a SpeculativeConfig again (fields set after construction) and keeps its
    own copy: edits after accelerating do not reach the model."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    cfg = SpeculativeConfig("prompt_lookup", num_draft_tokens=3)
    cfg.match_gated = "yes"
    with pytest.raises(ValueError, match="match_gated must be True, False or None"):
        accelerate_model(copy.deepcopy(model), speculative=cfg)
    cfg.match_gated, cfg.num_draft_tokens = None, 0
    with pytest.raises(ValueError, match="num_draft_tokens must be an int"):
        accelerate_model(copy.deepcopy(model), speculative=cfg)
    cfg.num_draft_tokens = 3
    ours = accelerate_model(copy.deepcopy(model), speculative=cfg)
    cfg.num_draft_tokens, cfg.method = 0, "bogus"
    ids, mask = repetitive_batch(tiny)
    out = greedy(ours, ids[:1], mask[:1], tiny.PAD, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(out, greedy(model, ids[:1], mask[:1], tiny.PAD, max_new_tokens=6, eos_token_id=None))
    assert speculative_stats(ours)["num_draft_tokens"] == 3


def test_exit_layer_is_refused_with_other_methods():
    with pytest.raises(ValueError, match="exit_layer applies to method 'early_exit' only, not 'prompt_lookup'"):
        SpeculativeConfig("prompt_lookup", exit_layer=5)
    assert SpeculativeConfig("early_exit", exit_layer=5).exit_layer == 5


def test_numpy_ints_are_taken_as_ints():
    import numpy as np

    cfg = SpeculativeConfig("prompt_lookup", num_draft_tokens=np.int64(3), max_ngram=np.int32(4), min_ngram=np.int8(2))
    assert (cfg.num_draft_tokens, cfg.max_ngram, cfg.min_ngram) == (3, 4, 2)
    assert all(type(v) is int for v in (cfg.num_draft_tokens, cfg.max_ngram, cfg.min_ngram))
    assert type(SpeculativeConfig("early_exit", exit_layer=np.int64(1)).exit_layer) is int
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig("prompt_lookup", num_draft_tokens=np.float64(3))


def test_repeated_eos_ids_count_once(tiny, hf_log):
    """Nine copies of one EOS id are one EOS id: the call decodes speculatively (it fell back with "more than 8 EOS
    ids"), with stock's tokens."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    free = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 5])
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=[eos] * 9)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup")
    got = greedy(ours, ids, mask, tiny.PAD, eos_token_id=[eos] * 9)
    assert torch.equal(got, want)
    assert speculative_stats(ours) is not None
    assert not any("more than 8 EOS ids" in r.getMessage() for r in hf_log.records)


def test_a_draft_whose_lm_head_scores_another_vocabulary_is_refused(tiny, hf_log):
    """A draft whose config and embedding match the target's vocabulary but whose LM head gives fewer logits: it was
    accepted, and speculative sampling raised a shape error mid-call. Now accelerate_model refuses it; an LM head
    replaced that way after the set-up turns speculation off for the call (logged), with the plain path's tokens."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = truncated(model, 1)
    narrow = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size - 4, bias=False)
    bad = copy.deepcopy(draft)
    bad.lm_head = copy.deepcopy(narrow)
    with pytest.raises(ValueError, match=r"LM head gives \d+ logits, the target's \d+"):
        accelerate_model(copy.deepcopy(model), speculative=bad)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", draft_model=draft,
                                                                                adaptive=False))
    ids, mask = repetitive_batch(tiny, lengths=(12,))
    plain = greedy(model, ids, mask, tiny.PAD, max_new_tokens=6)
    draft.lm_head = narrow
    torch.manual_seed(0)
    sampled = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                            pad_token_id=tiny.PAD)
    assert sampled.shape == plain.shape
    assert _messages(hf_log, "speculative decoding not used: the draft model's LM head gives")
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, max_new_tokens=6), plain)


def test_exit_layer_no_longer_below_the_layer_count_turns_speculation_off(tiny, hf_log):
    """Early exit with exit_layer 2 on a 3-layer model whose layers are then cut to 2: the call drafted with the whole
    model (acceptance 1.0, nothing logged), and with fewer layers raised an error that did not name exit_layer. Now
    the call runs the plain fast path, logged, with the pruned model's stock tokens."""
    model = tiny.model("llama", num_hidden_layers=3)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("early_exit", exit_layer=2))
    ids, mask = repetitive_batch(tiny)
    greedy(ours, ids, mask, tiny.PAD, max_new_tokens=4)
    for keep in (2, 1):
        ours.model.layers = torch.nn.ModuleList(list(ours.model.layers)[:keep])
        ours.config.num_hidden_layers = keep
        want = greedy(truncated(model, keep), ids, mask, tiny.PAD, max_new_tokens=6)
        assert torch.equal(greedy(ours, ids, mask, tiny.PAD, max_new_tokens=6), want)
        assert _messages(hf_log, f"exit_layer 2 is not below the model's {keep} layers now")
        assert speculative_stats(ours) is None
