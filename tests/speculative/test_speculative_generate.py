"""Speculative ``generate`` (accelerate_model(model, speculative=...)) on CPU.

Greedy: every proposer reproduces the model's own greedy tokens exactly in float32 (tiny random models with
left-padded batches and EOS in the middle, and the real SmolLM2), also at batch > 1 where rows accept
different numbers of drafts. Sampling: the tokens drawn through rejection sampling have the plain fast
path's distribution (chi-squared). Rollback: the K/V cache after speculative decoding equals the plain
path's at every committed position. Also: transformers' assisted-generation arguments take this path, and
bad options raise clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from stat_tests import homogeneity_p
from transformers.generation.streamers import BaseStreamer

import hf_accel
from hf_accel import SpeculativeConfig, accelerate_model, revert_model, speculative_stats
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.kernels.commit_tokens import INFO_CLASS_COUNTS, NUM_CLASSES
from hf_accel.kernels.ngram_lookup import ngram_lookup_ref
from hf_accel.speculative import draft_length
from hf_accel.speculative.draft_length import _PROBE_EVERY, _GatedChooser, _KChooser, slowest_rows

LAYERS = 4
P_MIN = 1e-3


def _messages(caplog, needle):
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def truncated(model, layers: int):
    """A draft model: a copy of ``model`` keeping its first ``layers`` decoder layers."""
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:layers])
    draft.config.num_hidden_layers = layers
    return draft


def spec_arg(method: str, model, **options):
    if method.startswith("draft_model"):
        layers = LAYERS if method == "draft_model-copy" else 1
        return SpeculativeConfig(method="draft_model", draft_model=truncated(model, layers), **options)
    return SpeculativeConfig(method=method, **options)


def repetitive_batch(tiny, lengths=(14, 9, 6), seed=0):
    """Left-padded prompts whose second half repeats the first (prompt lookup finds n-grams)."""
    ids, mask = tiny.batch(seed=seed, lengths=lengths)
    for row, n in enumerate(lengths):
        w = ids.shape[1]
        half = n // 2
        ids[row, w - half:] = ids[row, w - n: w - n + half]
    return ids, mask


def greedy(model, ids, mask, pad, max_new_tokens=20, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad, **kwargs)


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


@pytest.mark.interpreter
def test_fused_triton_step_greedy_identical(tiny):
    """The fused step's Triton kernels (interpreter) verifying q_len = k + 1 tokens per row."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=10, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("early_exit", num_draft_tokens=2,
                                                                               adaptive=False))
    ours._hf_accel_engine.fused = True
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=10, eos_token_id=None)
    assert ours._hf_accel_engine.steps and all(s.fused for s in ours._hf_accel_engine.steps.values())
    assert torch.equal(out, stock)
    assert speculative_stats(ours)["verify_steps"] > 0


# --- the cache after rollback -------------------------------------------------------------------------------


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


# --- sampling -----------------------------------------------------------------------------------------------

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


