"""Multi-turn calls on the fast decode path: ``return_dict_in_generate=True`` returns the K/V of the call in a
PagedCache, and passing it back with the next turn's input continues from it (only the new tokens are
prefilled), with stock transformers' tokens (float32 greedy) and the same cache contents as a fresh forward
over the whole text. Where the fast path cannot take the passed cache it says why and transformers' loop runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_accel import accelerate_model
from hf_accel.cache import OutOfBlocksError, PagedCache
from hf_accel.engine.fast_generate import FastEngine
from hf_accel.engine.call_options import output_cache

FAST_RUNS = "generate runs the fast decode path"


def _tokens(seed, batch, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, n), generator=g)


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts the calls that ran on FastEngine.generate."""
    calls = []
    original = FastEngine.generate

    def counting(self, gc, model_kwargs):
        calls.append(gc)
        return original(self, gc, model_kwargs)

    monkeypatch.setattr(FastEngine, "generate", counting)
    return calls


def _turns(model, cache_kwarg, ids, mask, pad, eos, new_per_turn=(7, 4), max_new=(6, 9, 5), cache=None, **kw):
    """Three turns: the first call (with ``cache`` if given), then each output's sequences plus new tokens
    with its returned cache. Returns the three outputs."""
    outs = []
    for turn, n_new in enumerate(max_new):
        call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, pad_token_id=pad,
                    eos_token_id=eos, return_dict_in_generate=True, **kw)
        if cache is not None:
            call[cache_kwarg] = cache
        with torch.no_grad():
            out = model.generate(**call)
        outs.append(out)
        cache = output_cache(out)
        if turn < len(new_per_turn):
            more = _tokens(70 + turn, ids.shape[0], new_per_turn[turn])
            grown = out.sequences.shape[1] - mask.shape[1]
            mask = torch.cat([mask, torch.ones(ids.shape[0], grown + more.shape[1], dtype=mask.dtype)], 1)
            ids = torch.cat([out.sequences, more], 1)
    return outs


def _first_turn(tiny, seed, fast_decode, max_new_tokens):
    """A one-row first turn on an accelerated copy of a tiny llama: ``(stock, model, greedy kwargs, the cache
    argument's name, the turn's output with its cache)``."""
    stock = tiny.model("llama", seed=seed)
    model = accelerate_model(copy.deepcopy(stock), fast_decode=fast_decode)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tiny.PAD, eos_token_id=None)
    with torch.no_grad():
        first = model.generate(input_ids=_tokens(seed + 1, 1, 8), return_dict_in_generate=True, **kw)
    return stock, model, kw, tiny.cache_kwarg(model), first


