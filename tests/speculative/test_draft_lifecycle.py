"""The speculative engines and the draft model over their lifetime: acceleration, revert, ownership, memory.

revert_model removes speculation; assistant models are not kept and are reverted with the target; a draft the
caller reverted is accelerated again (by the next call, or when passed again), a draft the caller accelerated again
drafts with its new engine and stays the caller's; a draft changed after accelerating (training mode) declines
speculation for the call; old cache pools are freed before a larger one is made.
"""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, _messages, greedy, repetitive_batch, truncated

import hf_accel
from hf_accel import SpeculativeConfig, accelerate_model, revert_model, speculative_stats


def test_revert_removes_speculation(tiny):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative="early_exit")
    greedy(ours, ids, mask, tiny.PAD)
    assert speculative_stats(ours) is not None
    revert_model(ours)
    assert speculative_stats(ours) is None and "_hf_accel_spec_engines" not in ours.__dict__
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD), greedy(model, ids, mask, tiny.PAD))


def test_an_assistant_model_reverted_by_the_caller_is_accelerated_again_when_passed_again(tiny):
    """``generate(assistant_model=draft)`` names the draft in the call: after ``revert_model(draft)`` the same draft
    passed again drafts again (accelerated anew, and reverted with the target), like a draft passed the first time."""
    from hf_accel import is_accelerated

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = truncated(model, 2)
    ours = accelerate_model(copy.deepcopy(model))
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    for _ in range(2):
        assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, assistant_model=draft), want)
        assert speculative_stats(ours) is not None
        assert is_accelerated(draft)
        revert_model(draft)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, assistant_model=draft), want)
    assert speculative_stats(ours) is not None
    revert_model(ours)
    assert not is_accelerated(draft)


def test_a_draft_the_caller_reverted_and_accelerated_again_drafts_with_its_new_engine(tiny):
    """A draft from ``accelerate_model(speculative=...)`` that the caller reverted and accelerated again drafts through
    its new decode engine (never the released one) and stays accelerated when the target is reverted: the caller
    owns it now. Accelerated again without fast decode, it cannot draft: a clear error."""
    from hf_accel import is_accelerated

    ours, draft, ids, mask, want = _target_with_config_draft(tiny)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    old_engine = draft._hf_accel_engine
    revert_model(draft)
    accelerate_model(draft)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    assert speculative_stats(ours) is not None
    (spec,) = ours._hf_accel_spec_engines.values()
    assert spec.draft_fast is draft._hf_accel_engine and spec.draft_fast is not old_engine
    revert_model(draft)
    accelerate_model(draft, fast_decode=False)
    with pytest.raises(ValueError, match="without fast_decode"):
        greedy(ours, ids, mask, tiny.PAD, eos_token_id=None)
    revert_model(draft)
    accelerate_model(draft)
    revert_model(ours)
    assert is_accelerated(draft)
    revert_model(draft)


def test_assistant_models_are_not_kept_and_are_reverted(tiny):
    import gc
    import weakref

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model))
    refs = []
    for _ in range(3):
        draft = truncated(model, 2)
        refs.append(weakref.ref(draft))
        greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, assistant_model=draft)
        assert hf_accel.is_accelerated(draft)
    last = draft
    del draft
    gc.collect()
    assert [r() is None for r in refs] == [True, True, False]  # only the last draft is still referenced
    assert not any(hf_accel.is_accelerated(r()) for r in refs[:2] if r() is not None)
    revert_model(ours)
    assert not hf_accel.is_accelerated(last)  # accelerated by hf-accel as a draft, reverted with the target


def test_old_pools_are_freed_before_a_larger_pool_is_made(tiny, monkeypatch):
    """A call that needs a larger pool than the fast engine has drops the old PagedCache before making the new one
    (the new pool is sized as if the old one were freed). The speculative engine's record of the caches its graphs
    read held the old one alive meanwhile: both pools at once (on a GPU, possibly GBs)."""
    import gc
    import weakref

    from hf_accel.engine import fast_generate

    model = accelerate_model(tiny.model("llama", num_hidden_layers=LAYERS), speculative="prompt_lookup")
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    greedy(model, ids, mask, tiny.PAD, eos_token_id=None, max_new_tokens=4)
    engine = model._hf_accel_engine
    old = weakref.ref(engine.cache)
    alive_at_new_pool = []
    made = fast_generate.PagedCache

    def paged_cache(*args, **kwargs):
        gc.collect()
        alive_at_new_pool.append(old() is not None)
        return made(*args, **kwargs)

    monkeypatch.setattr(fast_generate, "PagedCache", paged_cache)
    blocks = engine.cache.manager.num_blocks
    long_ids = torch.cat([ids] * 8, dim=1)
    out = greedy(model, long_ids, torch.ones_like(long_ids), tiny.PAD, eos_token_id=None,
                 max_new_tokens=blocks * engine.block_size)
    assert out.shape[1] > long_ids.shape[1] and engine.cache.manager.num_blocks > blocks
    assert alive_at_new_pool == [False]