# --- transformers' assisted-generation arguments ---------------------------------------------------------------


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


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_streamer_gets_every_committed_token_once(tiny):
    """A model accelerated with speculative=: the call is a plain generate, so the streamer gets what transformers'
    plain loop gives it (one [1] tensor per token), also when a verify step commits several tokens. A call with
    transformers' assisted-generation arguments: [1, n] per verify step, as transformers' assisted loop puts them."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    stock = _Recorder()
    want = greedy(model, ids, mask, tiny.PAD, eos_token_id=None, streamer=stock)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", adaptive=False,
                                                                               draft_model=truncated(model, LAYERS)))
    rec = _Recorder()
    out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, streamer=rec)
    assert torch.equal(out, want) and speculative_stats(ours)["accepted_tokens"] > 0
    assert rec.ends == 1 and len(rec.puts) == len(stock.puts)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(rec.puts, stock.puts))

    assisted = accelerate_model(copy.deepcopy(model))
    rec = _Recorder()
    out = greedy(assisted, ids, mask, tiny.PAD, eos_token_id=None, streamer=rec, assistant_model=truncated(model, LAYERS))
    assert torch.equal(out, want) and rec.ends == 1 and torch.equal(rec.puts[0], ids)
    assert torch.cat([p.flatten() for p in rec.puts[1:]]).tolist() == out[0, ids.shape[1]:].tolist()
    assert all(p.dim() == 2 and p.shape[0] == 1 for p in rec.puts[1:])
    assert any(p.numel() > 1 for p in rec.puts[1:])  # several tokens per verify step


@pytest.mark.parametrize("method", ["draft_model", "early_exit"])
def test_streamer_gives_the_adaptive_draft_length_the_real_budget(method, tiny, monkeypatch):
    """With a streamer the engine asks the chooser for one round per host sync (``burst=False``) with the row's
    real token budget; it passed a budget of 1 token instead, which allows no drafts (k < budget), so with a
    streamer the draft model and early exit ran their first 16 rounds plain
    (test_k_chooser_with_a_streamer_drafts_as_without_one_one_round_per_sync: the choices then equal those
    without a streamer)."""
    asked = []
    original = _KChooser.choose

    def choose(self, max_remaining, burst=True):
        asked.append((max_remaining, burst))
        return original(self, max_remaining, burst)

    monkeypatch.setattr(_KChooser, "choose", choose)
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    config = (SpeculativeConfig("early_exit", exit_layer=2) if method == "early_exit"
              else SpeculativeConfig("draft_model", draft_model=truncated(model, 2)))
    ids, mask = repetitive_batch(tiny, lengths=(10,))
    ours = accelerate_model(copy.deepcopy(model), speculative=config)
    for streamer in (_Recorder(), None):
        asked.clear()
        greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, streamer=streamer, max_new_tokens=20)
        assert asked and asked[0] == (19, streamer is None), asked  # 20 new tokens, one from the prefill
        assert {b for _, b in asked} == {streamer is None}


def test_streamer_with_several_rows_takes_the_plain_fast_path(tiny, hf_log):
    """A verify step commits a different number of tokens per row, which a streamer ([batch] per put) cannot
    take: such calls decode without speculation (logged), and every put holds one token of each row."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", adaptive=False))
    rec = _Recorder()
    out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, streamer=rec)
    assert torch.equal(out, stock)
    assert speculative_stats(ours) is None
    assert _messages(hf_log, "speculative decoding not used: a streamer with more than one row")
    assert rec.ends == 1 and torch.equal(rec.puts[0], ids)
    assert all(p.shape == (ids.shape[0],) for p in rec.puts[1:])
    assert torch.equal(torch.stack(rec.puts[1:], 1), out[:, ids.shape[1]:])


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


