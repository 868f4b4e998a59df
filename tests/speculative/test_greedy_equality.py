"""Speculative ``generate`` (accelerate_model(model, speculative=...)) on CPU: greedy decoding.

Every proposer reproduces the model's own greedy tokens exactly in float32 (tiny random models with left-padded
batches and EOS in the middle, and the real SmolLM2), also at batch > 1 where rows accept different numbers of
drafts. Rollback: the K/V cache after speculative decoding equals the plain path's at every committed position.
Plain rounds between verify steps (what the adaptive draft length does when it backs off) keep greedy and the
draft's cache. Match-gated prompt lookup: greedy unchanged, its default (gated for one row), and the class counts
each round is chosen from. (The fused step's Triton kernels: test_fused_steps.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, _messages, greedy, repetitive_batch, spec_arg, truncated

from hf_accel import SpeculativeConfig, accelerate_model, revert_model, speculative_stats
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.kernels.commit_tokens import INFO_CLASS_COUNTS, NUM_CLASSES
from hf_accel.kernels.ngram_lookup import ngram_lookup_ref


METHODS = ["prompt_lookup", "early_exit", "draft_model", "draft_model-copy"]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_greedy_identical_to_plain(model_type, method, batch, adaptive, tiny):
    model = tiny.model(model_type, num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[:batch], mask[:batch]
    if batch == 1:
        ids, mask = ids[:, mask[0].argmax():], mask[:, mask[0].argmax():]
    stock = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    new = stock[:, ids.shape[1]:]
    # an EOS id the first row emits first in the middle (the other rows run on)
    eos = next(int(new[0, i]) for i in range(6, 19) if int(new[0, i]) not in new[0, :i].tolist())
    stock = greedy(model, ids, mask, tiny.PAD, eos_token_id=eos)
    ours = accelerate_model(copy.deepcopy(model), speculative=spec_arg(method, model, adaptive=adaptive,
                                                                       num_draft_tokens=3))
    out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=eos)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    stats = speculative_stats(ours)
    assert stats is not None and stats["method"] == method.split("-")[0]
    if not adaptive:
        assert stats["verify_steps"] > 0 and stats["backed_off_steps"] == 0
        if method != "prompt_lookup":
            assert stats["draft_tokens"] > 0
    if method == "draft_model-copy" and not adaptive:
        # the draft is the target itself: every draft is accepted, k + 1 = 4 tokens per verify step but in a
        # row's last one (cut by the budget or an EOS)
        assert stats["acceptance_rate"] == 1.0 and 3.0 <= stats["mean_tokens_per_step"] <= 4.0


# --- the cache after rollback -------------------------------------------------------------------------------------


def _capture_kv(monkeypatch):
    """Records, at each PagedCache.release, every layer's K/V over each row's reserved blocks, in logical order."""
    seen = []
    original = PagedCache.release

    def release(self):
        m = self.manager
        if m is not None and self.seq_ids:
            rows = []
            for s in self.seq_ids:
                table = torch.tensor(m.block_table(s))
                rows.append([(ly.keys[table].flatten(0, 1).clone(), ly.values[table].flatten(0, 1).clone())
                             for ly in self.layers])
            seen.append(rows)
        return original(self)

    monkeypatch.setattr(PagedCache, "release", release)
    return seen


@pytest.mark.parametrize("method", ["prompt_lookup", "prompt_lookup-gated", "early_exit"])
def test_rollback_leaves_the_cache_as_plain_decoding(method, tiny, monkeypatch, request):
    """``prompt_lookup-gated``: match-gated rounds verifying whenever a row matched, plain rounds between."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    new_tokens = 16
    seen = _capture_kv(monkeypatch)
    plain = accelerate_model(copy.deepcopy(model))
    out_plain = greedy(plain, ids, mask, tiny.PAD, max_new_tokens=new_tokens, eos_token_id=None)
    gated = method == "prompt_lookup-gated"
    if gated:
        request.getfixturevalue("verify_on_match")
        cfg = SpeculativeConfig("prompt_lookup", num_draft_tokens=4, match_gated=True)
    else:
        cfg = SpeculativeConfig(method, num_draft_tokens=4, adaptive=False)
    spec = accelerate_model(copy.deepcopy(model), speculative=cfg)
    out_spec = greedy(spec, ids, mask, tiny.PAD, max_new_tokens=new_tokens, eos_token_id=None)
    assert torch.equal(out_plain, out_spec)
    stats = speculative_stats(spec)
    assert stats["match_gated"] is gated
    assert stats["draft_tokens"] > stats["accepted_tokens"]  # drafts were rejected and rolled back
    kv_plain, kv_spec = seen[-2], seen[-1]
    cached = ids.shape[1] + new_tokens - 1  # every token but the last one went through the model
    for row in range(len(ids)):
        real = mask[row].bool().tolist() + [True] * (new_tokens - 1)  # padding slots hold no token
        keep = torch.tensor(real)
        for (k0, v0), (k1, v1) in zip(kv_plain[row], kv_spec[row]):
            torch.testing.assert_close(k1[:cached][keep], k0[:cached][keep], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v1[:cached][keep], v0[:cached][keep], rtol=1e-5, atol=1e-5)
    assert spec._hf_accel_engine.cache.manager.num_allocated_blocks == 0


