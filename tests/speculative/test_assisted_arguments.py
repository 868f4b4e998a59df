"""transformers' assisted-generation arguments on an accelerated model, and calls that fall back.

``assistant_model=``, ``prompt_lookup_num_tokens=`` and ``assistant_early_exit=`` take hf-accel's speculative path
(per call, also from the generation config), a bad prompt_lookup_num_tokens raises naming the argument, values that
are not ints, early-exit layers out of the model's range and assistants hf-accel cannot draft with are left to
transformers' own assisted loop. Calls the speculative rounds
cannot take (min_new_tokens, a repetition penalty, a draft whose KV cache does not fit) decode on the plain fast
path, logged.
"""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, _messages, greedy, repetitive_batch, spec_arg, truncated

from hf_accel import accelerate_model, speculative_stats


@pytest.mark.parametrize("option", ["assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"])
def test_assisted_generation_arguments_take_the_speculative_path(option, tiny, hf_log, monkeypatch):
    import transformers.generation.utils as gen_utils

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    value = {"assistant_model": truncated(model, 2), "prompt_lookup_num_tokens": 4, "assistant_early_exit": 2}[option]
    stock_plain = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    stock_assisted = greedy(model, ids, mask, tiny.PAD, eos_token_id=None, **{option: value})
    assert torch.equal(stock_assisted, stock_plain)
    ours = accelerate_model(copy.deepcopy(model))
    warned = []
    monkeypatch.setattr(gen_utils.logger, "warning_once", lambda msg, *a, **k: warned.append(str(msg)))
    out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, **{option: value})
    assert torch.equal(out, stock_plain)
    # hf-accel's own handling must not trigger transformers' "generation_config together with kwargs" warning
    assert not [w for w in warned if "together with generation-related" in w], warned
    stats = speculative_stats(ours)
    assert stats is not None and stats["verify_steps"] + stats["backed_off_steps"] > 0
    # batch > 1 (transformers' own assisted generation refuses it)
    ids3, mask3 = repetitive_batch(tiny)
    out3 = greedy(ours, ids3, mask3, tiny.PAD, eos_token_id=None, **{option: value})
    assert torch.equal(out3, greedy(model, ids3, mask3, tiny.PAD, eos_token_id=None))
    assert speculative_stats(ours) is not None
    # a later plain call reports no speculative stats
    greedy(ours, ids, mask, tiny.PAD, eos_token_id=None)
    assert speculative_stats(ours) is None


def test_min_new_tokens_falls_back_to_the_plain_fast_path(tiny, hf_log):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, min_new_tokens=12)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup")
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, min_new_tokens=12), stock)
    assert _messages(hf_log, "speculative decoding not used: min_length / min_new_tokens")
    assert speculative_stats(ours) is None


def test_repetition_penalty_falls_back_to_the_plain_fast_path(tiny, hf_log):
    """The speculative rounds do not apply a repetition penalty: such a call decodes on the plain fast path
    (unpadded rows), with the penalty, token-identical to stock."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[mask.all(dim=1)], mask[mask.all(dim=1)]
    assert ids.shape[0] >= 1
    stock = greedy(model, ids, mask, tiny.PAD, eos_token_id=None, repetition_penalty=1.5)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup")
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, repetition_penalty=1.5), stock)
    assert _messages(hf_log, "speculative decoding not used: repetition_penalty")
    assert _messages(hf_log, "generate runs the fast decode path")
    assert speculative_stats(ours) is None
    assert not torch.equal(stock, greedy(model, ids, mask, tiny.PAD, eos_token_id=None))


def test_draft_model_whose_cache_does_not_fit_takes_the_plain_fast_path(tiny, hf_log, monkeypatch):
    """Free device memory (here it is set) that holds the target's KV cache of the call
    but not the draft model's as well: the call decodes without speculation (logged, GiB named), with the
    plain path's tokens; with room for both it decodes speculatively."""
    import hf_accel.cache.paged_cache as paged_cache

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    spec = spec_arg("draft_model-copy", model)
    ours = accelerate_model(copy.deepcopy(model), speculative=spec)
    target = ours._hf_accel_engine
    blocks = target.blocks_needed(ours.generation_config.__class__(max_new_tokens=20), ids)  # the draft's too
    need_target = blocks * target._block_bytes()
    need_both = need_target + blocks * paged_cache.kv_block_bytes(spec.draft_model.config, target.block_size,
                                                                  torch.float32)
    monkeypatch.setattr(paged_cache, "free_kv_bytes", lambda device, fraction=0.9: need_target)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), stock)
    assert speculative_stats(ours) is None
    assert _messages(hf_log, "speculative decoding not used: the target's and the draft model's KV caches")
    monkeypatch.setattr(paged_cache, "free_kv_bytes", lambda device, fraction=0.9: need_both)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), stock)
    assert speculative_stats(ours)["method"] == "draft_model"