@pytest.mark.parametrize("bad", [-2, 0])
def test_assistant_early_exit_below_one_raises(tiny, bad):
    """0 is not "no early exit": it raises naming the argument (it used to reach transformers' early-exit loop,
    which set the config's layer count to 0, so the call failed inside the cache and the model stayed broken),
    and the model is left as it was."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids[:1], mask[:1], tiny.PAD)
    ours = accelerate_model(copy.deepcopy(model))
    with pytest.raises(ValueError, match=f"assistant_early_exit must be a positive number of layers, got {bad}"):
        greedy(ours, ids[:1], mask[:1], tiny.PAD, assistant_early_exit=bad)
    assert ours.config.num_hidden_layers == LAYERS
    assert torch.equal(greedy(ours, ids[:1], mask[:1], tiny.PAD), stock)


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
    revert_model(ours)


def test_revert_removes_speculation(tiny):
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative="early_exit")
    greedy(ours, ids, mask, tiny.PAD)
    assert speculative_stats(ours) is not None
    revert_model(ours)
    assert speculative_stats(ours) is None and "_hf_accel_spec_engines" not in ours.__dict__
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD), greedy(model, ids, mask, tiny.PAD))


# --- bad input -------------------------------------------------------------------------------------------------


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
    with pytest.raises(TypeError, match="speculative must be"):
        accelerate_model(model, speculative=3)
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


# --- adaptive draft length ---------------------------------------------------------------------------------------


def test_k_chooser_backs_off_probes_and_recovers():
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.3)
    for _ in range(20):  # nothing is ever accepted; drafting costs time
        k, rounds = chooser.choose(100)
        chooser.update(k, [1] + [0] * k, seconds=1.0 + 0.3 * k)
    picks = [chooser.choose(100) for _ in range(12)]
    plain = [r for k, r in picks if k == 0]
    assert len(plain) >= 8 and set(plain) == {8}  # backed off: plain rounds in bursts of 8
    assert any(k > 0 for k, _ in picks)  # with probes
    assert chooser.choose(3) in ((0, 3), (2, 1), (1, 1))  # never past the budget
    for _ in range(40):  # everything is accepted again
        k, rounds = chooser.choose(100)
        chooser.update(k, [0] * k + [1], seconds=1.0 + 0.3 * k)
    assert chooser.choose(100) == (8, 1)


def test_k_chooser_with_a_streamer_drafts_as_without_one_one_round_per_sync():
    """A streamer takes one round per host sync (``burst=False``): the choices are those without it, plain bursts
    cut to single rounds. (The engine passed a budget of 1 token instead, which allowed no drafts: 16 plain
    rounds first with a streamer, for the draft model and early exit.)"""
    choosers = [_KChooser(k_max=8, adaptive=True, draft_cost=0.3) for _ in range(2)]
    picks = [[], []]
    for i in range(40):
        accepted = i < 20  # drafts pay, then nothing is accepted
        for chooser, burst, seen in zip(choosers, (True, False), picks):
            k, rounds = chooser.choose(100, burst=burst)
            seen.append((k, rounds))
            hist = [0] * k + [1] if accepted else [1] + [0] * k
            chooser.update(k, hist, seconds=1.0 + 0.3 * k)
    assert picks[1][0][0] > 0 and picks[1][:20] == picks[0][:20]  # drafting from the first round
    assert all(r == 1 for _, r in picks[1]) and any(k == 0 and r > 1 for k, r in picks[0])


def test_k_chooser_drafts_no_more_than_the_budget_can_take():
    """Every draft is accepted: k_max while the budget allows, the largest candidate below the tokens left
    near the end, a plain round with one token left (unless a probe is due, which bounds plain runs)."""
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.03)
    for _ in range(30):
        k, _ = chooser.choose(100)
        chooser.update(k, [0] * k + [1], seconds=1.0 + 0.01 * k)
    assert chooser.choose(100) == (8, 1)
    assert chooser.choose(9) == (8, 1)
    assert chooser.choose(8) == (4, 1)
    assert chooser.choose(2) == (1, 1)
    assert chooser.choose(1) == (0, 1)
    chooser.since_probe = chooser.max_plain_run
    assert chooser.choose(1) == (8, 1)  # the due probe


def test_k_chooser_sees_all_or_nothing_copies():
    """Half the rounds accept nothing, half accept all 16 drafts: the per-position hazard falls to 0 after
    the first draft, so the longest k wins although the mean acceptance rate is only ~50%."""
    chooser = _KChooser(k_max=16, adaptive=True, draft_cost=0.03)
    for i in range(40):
        k, _ = chooser.choose(100)
        chooser.update(k, ([1] + [0] * k) if i % 2 else ([0] * k + [1]), seconds=1.0 + 0.005 * k)
    assert chooser.choose(100) == (16, 1)
    assert chooser.expected_tokens(16) > 6 > 2 > chooser.expected_tokens(1)


def test_k_chooser_fixed_k():
    chooser = _KChooser(k_max=5, adaptive=False, draft_cost=0.3)
    chooser.update(5, [1, 0, 0, 0, 0, 0], seconds=10.0)
    assert chooser.choose(100) == (5, 1)


def test_slowest_rows():
    assert slowest_rows([3, 0, 2, 3], 0.5) == [3, 0, 1, 0]  # 8 rows: the 4 with the fewest accepted
    assert slowest_rows([0, 1, 0, 2], 0.5) == [0, 1, 0, 1]  # ceil(1.5) = 2 rows
    assert slowest_rows([0, 0, 1], 0.01) == [0, 0, 1]  # at least one row
    assert slowest_rows([2, 5, 1], 1.0) == [2, 5, 1]
    assert slowest_rows([0, 0, 0], 0.5) == [0, 0, 0]
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            slowest_rows([1, 1], bad)
    with pytest.raises(ValueError, match=">= 0"):
        slowest_rows([1, -1], 0.5)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_k_chooser_at_batch_8_weighs_the_slower_rows(fraction, monkeypatch):
    """Batch 8, verify rounds cost ~1.8 plain rounds (as bs8 on the H200): half the rows copy every draft, half
    accept none. Counting every row (fraction 1) the mean row accepts half of k and the chooser keeps drafting;
    counting the slower half (the default) it backs off, since the batch runs as long as those rows need."""
    monkeypatch.setattr(draft_length, "BATCH_ROWS_FRACTION", fraction)
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.1)
    picks = []
    for _ in range(60):
        k, rounds = chooser.choose(100)
        picks += [k] * rounds
        hist = [0] * (k + 1)
        hist[0] += 4
        hist[k] += 4
        chooser.update(k, hist, seconds=0.62e-3 if k == 0 else 1.1e-3)
    late = picks[-40:]  # rounds (a plain burst is several)
    if fraction == 1.0:
        assert all(k > 0 for k in late), late
    else:
        assert sum(k == 0 for k in late) >= 32, late  # backed off, with a probe now and then


# --- the real SmolLM2 ----------------------------------------------------------------------------------------------


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


# --- plain rounds between verify steps (what the adaptive draft length does when it backs off) -------------


@pytest.fixture
def alternating_k(monkeypatch):
    """The chooser alternates one verify step with k = 3 and a burst of three plain rounds."""
    calls = []

    def choose(self, max_remaining, burst=True):
        calls.append(len(calls))
        return (3, 1) if len(calls) % 2 else (0, 3)

    def choose_gated(self, counts, max_remaining=None, burst=True):  # match-gated prompt lookup: the same
        return choose(self, max_remaining)

    monkeypatch.setattr(_KChooser, "choose", choose)
    monkeypatch.setattr(_GatedChooser, "choose", choose_gated)
    return calls


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


# --- per-call assisted arguments ---------------------------------------------------------------------------------


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
    assert _messages(hf_log, f"assistant_early_exit={LAYERS} is not below the model's {LAYERS} layers")
    # past the last layer: refused before transformers' loop changes the model config for its draft
    with pytest.raises(ValueError, match=f"assistant_early_exit={LAYERS + 1} is more than the model's {LAYERS} layers"):
        greedy(ours, ids[:1], mask[:1], tiny.PAD, eos_token_id=None, assistant_early_exit=LAYERS + 1)
    assert ours.config.num_hidden_layers == LAYERS
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None, no_repeat_ngram_size=50),
                       greedy(model, ids, mask, tiny.PAD, eos_token_id=None, no_repeat_ngram_size=50))
    # prompt lookup from the model's own generation config takes hf-accel's path too
    ours.generation_config.prompt_lookup_num_tokens = 3
    assert torch.equal(greedy(ours, ids, mask, tiny.PAD, eos_token_id=None), stock)
    assert speculative_stats(ours)["method"] == "prompt_lookup"


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


def test_k_chooser_times_a_plain_round_and_backs_off_when_verify_costs_more():
    """A verify round costs 1.9 plain rounds whatever k (different kernels: batch-1 GEMVs vs a pass over
    k + 1 rows) and about 1.2 tokens come out of one: plain decoding is faster. The chooser must time a
    plain round instead of guessing its cost from the verify rounds, then back off."""
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.03)
    picks = []
    for _ in range(40):
        k, rounds = chooser.choose(100)
        picks += [k] * rounds
        hist = [0] * (k + 1)
        hist[min(k, 0 if len(picks) % 5 else 1)] = 1  # one draft accepted in a fifth of the rounds
        chooser.update(k, hist if k else [1], seconds=1.0 if k == 0 else 1.9 + 0.01 * k)
    assert 0 in chooser.times and chooser.times[0] == 1.0
    later = [chooser.choose(100) for _ in range(10)]
    assert sum(r for k, r in later if k == 0) > 4 * sum(1 for k, _ in later if k > 0), later


def test_k_chooser_scales_unmeasured_verify_rounds_from_verify_rounds():
    chooser = _KChooser(k_max=8, adaptive=True, draft_cost=0.1)
    chooser.times = {0: 1.0, 4: 2.8}
    assert chooser.time(8) == pytest.approx(2.8 * 1.8 / 1.4)  # from k=4, not from the plain round
    assert chooser.time(2) == pytest.approx(2.8 * 1.2 / 1.4)


# --- match-gated prompt lookup ---------------------------------------------------------------------------------


@pytest.fixture
def verify_on_match(monkeypatch):
    """The match-gated chooser verifies k_max drafts whenever a row matched, else runs a plain round; the
    class counts it was given are recorded."""
    seen = []

    def choose(self, counts, max_remaining=None, burst=True):
        seen.append(list(counts))
        return (self.k_max, 1) if any(counts[1:]) else (0, 1)

    monkeypatch.setattr(_GatedChooser, "choose", choose)
    return seen


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


def _counts(**by_class):
    c = [0] * NUM_CLASSES
    for name, v in by_class.items():
        c[int(name[1:])] = v
    return c


def _hists(k, **by_class):
    """Per-class histograms: ``c3=(v, rows)`` = rows of class 3 that accepted v drafts."""
    h = [[0] * (k + 1) for _ in range(NUM_CLASSES)]
    for name, (v, rows) in by_class.items():
        h[int(name[1:])][v] = rows
    return h


def test_gated_chooser_runs_plain_rounds_without_matches():
    """No row matched: plain rounds, in bursts that grow with the plain rounds in a row (1, 1, 1, 1, 2, 2, 3,
    ..., at most 8), one at a time without ``burst``, never past the budget; a round that drafts starts over."""
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    bursts = [chooser.choose(_counts(c0=5))[1] for _ in range(20)]
    assert bursts[:8] == [1, 1, 1, 1, 2, 2, 3, 3] and bursts[-3:] == [8, 8, 8], bursts
    assert chooser.choose(_counts(c0=5)) == (0, 8)
    assert chooser.choose(_counts(c0=1), burst=False) == (0, 1)
    assert chooser.choose(_counts(c0=1), max_remaining=3) == (0, 3)
    chooser.times = {0: 1.0, 1: 1.2, 2: 1.2, 4: 1.2, 8: 1.2}
    for _ in range(20):
        chooser.update(8, _hists(8, c3=(8, 1)), None)
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    assert chooser.choose(_counts(c0=1)) == (0, 1)


def test_gated_chooser_verifies_what_holds_and_skips_what_does_not():
    """3-gram matches are always copied in full, 1-gram matches never hold: the chooser verifies the first and
    runs plain rounds for the second, probing them once per _PROBE_EVERY plain rounds; a verify round costs
    1.7 plain rounds."""
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 8: 1.7, 4: 1.7, 2: 1.7, 1: 1.7}
    for _ in range(30):
        k, rounds = chooser.choose(_counts(c3=1))
        assert k > 0 and rounds == 1
        chooser.update(k, _hists(k, c3=(k, 1)), None)
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    probes, plain = [], 0  # plain rounds before each probe
    while plain < 3 * _PROBE_EVERY:
        k, rounds = chooser.choose(_counts(c1=1))
        if k:
            probes.append(plain)
        plain += rounds if k == 0 else 0
        chooser.update(k, _hists(k, c1=(0, 1)), None)
    gaps = [b - a for a, b in zip([0] + probes, probes)]
    assert 2 <= len(probes) <= 3 and all(_PROBE_EVERY <= g < _PROBE_EVERY + 8 for g in gaps), probes
    assert chooser.choose(_counts(c3=1)) == (8, 1)  # the 3-gram estimate is untouched by the 1-gram rounds


def test_gated_chooser_all_or_nothing_weighs_only_zero_and_k_max(monkeypatch):
    """Rows that accept 2 drafts: the adaptive chooser takes k = 2 where a round of 2 drafts is much cheaper
    than one of 8; with GATED_ALL_OR_NOTHING only 0 and k_max are weighed (and a shorter k where the budget
    is below k_max)."""
    from hf_accel.speculative import draft_length

    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 1: 1.1, 2: 1.1, 4: 1.3, 8: 1.8}
    for _ in range(30):
        chooser.update(8, _hists(8, c3=(2, 1)), None)
    assert chooser.choose(_counts(c3=1)) == (2, 1)
    monkeypatch.setattr(draft_length, "GATED_ALL_OR_NOTHING", True)
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    assert chooser.choose(_counts(c3=1), max_remaining=5) == (4, 1)


def test_gated_chooser_weighs_the_rows_of_a_batch():
    """At batch 4 a round verifies when enough rows matched well: one 3-gram row among three unmatched rows
    adds too little for a verify round that costs twice a plain one, three 3-gram rows add enough."""
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0}
    for _ in range(30):
        chooser.update(8, _hists(8, c3=(2, 1)), None)  # 3-gram rows accept 2 drafts
    assert chooser.expected_tokens(8, _counts(c3=1)) == pytest.approx(3.0, abs=0.2)
    assert chooser.choose(_counts(c0=3, c3=1))[0] == 0
    assert chooser.choose(_counts(c0=1, c3=3))[0] > 0


def test_gated_chooser_prepared_choices_equal_choices_made_on_arrival():
    """The decisions ``prepare`` makes ahead for each single-row class equal what ``choose`` decides from the
    counts themselves, over a random run of rounds (matches that hold or not, plain bursts, probes, budgets
    that run out, several rows, round times changing): two choosers fed the same rounds pick the same."""
    import random

    rng = random.Random(1)
    ahead, plain = _GatedChooser(k_max=15, draft_cost=0.03), _GatedChooser(k_max=15, draft_cost=0.03)
    picks, used = [], 0
    for i in range(600):
        rows = 1 if i % 7 else 3
        counts = [0] * NUM_CLASSES
        for _ in range(rows):
            counts[rng.choice([0, 0, 1, 1, 2, 3, 5, 7])] += 1
        budget = rng.choice([None, 100, 100, 20, 16, 15, 9, 3, 1])
        ahead.prepare(burst=i % 11 != 0)
        prepared = ahead._prepared
        got = ahead.choose(counts, budget, burst=i % 11 != 0)
        want = plain.choose(counts, budget, burst=i % 11 != 0)
        assert got == want, (i, counts, budget)
        used += ahead._prepared is prepared and rows == 1 and (budget is None or budget > 15)
        picks.append(got)
        k = got[0]
        if k:
            hists = [[0] * (k + 1) for _ in range(NUM_CLASSES)]
            for c, n in enumerate(counts):
                if n:
                    hists[c][min(k, rng.choice([0, 1, k, k]) if c > 1 else 0)] += n
            seconds = (0.6 + 0.01 * k) * 1e-3 * rng.uniform(0.9, 1.1)
        else:
            hists, seconds = [[0] for _ in range(NUM_CLASSES)], 0.5e-3 * rng.uniform(0.9, 1.1)
        for ch in (ahead, plain):
            ch.update(k, hists, seconds)
    assert {k for k, _ in picks} >= {0, 15} and any(r > 1 for _, r in picks), picks
    assert used > 200  # most choices at batch 1 with budget left came from the prepared table


def test_gated_chooser_times_a_plain_round_once_a_verify_round_is_timed():
    chooser = _GatedChooser(k_max=4, draft_cost=0.03)
    k, _ = chooser.choose(_counts(c3=1))
    assert k > 0
    chooser.update(k, _hists(k, c3=(k, 1)), seconds=1.8)
    assert chooser.choose(_counts(c3=1)) == (0, 1)  # to time it
    chooser.update(0, _hists(0, c3=(0, 1)), seconds=1.0)
    assert chooser.times == {k: 1.8, 0: 1.0}


@pytest.mark.interpreter
def test_match_gated_fused_triton_step_with_every_draft_length(tiny, monkeypatch):
    """The one-launch lookup and commit kernels (interpreter) under match gating: k cycles through every
    candidate below k_max (the drafts are column slices of the state's k_max-wide lookup), plain rounds
    between; greedy equals stock and the state ends holding the lookup of the final tokens."""
    picks = []

    def choose(self, counts, max_remaining=None, burst=True):
        matched = [k for k in picks if k >= 0]
        picks.append((1, 2, 4, 0)[len(matched) % 4] if any(counts[1:]) else -1)
        return max(picks[-1], 0), 1

    monkeypatch.setattr(_GatedChooser, "choose", choose)
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=4,
                                                                               match_gated=True))
    ours._hf_accel_engine.fused = True
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out, stock)
    assert {1, 2, 4} <= set(picks) and speculative_stats(ours)["match_gated"], picks
    (engine,) = ours.__dict__["_hf_accel_spec_engines"].values()
    (st,) = engine.states.values()
    drafts, valid, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 4, with_ngram=True)
    assert torch.equal(st.drafts, drafts) and torch.equal(st.valid, valid) and torch.equal(st.ngram, ngram)


def _batch1_fused_lookup_matches_stock(tiny, num_draft_tokens: int, max_new_tokens: int, lengths=(14, 9, 6),
                                       holder: dict | None = None):
    """Greedy prompt lookup on the first row of ``repetitive_batch`` with the fused step's Triton kernels
    (interpreter) must equal stock greedy (no EOS); returns the accelerated copy (also put in ``holder["model"]``
    before it generates)."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=lengths)
    ids, mask = ids[:1], mask[:1]
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=max_new_tokens, eos_token_id=None)
    config = SpeculativeConfig("prompt_lookup", num_draft_tokens=num_draft_tokens)
    ours = accelerate_model(copy.deepcopy(model), speculative=config)
    ours._hf_accel_engine.fused = True
    if holder is not None:
        holder["model"] = ours
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=max_new_tokens, eos_token_id=None)
    assert torch.equal(out, stock)
    return ours


