"""``generate`` on a PagedCache equals stock transformers (DynamicCache, SDPA), on tiny random llama / qwen2 models
(float32, CPU).

Greedy left-padded batches on the cache the wrapper creates (transformers' loop and plain ``accelerate_model``;
the ``triton`` variants route the paged decode and the cache writes through the Triton kernels, interpreter, so
the kernels themselves run inside ``generate``), sampling with ``num_return_sequences``, beam search with an
explicitly passed PagedCache, and the cache ``generate`` returns: passed back for the next turn, and passed to a
stock model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from paged_cache_helpers import MAX_NEW, MODEL_TYPES, _tokens, accelerate

import hf_accel.cache.paged_cache as paged_cache_mod
import hf_accel.integrations.attention as hf_attn
from hf_accel.cache import PagedCache
from hf_accel.engine.call_options import output_cache
from hf_accel.integrations.generate import CACHE_KWARG, last_cache_stats
from hf_accel.kernels.paged_attention import paged_attention
from hf_accel.kernels.reshape_and_cache import reshape_and_cache


# --- accelerated generate (default PagedCache) vs stock ---------------------------------------------


def _route_to_triton(monkeypatch, calls):
    """CPU paged path -> Triton kernels (interpreter): paged attention and the cache writes."""

    def kernel(q, kc, vc, table, lens, max_len, key_mask=None, **kw):
        calls.append(q.shape)
        kw.pop("compute_dtype", None)
        return paged_attention(q, kc, vc, table, lens, max_len, key_mask, **kw)

    monkeypatch.setattr(hf_attn, "paged_attention_sdpa", kernel)
    monkeypatch.setattr(paged_cache_mod, "reshape_and_cache_ref", reshape_and_cache)


@pytest.mark.parametrize(
    "model_type,block_size,path",
    [("llama", 16, "reference"), ("llama", 4, "reference"), ("qwen2", 16, "reference"), ("qwen2", 4, "reference"),
     pytest.param("llama", 4, "triton", marks=pytest.mark.interpreter),
     pytest.param("qwen2", 16, "triton", marks=pytest.mark.interpreter)],
)
def test_generate_token_identical_left_padded(model_type, block_size, path, tiny, monkeypatch, one_thread):
    """transformers' generate loop on the PagedCache the wrapper creates."""
    model = tiny.model(model_type)
    ids, mask = tiny.batch(seed=1)  # lengths 11, 6, 3 -> left padded to 11
    stock = tiny.greedy(model, ids, mask, MAX_NEW)

    calls = []
    if path == "triton":
        _route_to_triton(monkeypatch, calls)
    else:
        ref = hf_attn.paged_attention_sdpa
        monkeypatch.setattr(hf_attn, "paged_attention_sdpa", lambda *a, **kw: calls.append(a[0].shape) or ref(*a, **kw))
    accelerate(model, block_size=block_size)
    ours = tiny.greedy(model, ids, mask, MAX_NEW)

    assert torch.equal(ours, stock), f"{model_type}: paged greedy tokens differ\n{stock}\n{ours}"
    # every decode step of every layer read the paged cache (the prefill runs the contiguous path)
    assert len(calls) == model.config.num_hidden_layers * (MAX_NEW - 1)
    stored = ids.shape[1] + MAX_NEW - 1
    stats = last_cache_stats(model)
    assert stats["tokens_stored"] == 3 * stored
    assert stats["blocks_allocated"] == 3 * -(-stored // block_size)
    assert paged_cache_mod._active.step is None  # no pool kept alive by the thread-local step


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_default_generate_token_identical_left_padded(model_type, block_size, tiny, one_thread):
    """Whatever path plain ``accelerate_model`` gives generate."""
    model = tiny.model(model_type, seed=1)
    ids, mask = tiny.batch(seed=1)
    stock = tiny.greedy(model, ids, mask, MAX_NEW)
    accelerate(model, "default", block_size=block_size)
    assert torch.equal(tiny.greedy(model, ids, mask, MAX_NEW), stock)
    assert last_cache_stats(model)["blocks_allocated"] > 0


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_generate_sampling_num_return_sequences(model_type, tiny, one_thread):
    """Rows expanded by num_return_sequences: same samples as stock for the same seed."""
    model = tiny.model(model_type, seed=3)
    ids, mask = tiny.batch(seed=2)
    kw = dict(do_sample=True, num_return_sequences=2, max_new_tokens=6, min_new_tokens=6, pad_token_id=tiny.PAD,
              top_k=0, top_p=1.0)
    with torch.no_grad():
        torch.manual_seed(0)
        stock = model.generate(input_ids=ids, attention_mask=mask, **kw)
        accelerate(model)
        torch.manual_seed(0)
        ours = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(ours, stock)
    assert last_cache_stats(model)["tokens_stored"] == 6 * (ids.shape[1] + 5)


# --- beam search with an explicitly passed PagedCache ---------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_beam_search_with_paged_cache_matches_stock(model_type, tiny, one_thread, hf_log):
    model = tiny.model(model_type, seed=15)
    ids, mask = tiny.batch(seed=15)
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False, pad_token_id=tiny.PAD,
              return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        stock = model.generate(input_ids=ids, attention_mask=mask, **kw)
    accelerate(model)
    cache = PagedCache(model.config, num_blocks=80, block_size=4)
    with torch.no_grad():
        ours = model.generate(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}, **kw)
    assert torch.equal(ours.sequences, stock.sequences)
    torch.testing.assert_close(ours.sequences_scores, stock.sequences_scores, rtol=1e-4, atol=1e-5)
    cache.manager.check()
    assert len(cache.seq_ids) == 9  # batch * num_beams rows
    # the log names the cache the loop writes: the caller's (it once said transformers' cache was kept)
    said = [r.getMessage() for r in hf_log.records if "beam search" in r.getMessage()]
    assert said == ["hf-accel: generate continues the caller's PagedCache in transformers' loop: beam search"]
    cache.release()  # the caller owns a cache it passed
    assert cache.memory_stats()["blocks_allocated"] == 0