def test_negative_assistant_early_exit_raises(tiny):
    """Stock transformers fails on it with "__len__() should return >= 0" and leaves the config's layer count
    negative: it raises naming the argument, and the model is left as it was."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids[:1], mask[:1], tiny.PAD)
    ours = accelerate_model(copy.deepcopy(model))
    with pytest.raises(ValueError, match="assistant_early_exit must be a number of layers >= 0, got -2"):
        greedy(ours, ids[:1], mask[:1], tiny.PAD, assistant_early_exit=-2)
    assert ours.config.num_hidden_layers == LAYERS
    assert torch.equal(greedy(ours, ids[:1], mask[:1], tiny.PAD), stock)


@pytest.mark.parametrize("bad", [0, LAYERS, LAYERS + 1, 99])
def test_assistant_early_exit_out_of_range_runs_transformers_loop_and_cache(tiny, hf_log, bad):
    """0 is not "no early exit" and a value past the last layer is not refused by stock transformers (its draft runs
    no layers / every layer): such a call runs transformers' own assisted loop on its own cache (no PagedCache: its
    draft changes the config's layer count), logged, with stock's tokens, and the model is left as it was."""
    from hf_accel.cache import PagedCache

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids[:1], mask[:1], tiny.PAD)
    ours = accelerate_model(copy.deepcopy(model))
    out = ours.generate(ids[:1], attention_mask=mask[:1], pad_token_id=tiny.PAD, max_new_tokens=20, do_sample=False,
                        assistant_early_exit=bad, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy(model, ids[:1], mask[:1], tiny.PAD, assistant_early_exit=bad))
    assert torch.equal(out.sequences, stock)
    assert not isinstance(out.past_key_values, PagedCache), type(out.past_key_values)
    assert _messages(hf_log, f"transformers' assisted generation runs on its own cache: assistant_early_exit={bad} ")
    # the draft's own generate calls run as stock too (no PagedCache of hf-accel's, no fallback of its fast path)
    assert not _messages(hf_log, "hf-accel: generate uses PagedCache") and not _messages(hf_log, "fast decode path not used")
    assert ours.config.num_hidden_layers == LAYERS
    assert speculative_stats(ours) is None
    assert torch.equal(greedy(ours, ids[:1], mask[:1], tiny.PAD), stock)


def test_per_call_assisted_arguments_follow_each_call(tiny, hf_log):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model))
    for layer in (1, 3, 2):
        assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, assistant_early_exit=layer), stock)
    exits = sorted(e.exit_layer for e in ours._hf_accel_spec_engines.values())
    assert exits == [1, 2, 3]
    # an exit layer at or past the last layer: transformers' own loop, as stock does it
    assert torch.equal(greedy(ours, ids[:1], mask[:1], tiny.PAD, eos_token_id=None, assistant_early_exit=LAYERS),
                       greedy(model, ids[:1], mask[:1], tiny.PAD, eos_token_id=None))
    assert _messages(hf_log, f"transformers' assisted generation runs on its own cache: assistant_early_exit={LAYERS} "
                             f"is not below the model's {LAYERS} layers")
    # past the last layer: transformers' own loop and cache (test_assistant_early_exit_out_of_range_...)
    assert torch.equal(greedy(ours, ids[:1], mask[:1], tiny.PAD, eos_token_id=None, assistant_early_exit=LAYERS + 1),
                       greedy(model, ids[:1], mask[:1], tiny.PAD, eos_token_id=None))
    assert ours.config.num_hidden_layers == LAYERS
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, no_repeat_ngram_size=50),
                       greedy(model, ids, mask, tiny.PAD, eos_token_id=None, no_repeat_ngram_size=50))
    # prompt lookup from the model's own generation config takes hf-accel's path too
    ours.generation_config.prompt_lookup_num_tokens = 3
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), stock)
    assert speculative_stats(ours)["method"] == "prompt_lookup"


def test_non_int_assisted_arguments_are_left_to_transformers(tiny, hf_log):
    """prompt_lookup_num_tokens / assistant_early_exit that are not ints are not converted (stock transformers
    refuses them): the call runs transformers' own assisted generation, which raises as stock does."""
    from hf_accel.integrations.generate import assisted_config

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    for name, bad in (("prompt_lookup_num_tokens", "5"), ("prompt_lookup_num_tokens", 2.5),
                      ("assistant_early_exit", "1"), ("prompt_lookup_num_tokens", True)):
        config, rest, reason = assisted_config(model, {name: bad})
        assert config is None and rest == {name: bad} and reason == f"{name}={bad!r} is not an int"
    config, _, reason = assisted_config(model, {"prompt_lookup_num_tokens": 5})
    assert reason is None and config.num_draft_tokens == 5