@pytest.mark.interpreter
@pytest.mark.parametrize("counts_kernel", [True, False], ids=["counts-in-lookup", "counts-scatter"])
def test_match_gated_fused_triton_step_batch1_class_counts(counts_kernel, tiny, monkeypatch):
    """Batch 1 (interpreter): the lookup kernel writes the class counts itself (LOOKUP_CLASS_COUNTS_KERNEL) or the
    fill + scatter-add do; either way greedy equals stock, rounds draft, and the state's counts are the active
    row's class after the final lookup."""
    from hf_accel.speculative import engine as spec_engine

    monkeypatch.setattr(spec_engine, "LOOKUP_CLASS_COUNTS_KERNEL", counts_kernel)
    seen, holder = [], {}

    def choose(self, counts, max_remaining=None, burst=True):
        # the counts the host read = the active row's class in the state now (rounds run eagerly on CPU)
        (engine,) = holder["model"].__dict__["_hf_accel_spec_engines"].values()
        (st,) = engine.states.values()
        _, _, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 4, with_ngram=True)
        want = [0] * NUM_CLASSES
        want[min(int(ngram[0]), NUM_CLASSES - 1)] = int(st.active[0])
        seen.append((list(counts), want))
        # draft whenever the row matched (on CPU the timed chooser would back off)
        return (4 if any(counts[1:]) and (max_remaining is None or max_remaining > 4) else 0), 1

    monkeypatch.setattr(_GatedChooser, "choose", choose)
    calls = []
    lookup = spec_engine.ngram_lookup
    monkeypatch.setattr(spec_engine, "ngram_lookup", lambda *a, **k: calls.append(1) or lookup(*a, **k))
    ours = _batch1_fused_lookup_matches_stock(tiny, num_draft_tokens=4, max_new_tokens=12, holder=holder)
    stats = speculative_stats(ours)
    assert stats["match_gated"] and stats["verify_steps"] > 0, stats
    assert bool(calls) == counts_kernel
    assert len(seen) > 2 and all(got == want for got, want in seen), seen
    (engine,) = ours.__dict__["_hf_accel_spec_engines"].values()
    (st,) = engine.states.values()
    _, _, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 4, with_ngram=True)
    want = [0] * NUM_CLASSES
    want[min(int(ngram[0]), NUM_CLASSES - 1)] = int(st.active[0])
    assert st.info[INFO_CLASS_COUNTS: INFO_CLASS_COUNTS + NUM_CLASSES].tolist() == want
    assert torch.equal(st.ngram, ngram.clamp(max=NUM_CLASSES - 1))


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