# --- a cache generate returns, passed back for the next turn ---------------------------------------------


@pytest.mark.parametrize("loop", ["transformers", "fast"])
@pytest.mark.parametrize("lengths", [(9,), (11, 6, 3)])
def test_returned_cache_continues_the_next_turn_like_stock(loop, lengths, tiny, one_thread):
    """``return_dict_in_generate=True`` hands the caller the PagedCache filled (not released), as stock hands
    its DynamicCache; passing it back with the first turn's sequences plus new tokens continues from it (the
    pool, sized for the first call, grows) with stock's tokens, and equals a fresh call on the whole text."""
    stock = tiny.model("llama", seed=50)
    model = accelerate(copy.deepcopy(stock), loop=loop)
    ids, mask = tiny.batch(seed=51, lengths=lengths)
    kw = dict(do_sample=False, pad_token_id=tiny.PAD, return_dict_in_generate=True)
    turns = []
    for m in (stock, model):
        with torch.no_grad():
            first = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, **kw)
            cache = output_cache(first)
            assert cache is not None and cache.get_seq_length() == ids.shape[1] + 4
            more = _tokens(52, len(lengths), 7)
            ids2 = torch.cat([first.sequences, more], 1)
            mask2 = torch.cat([mask, torch.ones(ids2.shape[0], ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
            second = m.generate(input_ids=ids2, attention_mask=mask2, max_new_tokens=12, min_new_tokens=12,
                                **{CACHE_KWARG: cache}, **kw)
        turns.append((first, cache, second))
    (s1, _, s2), (o1, cache, o2) = turns
    assert isinstance(cache, PagedCache)
    assert torch.equal(o1.sequences, s1.sequences) and torch.equal(o2.sequences, s2.sequences)
    assert cache.get_seq_length() == o2.sequences.shape[1] - 1 and cache.manager.num_blocks > 0
    cache.manager.check()
    fresh = tiny.greedy(model, ids2, mask2, max_new_tokens=12)
    assert torch.equal(fresh, o2.sequences)


@pytest.mark.parametrize("loop", ["transformers", "fast"])
def test_returned_cache_layer_kv_equals_stock_layers(loop, tiny, one_thread):
    """``PagedCache.layer_kv`` gives each layer's K/V in transformers' layout: equal to the DynamicCache stock's
    generate returns (left-padded batch, every layer) at every position the attention mask does not hide; the
    pools themselves keep their own shape."""
    stock = tiny.model("llama", seed=70)
    model = accelerate(copy.deepcopy(stock), loop=loop)
    ids, mask = tiny.batch(seed=71)
    kw = dict(do_sample=False, pad_token_id=tiny.PAD, return_dict_in_generate=True, max_new_tokens=6,
              min_new_tokens=6)
    with torch.no_grad():
        a = stock.generate(input_ids=ids, attention_mask=mask, **kw)
        b = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(a.sequences, b.sequences)
    want, cache = output_cache(a), output_cache(b)
    assert isinstance(cache, PagedCache) and cache.layers[0].keys.shape[1:] == (cache.block_size, 2, 16)
    seen = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], 1).bool()  # positions no mask hides
    for i, layer in enumerate(want.layers):
        keys, values = cache.layer_kv(i)
        assert keys.shape == layer.keys.shape == (3, 2, ids.shape[1] + 5, 16)
        torch.testing.assert_close(keys.transpose(1, 2)[seen], layer.keys.transpose(1, 2)[seen], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values.transpose(1, 2)[seen], layer.values.transpose(1, 2)[seen], rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(IndexError, match="layer_idx 2 out of range: the cache has 2 layers"):
        cache.layer_kv(2)
    cache.release()
    assert cache.layer_kv(0) == (None, None)


def test_returned_cache_passed_to_a_stock_model(tiny, one_thread):
    """The cache an accelerated generate returns, passed to a stock copy of the model (another config, SDPA):
    its attention gets contiguous K/V (it cannot read the pools), and the tokens equal stock's own
    continuation of its own DynamicCache."""
    stock = tiny.model("llama", seed=67)
    model = accelerate(copy.deepcopy(stock))
    ids, mask = tiny.batch(seed=68)
    kw = dict(do_sample=False, pad_token_id=tiny.PAD, return_dict_in_generate=True, max_new_tokens=6,
              min_new_tokens=6)
    with torch.no_grad():
        a, b = stock.generate(input_ids=ids, attention_mask=mask, **kw), model.generate(input_ids=ids,
                                                                                          attention_mask=mask, **kw)
        assert torch.equal(a.sequences, b.sequences)
        ids2 = torch.cat([a.sequences, _tokens(69, 3, 4)], 1)
        mask2 = torch.cat([mask, torch.ones(3, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        want = stock.generate(input_ids=ids2, attention_mask=mask2, **{CACHE_KWARG: output_cache(a)}, **kw)
        got = stock.generate(input_ids=ids2, attention_mask=mask2, **{CACHE_KWARG: output_cache(b)}, **kw)
    assert isinstance(output_cache(b), PagedCache) and torch.equal(got.sequences, want.sequences)