@pytest.mark.parametrize("bad", [0, -3])
def test_prompt_lookup_num_tokens_below_one_raises(tiny, bad):
    """0 is not "no prompt lookup": stock transformers refuses it (and negatives) with an unspecific message; the
    accelerated model raises naming the argument, from the call's kwargs or the generation config."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup")
    with pytest.raises(ValueError, match=f"prompt_lookup_num_tokens must be a positive number of draft tokens, got {bad}"):
        greedy(ours, ids[:1], mask[:1], tiny.PAD, prompt_lookup_num_tokens=bad)
    config = copy.deepcopy(ours.generation_config)
    config.prompt_lookup_num_tokens = bad
    with pytest.raises(ValueError, match=f"got {bad}"):
        greedy(ours, ids[:1], mask[:1], tiny.PAD, generation_config=config)


def test_an_assistant_model_hf_accel_cannot_draft_with_runs_transformers_assisted_loop(tiny, hf_log):
    """A per-call ``assistant_model`` of an architecture hf-accel's drafting does not take (GPT-2, same vocabulary)
    works as in stock transformers: its assisted loop runs (logged), giving stock's tokens. The explicit
    ``accelerate_model(speculative=...)`` still refuses that draft."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    torch.manual_seed(0)
    assistant = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=model.config.vocab_size)).eval()
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[:1], mask[:1]
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=12, assistant_model=assistant)
    ours = accelerate_model(copy.deepcopy(model))
    got = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=12, assistant_model=assistant)
    assert torch.equal(got, stock)
    assert speculative_stats(ours) is None  # not hf-accel's speculative path
    assert any("transformers' assisted generation runs: the assistant model cannot draft on hf-accel's path "
               "(draft model_type 'gpt2' is not supported" in r.getMessage() for r in hf_log.records)
    with pytest.raises(ValueError, match="draft model_type 'gpt2' is not supported"):
        accelerate_model(copy.deepcopy(model), speculative=assistant)


def test_assisted_batch_left_to_transformers_loop_is_logged_as_one_row_only(tiny, hf_log):
    """A batch of several rows whose assisted call hf-accel leaves to transformers' loop (a sliding window shorter
    than the sequence) is refused by transformers (one row only), as in stock; the log line says so (it only said
    that transformers' loop runs)."""
    model = tiny.model("mistral", sliding_window=8)
    ids, mask = repetitive_batch(tiny)
    assert ids.shape[0] > 1
    with pytest.raises(ValueError, match="batch_size = 1"):
        greedy(model, ids, mask, tiny.PAD, max_new_tokens=6, prompt_lookup_num_tokens=3)
    ours = accelerate_model(copy.deepcopy(model))
    with pytest.raises(ValueError, match="batch_size = 1"):
        greedy(ours, ids, mask, tiny.PAD, max_new_tokens=6, prompt_lookup_num_tokens=3)
    assert any("assisted generation runs transformers' own loop" in r.getMessage() and
               f"transformers' assisted generation takes one row; this call has {ids.shape[0]}" in r.getMessage()
               for r in hf_log.records)


def test_the_model_itself_as_assistant_runs_transformers_assisted_loop(tiny, hf_log):
    """``generate(assistant_model=model)`` (the accelerated model drafting for itself) works as in stock: transformers'
    assisted loop runs it, logged (it raised "the draft model is the target itself" from inside generate)."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[:1], mask[:1]
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=10, assistant_model=model)
    ours = accelerate_model(copy.deepcopy(model))
    got = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=10, assistant_model=ours)
    assert torch.equal(got, stock)
    assert speculative_stats(ours) is None
    assert any("the assistant model cannot draft on hf-accel's path" in r.getMessage() and "target itself" in
               r.getMessage() for r in hf_log.records)


@pytest.mark.parametrize("ngram", [1, 2, 4, 20])
def test_max_matching_ngram_size_sets_the_lookups_longest_ngram(ngram, tiny, hf_log, monkeypatch):
    """transformers' ``max_matching_ngram_size`` with ``prompt_lookup_num_tokens`` is the lookup's longest n-gram
    (capped at 16, logged): the call stays on hf-accel's path, also at batch 3 (it fell back to transformers' loop,
    which refuses batches above 1)."""
    import hf_accel.speculative.registry as registry

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model))
    configs = []
    engine_for = registry.engine_for
    monkeypatch.setattr(registry, "engine_for", lambda m, e, cfg: configs.append(cfg) or engine_for(m, e, cfg))
    got = greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, prompt_lookup_num_tokens=4,
                 max_matching_ngram_size=ngram)
    assert torch.equal(got, want)
    assert speculative_stats(ours) is not None
    assert [c.max_ngram for c in configs] == [min(ngram, 16)] and configs[0].num_draft_tokens == 4
    assert any("matches at most 16-grams" in r.getMessage() for r in hf_log.records) == (ngram > 16)


def test_numpy_int_assisted_arguments_take_the_speculative_path(tiny):
    """``prompt_lookup_num_tokens`` / ``max_matching_ngram_size`` as numpy ints (transformers takes them) decode on
    hf-accel's speculative path (they were handed to transformers' loop as "not an int")."""
    import numpy as np

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model))
    got = greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, prompt_lookup_num_tokens=np.int64(4),
                 max_matching_ngram_size=np.int32(2))
    assert torch.equal(got, want)
    assert speculative_stats(ours) is not None and speculative_stats(ours)["num_draft_tokens"] == 4