# --- the real SmolLM2 ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", ["prompt_lookup", "prompt_lookup-gated", "early_exit", "draft_model"])
def test_smollm2_greedy_identical(method, smollm2, monkeypatch):
    model, tokenizer = smollm2
    from pydoc_data.topics import topics

    monkeypatch.setattr(tokenizer, "padding_side", "left")
    passage = topics["with"][:400]
    prompts = [f"Repeat this passage word for word:\n\n{passage}", "What is the capital of France?",
               "Rename the variable x to total and return the code:\n\ndef f(a):\n    x = 0\n    for v in a:\n"
               "        x += v\n    return x\n"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    # SmolLM2 was not trained for early exits: its first 8 layers' drafts are never accepted, 27 of 30 are
    # accepted ~20% of the time, enough to exercise acceptance
    draft = truncated(model, 27) if method == "draft_model" else None
    if method == "prompt_lookup-gated":  # adaptive: each round chosen from its own lookup's matches
        spec = SpeculativeConfig("prompt_lookup", num_draft_tokens=4, match_gated=True)
    else:
        spec = SpeculativeConfig(method, draft_model=draft, num_draft_tokens=4, adaptive=False,
                                 exit_layer=27 if method == "early_exit" else None)

    def accelerated_generate(enc, speculative=None):
        """(sequences, speculative stats) from the shared model accelerated for one call, then reverted."""
        accelerate_model(model, speculative=speculative)
        try:
            with torch.no_grad():
                return model.generate(**enc, **kwargs), speculative_stats(model)
        finally:
            revert_model(model)

    for batch in (1, 3):
        enc = tokenizer(texts[:batch], return_tensors="pt", padding=True)
        plain, _ = accelerated_generate(enc)
        out, stats = accelerated_generate(enc, spec)
        assert torch.equal(out, plain), "\n".join(tokenizer.batch_decode(torch.cat([plain, out])))
        assert stats["verify_steps"] > 0 and stats["accepted_tokens"] > 0, stats
        assert stats["match_gated"] is (method == "prompt_lookup-gated")


# --- plain rounds between verify steps (what the adaptive draft length does when it backs off) --------------------


@pytest.mark.parametrize("method", ["draft_model-copy", "early_exit", "prompt_lookup"])
def test_plain_rounds_keep_greedy_and_the_draft_cache(method, tiny, alternating_k):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=spec_arg(method, model, num_draft_tokens=3,
                                                                       exit_layer=LAYERS - 1 if method == "early_exit"
                                                                       else None))
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out, stock)
    stats = speculative_stats(ours)
    assert stats["backed_off_steps"] > 0 and stats["verify_steps"] > 0
    if method == "draft_model-copy":
        # the draft is the target: its cache stayed complete through the plain rounds, so it never errs
        assert stats["acceptance_rate"] == 1.0, stats


# --- match-gated prompt lookup ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("batch", [1, 3])
def test_match_gated_prompt_lookup_greedy_identical(batch, gated, tiny):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[:batch], mask[:batch]
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(
        "prompt_lookup", num_draft_tokens=4, match_gated=gated))
    for _ in range(2):  # the second call reuses the state and the measured round times
        out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
        assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
        assert speculative_stats(ours)["match_gated"] is gated