def _target_with_config_draft(tiny):
    """A tiny target accelerated with ``speculative=SpeculativeConfig("draft_model", ...)`` over its own first 2 layers
    as the draft, one 10-token row, and the stock model's greedy tokens for it: (target, draft, ids, mask, want)."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = truncated(model, 2)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", draft_model=draft))
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    return ours, draft, ids, mask, greedy(model, ids, mask, tiny.PAD, eos_token_id=None)


def test_a_draft_model_changed_after_accelerating_declines_speculation(tiny, hf_log):
    """The draft is checked on every call, not only when its engine is made: a draft put in training mode (or cast
    to a dtype the kernels do not take) makes the call decode plainly, logged, with the target's greedy tokens."""
    ours, draft, ids, mask, want = _target_with_config_draft(tiny)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    assert speculative_stats(ours) is not None
    draft.train()
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    assert speculative_stats(ours) is None
    assert _messages(hf_log, "the draft model cannot run hf-accel's decode step now: the model is in training mode")
    draft.eval()
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    assert speculative_stats(ours) is not None


def test_a_target_whose_vocabulary_grew_decodes_plainly(tiny, hf_log):
    """The draft's vocabulary is checked against the target's on every call: after the target's
    ``resize_token_embeddings`` the draft's catch-up raised a bare IndexError (the target's new ids have no row in
    the draft's embedding). Now the call decodes plainly, logged, with stock's tokens."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    draft = truncated(model, 2)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", draft_model=draft))
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    grown = model.config.vocab_size + 12
    for m in (model, ours):
        m.resize_token_embeddings(grown, mean_resizing=False)
        with torch.no_grad():  # the new ids win often: the target writes them, the draft has no row for them
            m.lm_head.weight[-12:] = 4 * m.lm_head.weight[:120:10]
            m.model.embed_tokens.weight[-12:] = m.model.embed_tokens.weight[:120:10]
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    assert int(want.max()) >= draft.config.vocab_size
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    assert speculative_stats(ours) is None
    assert _messages(hf_log, f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                             f"target's ({draft.config.vocab_size + 12}) now")


def test_a_draft_model_reverted_by_the_caller_is_accelerated_again_at_the_next_call(tiny, hf_log):
    """A draft of ``accelerate_model(speculative=...)`` that the caller reverted (``revert_model``) is accelerated again
    by the target's next call, logged, and drafts through its new acceleration (never the released one), with the
    target's greedy tokens; it is the target's again, so reverting the target reverts it."""
    from hf_accel import is_accelerated, revert_model

    ours, draft, ids, mask, want = _target_with_config_draft(tiny)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    old_engine = draft._hf_accel_engine
    revert_model(draft)
    assert not is_accelerated(draft)
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), want)
    assert speculative_stats(ours) is not None
    assert is_accelerated(draft) and draft._hf_accel_engine is not old_engine
    assert _messages(hf_log, "the draft model was reverted (revert_model) since it last drafted")
    revert_model(ours)
    assert not is_accelerated(draft)


def test_a_draft_the_caller_accelerated_again_is_not_reverted_with_the_target(tiny):
    """Ownership follows the draft's current acceleration, also without a call in between: a draft the caller reverted
    and accelerated again stays accelerated when the target is reverted; a draft shared by two targets, reverted by
    the caller and then accelerated by the second target, is not reverted by the first target's revert, and the
    second target keeps drafting with it."""
    from hf_accel import is_accelerated, revert_model

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    for call_first in (False, True):
        draft = truncated(model, 2)
        ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", draft_model=draft))
        if call_first:
            greedy(ours, ids, mask, tiny.PAD, eos_token_id=None)
        revert_model(draft)
        accelerate_model(draft)
        revert_model(ours)
        assert is_accelerated(draft), call_first
        revert_model(draft)

    draft = truncated(model, 2)
    first = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", draft_model=draft))
    greedy(first, ids, mask, tiny.PAD, eos_token_id=None)
    revert_model(draft)
    second = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", draft_model=draft))
    revert_model(first)
    assert is_accelerated(draft)
    assert torch.equal(greedy(second, ids, mask, tiny.PAD, eos_token_id=None), want)
    assert speculative_stats(second) is not None
    revert_model(second)
    assert not is_accelerated(draft)