def test_gated_chooser_drafts_no_more_than_the_budget_can_take():
    chooser = _GatedChooser(k_max=8, draft_cost=0.03)
    chooser.times = {0: 1.0, 1: 1.2, 2: 1.2, 4: 1.2, 8: 1.2}
    for _ in range(20):
        chooser.update(8, _hists(8, c3=(8, 1)), None)  # 3-gram matches are copied in full
    assert chooser.choose(_counts(c3=1)) == (8, 1)
    assert chooser.choose(_counts(c3=1), max_remaining=100) == (8, 1)
    assert chooser.choose(_counts(c3=1), max_remaining=5) == (4, 1)  # at most 4 drafts + the target's token
    assert chooser.choose(_counts(c3=1), max_remaining=1) == (0, 1)  # one token left: a plain step


@pytest.mark.parametrize("options", [{}, {"match_gated": False}, {"adaptive": False}],
                         ids=["gated", "ungated-bursts", "fixed-k"])
def test_counters_add_up_to_the_tokens_when_eos_ends_early(options, tiny, monkeypatch):
    """bs1, EOS in the middle of a 20-token budget: plain steps + verify steps x tokens per verify step + the
    prefill token = the new tokens, however many rounds the host queued past the end. The ungated chooser
    is made to run a verify round, then bursts of 8 plain rounds, so that a burst runs past the EOS."""
    if options.get("match_gated") is False:
        picks = []

        def choose(self, max_remaining, burst=True):
            picks.append(len(picks))
            return (3, 1) if len(picks) == 1 else (0, 8)

        monkeypatch.setattr(_KChooser, "choose", choose)
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[:1, mask[0].argmax():], mask[:1, mask[0].argmax():]
    new = greedy(model, ids, mask, tiny.PAD, eos_token_id=None)[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(new) if 4 <= i and t not in new[:i])
    n_new = new.index(eos) + 1
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=3,
                                                                               **options))
    for _ in range(2):
        out = greedy(ours, ids, mask, tiny.PAD, eos_token_id=eos)
        assert out[0, ids.shape[1]:].tolist() == new[:n_new]
        s = speculative_stats(ours)
        from_verify = s["mean_tokens_per_step"] * s["verify_steps"] if s["verify_steps"] else 0
        assert from_verify + s["backed_off_steps"] + 1 == pytest.approx(n_new), s
        assert sum(s["draft_lengths"].values()) == s["verify_steps"] + s["backed_off_steps"]
        assert s["round_ms"] and all(v > 0 for v in s["round_ms"].values()), s  # measured per k that ran
        assert set(s["draft_lengths"]) <= set(s["round_ms"]) | {"0"}, s


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