@pytest.mark.parametrize("match_gated", [None, True, False])
def test_match_gated_default_is_for_one_row(match_gated, tiny):
    """``match_gated=None`` (the default) gates one-row calls and not batches; True / False hold for both."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(
        "prompt_lookup", num_draft_tokens=3, match_gated=match_gated))
    for rows in (1, 3):
        out = greedy(ours, ids[:rows], mask[:rows], tiny.PAD, max_new_tokens=8, eos_token_id=None)
        assert torch.equal(out, greedy(model, ids[:rows], mask[:rows], tiny.PAD, max_new_tokens=8, eos_token_id=None))
        want = rows == 1 if match_gated is None else match_gated
        assert speculative_stats(ours)["match_gated"] is want, rows


def test_match_gated_rounds_see_the_class_counts_of_their_own_lookup(tiny, verify_on_match):
    """Every round is chosen from the counts of the lookup made for it: rows without any earlier occurrence
    of their last token are class 0, and a round whose rows all lack a match is plain."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=3,
                                                                               match_gated=True))
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out, stock)
    stats = speculative_stats(ours)
    assert verify_on_match and all(sum(c) <= len(ids) for c in verify_on_match)  # active rows only
    assert sum(c[0] for c in verify_on_match) > 0  # some rows had no match at some round
    assert stats["verify_steps"] == sum(1 for c in verify_on_match if any(c[1:]))
    assert stats["backed_off_steps"] == sum(1 for c in verify_on_match if not any(c[1:]))
    # the matched n of each row is the longest suffix n-gram (<= max_ngram = 3) seen earlier in the row
    assert all(len(c) == NUM_CLASSES and not any(c[4:]) for c in verify_on_match)
    # the state holds the lookup of the committed tokens as they are after the last round
    (engine,) = ours.__dict__["_hf_accel_spec_engines"].values()
    (st,) = engine.states.values()
    drafts, valid, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 3, 3, 1, with_ngram=True)
    assert torch.equal(st.drafts, drafts) and torch.equal(st.valid, valid) and torch.equal(st.ngram, ngram)
    counts = torch.zeros(NUM_CLASSES, dtype=torch.long).scatter_add_(0, ngram, st.active.long())
    assert st.info[INFO_CLASS_COUNTS: INFO_CLASS_COUNTS + NUM_CLASSES].tolist() == counts.tolist()


def test_match_gated_matches_longer_than_the_classes_share_the_last_class(tiny):
    """max_ngram 9 > NUM_CLASSES - 1: a 9-gram match is counted in the last class; greedy is unchanged."""
    from hf_accel.speculative.state import RoundState

    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=4,
                                                                               max_ngram=9, match_gated=True))
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=None), stock)
    (engine,) = ours.__dict__["_hf_accel_spec_engines"].values()
    st = RoundState(2, 32, "cpu", 4)
    st.reset(0)
    pattern = torch.randint(3, 50, (10,), generator=torch.Generator().manual_seed(0))
    st.tokens[0, :20] = pattern.repeat(2)  # row 0: its last 10 tokens also open it (a 9-gram match)
    st.tokens[1, :5] = torch.arange(60, 65)  # row 1: no token repeats
    st.lengths[:] = torch.tensor([20, 5])
    st.active[:] = True
    engine._lookup_next(st, {"kernels": False})
    assert st.ngram.tolist() == [NUM_CLASSES - 1, 0]
    counts = st.info[INFO_CLASS_COUNTS: INFO_CLASS_COUNTS + NUM_CLASSES].tolist()
    assert counts[0] == 1 and counts[NUM_CLASSES - 1] == 1 and sum(counts) == 2
    # the last 9 tokens (pattern[1:]) first occur at 1, followed by the second copy: pattern[0], pattern[1], ...
    assert st.valid[0].all() and st.drafts[0].tolist() == pattern[:4].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_speculative_decoding_is_logged(dtype, tiny, hf_log):
    """In bfloat16 the verify pass's logits round differently from one-token steps (near-ties can pick another
    token than plain greedy): logged once, naming the dtype; float32, where greedy is exact, logs nothing."""
    model = accelerate_model(tiny.model("llama", seed=80).to(dtype), speculative="prompt_lookup")
    ids, mask = repetitive_batch(tiny, lengths=(14,), seed=81)
    greedy(model, ids, mask, tiny.PAD, max_new_tokens=4)
    logged = _messages(hf_log, "round differently from one-token steps")
    assert len(logged) == (dtype == torch.bfloat16)
    if logged:
        assert logged[0].startswith("hf-accel: speculative decoding on a torch.bfloat16 model")