def _reference_kv(model, sequences, mask):
    """K/V [batch, kv_heads, len, head_dim] per layer of a fresh forward of a stock copy over ``sequences``
    (the positions transformers' loop leaves in its cache)."""
    stock = copy.deepcopy(model)
    from hf_accel import revert_model

    revert_model(stock)
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = stock(input_ids=sequences, attention_mask=mask, position_ids=position_ids, use_cache=True)
    cache = output_cache(out)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _paged_kv(cache: PagedCache, layer: int, length: int):
    """K/V [batch, kv_heads, length, head_dim] of every row of a PagedCache, read through its block tables."""
    rows = []
    pools = cache.layers[layer]
    for s in cache.seq_ids:
        table = torch.tensor(cache.manager.block_table(s))
        pos = torch.arange(length)
        slots = table[pos // cache.block_size] * cache.block_size + pos % cache.block_size
        k = pools.keys.reshape(-1, *pools.keys.shape[2:])[slots]
        v = pools.values.reshape(-1, *pools.values.shape[2:])[slots]
        rows.append((k.transpose(0, 1), v.transpose(0, 1)))
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("lengths", [(9,), (11, 6, 3)])
def test_turns_on_the_fast_path_equal_stock(model_type, lengths, tiny, fast_calls):
    """Three turns, each passing the last output's cache back: every call runs the fast path, the tokens equal
    stock's (its DynamicCache, same calls), the returned cache is the one passed in (grown in place, as stock's)
    and holds every token but the last. EOS ids taken from stock's output end rows of the batch early, so the
    cache also holds the padding a finished row was fed."""
    stock = tiny.model(model_type, seed=80)
    ids, mask = tiny.batch(seed=81, lengths=lengths)
    first = tiny.greedy(stock, ids, mask, 6)[:, ids.shape[1]:]
    eos = [int(first[0, 3])]  # row 0 ends after 4 new tokens in turn one (other rows maybe later or never)
    want = _turns(stock, tiny.cache_kwarg(stock), ids, mask, tiny.PAD, eos)
    model = accelerate_model(copy.deepcopy(stock))
    got = _turns(model, tiny.cache_kwarg(model), ids, mask, tiny.PAD, eos)
    assert len(fast_calls) == 3
    for a, b in zip(want, got):
        assert torch.equal(a.sequences, b.sequences), f"\nstock:\n{a.sequences}\nours:\n{b.sequences}"
        assert isinstance(output_cache(b), PagedCache)
    assert output_cache(got[2]).get_seq_length() == got[2].sequences.shape[1] - 1  # one object: the last length
    assert output_cache(want[2]).get_seq_length() == want[2].sequences.shape[1] - 1
    assert output_cache(got[1]) is output_cache(got[0]) is output_cache(got[2])
    output_cache(got[2]).manager.check()


def test_returned_cache_holds_the_kv_of_a_fresh_forward(tiny, fast_calls):
    """The K/V a multi-turn call leaves in its PagedCache equal those of one stock forward over the returned
    sequences (all but the last token), at the positions the mask keeps."""
    stock = tiny.model("llama", seed=82)
    ids, mask = tiny.batch(seed=83)
    model = accelerate_model(copy.deepcopy(stock))
    outs = _turns(model, tiny.cache_kwarg(model), ids, mask, tiny.PAD, eos=None, max_new=(5, 4))
    assert len(fast_calls) == 2
    seq = outs[-1].sequences
    full_mask = torch.cat([mask, torch.ones(3, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    length = seq.shape[1] - 1
    ref = _reference_kv(model, seq[:, :-1], full_mask[:, :-1])
    cache = output_cache(outs[-1])
    keep = full_mask[:, None, :length, None].bool()
    for layer, (k_ref, v_ref) in enumerate(ref):
        k, v = _paged_kv(cache, layer, length)
        torch.testing.assert_close(k * keep, k_ref * keep, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v * keep, v_ref * keep, rtol=1e-4, atol=1e-5)


@pytest.mark.interpreter
def test_fused_step_continues_a_passed_cache(tiny, fast_calls):
    """The fused Triton step (interpreter on CPU) prefills only the new tokens after the copied prefix: two
    turns equal stock's."""
    stock = tiny.model("llama", seed=84)
    ids, mask = tiny.batch(seed=85, lengths=(7, 4))
    want = _turns(stock, tiny.cache_kwarg(stock), ids, mask, tiny.PAD, eos=None, new_per_turn=(5,), max_new=(4, 4))
    model = accelerate_model(copy.deepcopy(stock))
    model._hf_accel_engine.fused = True
    got = _turns(model, tiny.cache_kwarg(model), ids, mask, tiny.PAD, eos=None, new_per_turn=(5,), max_new=(4, 4))
    assert len(fast_calls) == 2
    for a, b in zip(want, got):
        assert torch.equal(a.sequences, b.sequences)


def test_an_empty_paged_cache_passed_in_is_filled(tiny, fast_calls):
    """A new PagedCache passed to the first call (as a DynamicCache would be) is filled by the fast path, and
    with return_dict_in_generate=False too (stock fills a passed cache either way)."""
    stock = tiny.model("llama", seed=86)
    ids, mask = tiny.batch(seed=87)
    model = accelerate_model(copy.deepcopy(stock))
    want = tiny.greedy(stock, ids, mask, 5)
    for as_dict in (True, False):
        cache = PagedCache(model.config, num_blocks=40, block_size=4)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5,
                                 do_sample=False, pad_token_id=tiny.PAD, return_dict_in_generate=as_dict,
                                 **{tiny.cache_kwarg(model): cache})
        sequences = out.sequences if as_dict else out
        assert torch.equal(sequences, want)
        assert cache.get_seq_length() == want.shape[1] - 1 and len(cache.seq_ids) == 3
        cache.manager.check()
    assert len(fast_calls) == 2


def test_sampling_turns_keep_the_cache_consistent(tiny, fast_calls):
    """Sampled turns (top-k / top-p) on the fast path: the returned cache holds the K/V of a fresh forward
    over the sampled sequences, so the next turn continues the text that was returned."""
    stock = tiny.model("qwen3", seed=88)
    ids, mask = tiny.batch(seed=89)
    model = accelerate_model(copy.deepcopy(stock))
    torch.manual_seed(0)
    outs = _turns(model, tiny.cache_kwarg(model), ids, mask, tiny.PAD, eos=None, max_new=(5, 6),
                  top_k=20, top_p=0.9, temperature=1.3)
    assert len(fast_calls) == 2
    seq = outs[-1].sequences
    full_mask = torch.cat([mask, torch.ones(3, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    ref = _reference_kv(model, seq[:, :-1], full_mask[:, :-1])
    keep = full_mask[:, None, : seq.shape[1] - 1, None].bool()
    for layer, (k_ref, _) in enumerate(ref):
        k, _ = _paged_kv(output_cache(outs[-1]), layer, seq.shape[1] - 1)
        torch.testing.assert_close(k * keep, k_ref * keep, rtol=1e-4, atol=1e-5)


def test_caches_the_fast_path_cannot_take_fall_back_with_the_reason(tiny, hf_log, fast_calls):
    """A PagedCache of another batch size raises at once (no path can run it); one too small and not growable, and
    return_dict_in_generate with output_scores: the fast path says why, and transformers' loop runs with the
    caller's cache (which raises its own error where the cache cannot serve the call)."""
    stock = tiny.model("llama", seed=90)
    ids, mask = tiny.batch(seed=91)
    model = accelerate_model(copy.deepcopy(stock))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=tiny.PAD)
    name = tiny.cache_kwarg(model)
    with torch.no_grad():
        first = model.generate(**kw, return_dict_in_generate=True)
        one_row = model.generate(**dict(kw, input_ids=ids[:1], attention_mask=mask[:1]), return_dict_in_generate=True)
    assert len(fast_calls) == 2
    ids2 = torch.cat([first.sequences, _tokens(92, 3, 3)], 1)
    mask2 = torch.ones_like(ids2)
    mask2[:, : mask.shape[1]] = mask
    with pytest.raises(ValueError, match="holds 1 sequences but the batch has 3 rows"), torch.no_grad():
        model.generate(**dict(kw, input_ids=ids2, attention_mask=mask2), **{name: output_cache(one_row)})
    assert not any("fast decode path not used" in r.getMessage() for r in hf_log.records)
    small = PagedCache(model.config, num_blocks=3, block_size=4)
    with pytest.raises(OutOfBlocksError, match="out of blocks"), torch.no_grad():
        model.generate(**kw, **{name: small})
    assert any("not growable) has 3 free blocks" in r.getMessage() for r in hf_log.records)
    with torch.no_grad():
        scored = model.generate(**dict(kw, input_ids=ids2, attention_mask=mask2), **{name: output_cache(first)},
                                return_dict_in_generate=True, output_scores=True)
        want = stock.generate(**dict(kw, input_ids=ids2, attention_mask=mask2), return_dict_in_generate=True,
                              output_scores=True)
    assert len(fast_calls) == 2
    assert torch.equal(scored.sequences, want.sequences) and len(scored.scores) == 5
    assert output_cache(scored) is output_cache(first)


@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast-path", "transformers-loop"])
@pytest.mark.parametrize("extra", [0, -3], ids=["same-length", "shorter-prompt"])
def test_a_passed_cache_as_long_as_the_input_is_refused(fast_decode, extra, tiny):
    """input_ids no longer than what the passed PagedCache holds (the new prompt alone, or the last turn's
    sequences with nothing new): a ValueError saying what input_ids must hold. Transformers' loop failed on the empty
    slice with a reshape error; the cache is left as it was and continues the right call."""
    stock = tiny.model("llama", seed=95)
    ids, mask = tiny.batch(seed=96)
    model = accelerate_model(copy.deepcopy(stock), fast_decode=fast_decode)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=tiny.PAD)
    name = tiny.cache_kwarg(model)
    with torch.no_grad():
        first = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    cache = output_cache(first)
    held = cache.get_seq_length()
    short = first.sequences[:, : held + extra]
    with pytest.raises(ValueError, match=f"holds {held} tokens and input_ids has {held + extra}"), torch.no_grad():
        model.generate(input_ids=short, attention_mask=torch.ones_like(short), **{name: cache}, **kw)
    assert cache.get_seq_length() == held
    ids2 = torch.cat([first.sequences, _tokens(97, 3, 2)], 1)
    mask2 = torch.ones_like(ids2)
    mask2[:, : mask.shape[1]] = mask
    with torch.no_grad():
        got = model.generate(input_ids=ids2, attention_mask=mask2, **{name: cache}, **kw)
        want = stock.generate(input_ids=ids2, attention_mask=mask2, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast-path", "transformers-loop"])
def test_an_interrupted_turn_leaves_the_passed_cache_as_it_was(fast_decode, tiny):
    """A streamer that raises (KeyboardInterrupt) in the middle of a turn continuing a passed PagedCache: the cache
    holds what it held before the turn, on transformers' loop as on the fast path (the loop used to leave the
    interrupted turn's K/V in it, and the next turn's tokens were silently wrong), and the next turn equals stock."""
    from transformers.generation.streamers import BaseStreamer

    class Interrupt(BaseStreamer):
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 4:
                raise KeyboardInterrupt

        def end(self):
            pass

    stock, model, kw, name, first = _first_turn(tiny, 98, fast_decode, 5)
    cache = output_cache(first)
    held = cache.get_seq_length()
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model.generate(input_ids=torch.cat([first.sequences, _tokens(100, 1, 3)], 1), streamer=Interrupt(),
                       **{name: cache}, **kw)
    assert cache.get_seq_length() == held
    assert {layer.length for layer in cache.layers} == {held}
    ids3 = torch.cat([first.sequences, _tokens(101, 1, 9)], 1)
    with torch.no_grad():
        got = model.generate(input_ids=ids3, **{name: cache}, **kw)
        want = stock.generate(input_ids=ids3, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast-path", "transformers-loop"])
def test_only_the_new_tokens_with_the_whole_mask_continue_the_cache(fast_decode, tiny):
    """transformers' other continuation form: input_ids holds only the new tokens and attention_mask the whole
    conversation. It continues a passed PagedCache as stock continues its DynamicCache (it was refused by the
    length check meant for input_ids holding the whole conversation)."""
    stock, model, kw, name, first = _first_turn(tiny, 102, fast_decode, 4)
    with torch.no_grad():
        stock_first = stock.generate(input_ids=_tokens(103, 1, 8), return_dict_in_generate=True, **kw)
    cache, stock_cache = output_cache(first), output_cache(stock_first)
    held = cache.get_seq_length()
    full = torch.cat([first.sequences, _tokens(104, 1, 3)], 1)
    with torch.no_grad():
        got = model.generate(input_ids=full[:, held:], attention_mask=torch.ones_like(full), **{name: cache}, **kw)
        want = stock.generate(input_ids=full[:, held:], attention_mask=torch.ones_like(full),
                              **{name: stock_cache}, **kw)
    assert torch.equal(got, want)


def test_a_dynamic_cache_still_runs_transformers_loop(tiny, hf_log, fast_calls):
    stock = tiny.model("llama", seed=93)
    ids, mask = tiny.batch(seed=94)
    model = accelerate_model(copy.deepcopy(stock))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=tiny.PAD, **{tiny.cache_kwarg(model): DynamicCache(config=model.config)})
    assert not fast_calls and torch.equal(out, tiny.greedy(stock, ids, mask, 4)[:, : out.shape[1]])


def test_speculative_model_runs_multi_turn_batches_on_the_plain_fast_path(tiny, hf_log, fast_calls):
    """A model accelerated with prompt lookup: a batch call returning its cache decodes on the plain fast path
    (logged), with stock's tokens."""
    stock = tiny.model("llama", seed=95)
    ids, mask = tiny.batch(seed=96)
    model = accelerate_model(copy.deepcopy(stock), speculative="prompt_lookup")
    want = _turns(stock, tiny.cache_kwarg(stock), ids, mask, tiny.PAD, eos=None, new_per_turn=(4,), max_new=(5, 5))
    got = _turns(model, tiny.cache_kwarg(model), ids, mask, tiny.PAD, eos=None, new_per_turn=(4,), max_new=(5, 5))
    assert len(fast_calls) == 2
    for a, b in zip(want, got):
        assert torch.equal(a.sequences, b.sequences)
    assert any("speculative decoding not used: a passed cache or return_dict_in_generate with more than one row"
               in r.getMessage() for r in hf_log.records)


@pytest.mark.parametrize("loop", ["fast", "transformers"])
def test_a_cache_filled_under_inference_mode_continues_outside_it(loop, tiny):
    """A cache filled inside ``torch.inference_mode`` (the fast path's own, or the caller's) holds inference
    tensors, which refuse in-place writes outside it: a next turn that runs transformers' loop (output_scores
    here) outside inference mode, with free blocks left in the cache, gets stock's tokens and scores."""
    stock = tiny.model("llama", seed=97)
    model = accelerate_model(copy.deepcopy(stock), fast_decode=loop == "fast")
    ids = _tokens(98, 1, 6)
    name = tiny.cache_kwarg(model)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, pad_token_id=tiny.PAD)
    with torch.inference_mode():
        first = model.generate(ids, **kw, **{name: PagedCache(model.config, num_blocks=64, block_size=4)})
    with torch.no_grad():
        want1 = stock.generate(ids, **kw)
        ids2 = torch.cat([want1.sequences, _tokens(99, 1, 3)], 1)
        want = stock.generate(ids2, output_scores=True, **kw, **{name: output_cache(want1)})
        got = model.generate(ids2, output_scores=True, **kw, **{name: output_cache(first)})
    assert torch.equal(first.sequences, want1.sequences) and torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_fast_path_returns_ordinary_tensors(tiny):
    """The pools of a cache the fast path returns (it runs under inference mode) are not inference tensors."""
    model = accelerate_model(tiny.model("llama", seed=100))
    with torch.no_grad():
        out = model.generate(_tokens(101, 2, 5), max_new_tokens=4, do_sample=False, pad_token_id=tiny.PAD,
                             return_dict_in_generate=True)
    assert not any(layer.keys.is_inference() or layer.values.is_inference() for layer in output_cache(out).layers)


@pytest.mark.parametrize("method", ["prompt_lookup", "early_exit"])
def test_speculative_turns_at_batch_1_equal_stock(method, tiny, fast_calls, monkeypatch):
    """Batch 1 multi-turn calls decode speculatively: stock's tokens over three turns (prompts that repeat, so
    drafts are accepted), and the returned cache holds the K/V of a fresh forward over the returned sequences
    (the rejected drafts' K/V lie past the last committed token)."""
    import hf_accel
    from hf_accel.speculative import SpeculativeConfig
    from hf_accel.speculative.engine import SpeculativeEngine

    spec_calls = []
    original = SpeculativeEngine.generate
    monkeypatch.setattr(SpeculativeEngine, "generate",
                        lambda self, gc, kw, **options: spec_calls.append(1) or original(self, gc, kw, **options))

    stock = tiny.model("llama", seed=102, num_hidden_layers=3)
    pattern = _tokens(103, 1, 6)
    ids = pattern.repeat(1, 4)
    mask = torch.ones_like(ids)
    config = SpeculativeConfig(method, num_draft_tokens=4, adaptive=False,
                               **({"exit_layer": 2} if method == "early_exit" else {}))
    model = accelerate_model(copy.deepcopy(stock), speculative=config)
    kw = dict(new_per_turn=(6, 6), max_new=(10, 10, 8))
    want = _turns(stock, tiny.cache_kwarg(stock), ids, mask, tiny.PAD, eos=None, **kw)
    got = _turns(model, tiny.cache_kwarg(model), ids, mask, tiny.PAD, eos=None, **kw)
    assert len(spec_calls) == 3 and not fast_calls and hf_accel.speculative_stats(model)["verify_steps"] > 0
    for a, b in zip(want, got):
        assert torch.equal(a.sequences, b.sequences)
    seq = got[-1].sequences
    length = seq.shape[1] - 1
    cache = output_cache(got[-1])
    assert cache.get_seq_length() == length and output_cache(got[0]) is cache
    ref = _reference_kv(model, seq[:, :-1], torch.ones_like(seq[:, :-1]))
    for layer, (k_ref, v_ref) in enumerate(ref):
        k, v = _paged_kv(cache, layer, length)
        torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast-path", "transformers-loop"])
def test_a_cache_grown_by_another_branch_is_refused_and_a_copy_per_branch_matches_stock(fast_decode, tiny):
    """One returned cache passed to two continuations: branch A grows it, and branch B (a longer input than what A
    left) used to continue from A's K/V without an error (stock's DynamicCache does the same). The cache records
    the tokens it holds (``token_ids``), so B is refused, naming the first position that differs; a deepcopy per
    branch gives each branch stock's tokens."""
    stock = tiny.model("llama", seed=101)
    ids, mask = tiny.batch(seed=102)
    model = accelerate_model(copy.deepcopy(stock), fast_decode=fast_decode)
    kw = dict(do_sample=False, pad_token_id=tiny.PAD)
    name = tiny.cache_kwarg(model)
    with torch.no_grad():
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True,
                               **kw)
    cache = output_cache(first)
    assert torch.equal(cache.token_ids, first.sequences[:, :-1])
    spare = copy.deepcopy(cache)
    grown = mask.shape[1]

    def branch(seed, n_new):
        more = _tokens(seed, ids.shape[0], n_new)
        ids2 = torch.cat([first.sequences, more], 1)
        mask2 = torch.ones_like(ids2)
        mask2[:, :grown] = mask
        return ids2, mask2

    ids_a, mask_a = branch(103, 2)
    ids_b, mask_b = branch(104, 12)  # longer than what branch A leaves in the cache
    with torch.no_grad():
        a = model.generate(input_ids=ids_a, attention_mask=mask_a, max_new_tokens=4, **{name: cache}, **kw)
        assert cache.get_seq_length() == a.shape[1] - 1 < ids_b.shape[1]
        pos = int((ids_a[0] != ids_b[0, : ids_a.shape[1]]).nonzero()[0])  # the first token where the branches differ
        assert pos >= first.sequences.shape[1]
        with pytest.raises(ValueError, match=f"row 0, position {pos} is token {int(ids_a[0, pos])} in the cache and "
                                             f"{int(ids_b[0, pos])} in input_ids.*copy.deepcopy"):
            model.generate(input_ids=ids_b, attention_mask=mask_b, max_new_tokens=4, **{name: cache}, **kw)
        b = model.generate(input_ids=ids_b, attention_mask=mask_b, max_new_tokens=4, **{name: spare}, **kw)
        want_a = stock.generate(input_ids=ids_a, attention_mask=mask_a, max_new_tokens=4, **kw)
        want_b = stock.generate(input_ids=ids_b, attention_mask=mask_b, max_new_tokens=4, **kw)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)


@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast-path", "transformers-loop"])
def test_token_record_follows_crop_and_row_selection(fast_decode, tiny):
    """``crop`` and ``batch_select_indices`` keep ``token_ids`` in step with the cache: a continuation after them is
    accepted and equals stock; a padding token the mask hides may differ."""
    stock = tiny.model("llama", seed=105)
    ids, mask = tiny.batch(seed=106)
    model = accelerate_model(copy.deepcopy(stock), fast_decode=fast_decode)
    kw = dict(do_sample=False, pad_token_id=tiny.PAD, max_new_tokens=3)
    name = tiny.cache_kwarg(model)
    with torch.no_grad():
        first = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    cache = output_cache(first)
    cache.crop(-2)
    cache.batch_select_indices(torch.tensor([2, 0]))
    kept = first.sequences[[2, 0], : cache.get_seq_length()]
    assert torch.equal(cache.token_ids, kept)
    ids2 = torch.cat([kept, _tokens(107, 2, 3)], 1)
    mask2 = torch.ones_like(ids2)
    mask2[:, : mask.shape[1]] = mask[[2, 0]]
    ids2[0, 0] = 5  # row 2's first position is padding (masked): not compared
    assert mask2[0, 0] == 0
    with torch.no_grad():
        got = model.generate(input_ids=ids2, attention_mask=mask2, **{name: cache}, **kw)
        want = stock.generate(input_ids=ids2, attention_mask=mask2, **kw)
    assert torch.equal(got, want)
    cache.release()
    assert cache.token_ids is None