def test_stats_are_cleared_by_a_call_that_does_not_decode_speculatively(tiny, hf_log):
    """A call that takes transformers' loop (a repetition penalty, beams) or keeps transformers' cache
    (use_cache=False) reports None, not the counters of the speculative call before it."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup")
    for other in ({"repetition_penalty": 1.3}, {"num_beams": 2}, {"use_cache": False}):
        greedy(ours, ids[:1], mask[:1], tiny.PAD, max_new_tokens=6, eos_token_id=None)
        assert speculative_stats(ours) is not None
        greedy(ours, ids[:1], mask[:1], tiny.PAD, max_new_tokens=6, eos_token_id=None, **other)
        assert speculative_stats(ours) is None, other


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


def test_exit_layer_is_refused_with_other_methods():
    with pytest.raises(ValueError, match="exit_layer applies to method 'early_exit' only, not 'prompt_lookup'"):
        SpeculativeConfig("prompt_lookup", exit_layer=5)
    assert SpeculativeConfig("early_exit", exit_layer=5).exit_layer == 5


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


@pytest.mark.interpreter
def test_batch_verify_passes_of_more_than_32_rows_through_fused_linear(tiny, monkeypatch):
    """Batch 3 with 15 drafts: verify passes of 48 token rows run their matmuls through fused_linear's whole-K
    path in 16-row blocks when FUSED_LINEAR_MAX_ROWS allows (interpreter), and greedy equals stock."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 128)
    rows_seen = []
    linear = decode_step.fused_linear
    monkeypatch.setattr(decode_step, "fused_linear",
                        lambda x, w, **kw: rows_seen.append(x.shape[0]) or linear(x, w, **kw))
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=(14, 9, 6))
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=20, eos_token_id=None)
    config = SpeculativeConfig("prompt_lookup", num_draft_tokens=15, adaptive=False)
    ours = accelerate_model(copy.deepcopy(model), speculative=config)
    ours._hf_accel_engine.fused = True
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(out, stock)
    assert 48 in rows_seen, sorted(set(rows_seen))


@pytest.mark.interpreter
@pytest.mark.parametrize("whole_k_fits", [True, False])
def test_verify_passes_of_more_than_16_tokens_through_fused_linear(whole_k_fits, tiny, monkeypatch):
    """With FUSED_LINEAR_MAX_ROWS at 32, a batch-1 verify pass of k + 1 = 20 tokens runs its matmuls through
    fused_linear's whole-K path in two 16-row blocks (interpreter), and greedy equals stock. A model whose matmul
    inputs do not all fit the whole-K path (whole_k_fits made to refuse inputs wider than 16 here) keeps passes of
    more than FUSED_LINEAR_K_LOOP_MAX_ROWS rows on cuBLAS."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 32)
    if not whole_k_fits:
        monkeypatch.setattr(decode_step, "whole_k_fits", lambda k, *args: k <= 16)
    monkeypatch.setattr(_GatedChooser, "choose", lambda self, counts, max_remaining=None, burst=True:
                        (19 if any(counts[1:]) and (max_remaining is None or max_remaining > 19) else 0, 1))
    rows_seen = []
    linear = decode_step.fused_linear
    monkeypatch.setattr(decode_step, "fused_linear",
                        lambda x, w, **kw: rows_seen.append(x.shape[0]) or linear(x, w, **kw))
    ours = _batch1_fused_lookup_matches_stock(tiny, num_draft_tokens=19, max_new_tokens=30, lengths=(40, 9, 6))
    assert speculative_stats(ours)["draft_lengths"].get("19"), speculative_stats(ours)
    assert (20 in rows_seen) == whole_k_fits, sorted(set(rows_seen))
    if not whole_k_fits:  # the 20-row passes ran on cuBLAS; nothing above the K-loop limit reached fused_linear
        assert all(r <= step_switches.FUSED_LINEAR_K_LOOP_MAX_ROWS for r in rows_seen), sorted(set(rows_seen))


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
