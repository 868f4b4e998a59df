"""PagedCache ``update`` and the attention implementations that read it (tiny random models, float32, CPU).

Forward steps are driven by hand with a PagedCache passed as the cache argument (``cache`` in transformers >=
5.2x, ``past_key_values`` before: :data:`CACHE_KWARG`). ``update`` returns the new K/V on the first forward and
then the pools with mask sizes that match; a chunked prefill equals a one-shot one; the eager fallback
(``output_attentions``) on a paged step matches stock; under an attention implementation that cannot read the
pools (SDPA, a never-accelerated or reverted model) ``update`` gives contiguous K/V; an update of a layer the
config lacks raises.
"""

from __future__ import annotations

import copy

import pytest
import torch
from paged_cache_helpers import MAX_NEW, MODEL_TYPES, Stepper, _positions, _tokens, accelerate

import hf_accel.cache.paged_cache as paged_cache_mod
import hf_accel.integrations.attention as hf_attn
from hf_accel.cache import PagedCache
from hf_accel.integrations.generate import CACHE_KWARG


# --- update / mask sizes / chunked prefill ---------------------------------------------------------


def test_update_returns_new_kv_then_pools_with_matching_mask_sizes(tiny):
    config = tiny.config("llama")
    config._attn_implementation = hf_attn.register()  # what accelerate_model selects
    cache = PagedCache(config, num_blocks=10, block_size=4)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    assert cache.get_mask_sizes(5, 0) == (5, 0)
    keys, values = cache.update(k, v, 0)
    assert keys is k and values is v  # first forward: the new K/V themselves (contiguous prefill)
    assert paged_cache_mod.active_step(keys) is None
    cache.update(k, v, 1)
    assert cache.get_seq_length() == 5
    k1, v1 = torch.randn(2, 2, 2, 16, generator=g), torch.randn(2, 2, 2, 16, generator=g)
    kv_length, kv_offset = cache.get_mask_sizes(2, 0)
    assert (kv_length, kv_offset) == (7, 0)
    pool_k, pool_v = cache.update(k1, v1, 0)
    assert pool_k is cache.layers[0].keys and pool_v is cache.layers[0].values
    step = paged_cache_mod.active_step(pool_k)
    assert step is not None and step.max_seq_len == kv_length and step.q_len == 2
    assert step.seq_lens.tolist() == [7, 7] and step.slot_mapping.numel() == 2 * 2
    keys, values = step.gather()
    torch.testing.assert_close(keys, torch.cat([k, k1], 2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v, v1], 2), rtol=0, atol=0)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_chunked_prefill_matches_one_shot(model_type, tiny):
    """Prefill in two chunks (the second on the paged path with q_len > 1) = one-shot prefill. Row 2's
    first chunk is all padding (fully masked queries)."""
    model = accelerate(tiny.model(model_type, seed=20))
    ids, mask = tiny.batch(seed=20)  # lengths 11, 6, 3
    one = Stepper(model, PagedCache(model.config, num_blocks=30, block_size=4), ids, mask)
    two = Stepper(model, PagedCache(model.config, num_blocks=30, block_size=4), ids[:, :6], mask[:, :6])
    two.mask = mask.clone()
    with torch.no_grad():
        rest = model(input_ids=ids[:, 6:], attention_mask=mask, position_ids=_positions(mask)[:, 6:],
                     use_cache=True, **{CACHE_KWARG: two.cache}).logits
    real = mask[:, 6:].bool()
    torch.testing.assert_close(rest[real], one.logits[:, 6:][real], rtol=1e-5, atol=1e-5)
    x = _tokens(21, 3, 1)
    torch.testing.assert_close(two.step(x), one.step(x), rtol=1e-5, atol=1e-5)


# --- fallback (output_attentions) on a paged step -------------------------------------------------------


@pytest.fixture
def paged_calls(monkeypatch):
    """Counts paged attention calls from hf-accel's attention function (the CPU runtime path)."""
    calls = []
    ref = hf_attn.paged_attention_sdpa

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return ref(*a, **kw)

    monkeypatch.setattr(hf_attn, "paged_attention_sdpa", spy)
    return calls


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_output_attentions_on_paged_step_matches_stock(model_type, q_len, tiny, monkeypatch, paged_calls):
    gathers = []
    gather = paged_cache_mod.PagedStep.gather
    monkeypatch.setattr(paged_cache_mod.PagedStep, "gather", lambda self: gathers.append(1) or gather(self))
    stock = tiny.model(model_type, seed=16)
    model = accelerate(copy.deepcopy(stock))
    ids, mask = tiny.batch(seed=16)
    new = _tokens(17, 3, q_len)
    ours = Stepper(model, PagedCache(model.config, num_blocks=30, block_size=4), ids, mask)
    ours.step(_tokens(18, 3, 1))
    ref = Stepper(stock, None, ids, mask)  # None -> transformers makes a DynamicCache
    ref.cache = getattr(ref.out, CACHE_KWARG)
    ref.step(_tokens(18, 3, 1))
    assert len(paged_calls) == model.config.num_hidden_layers and not gathers
    got = ours.step(new, output_attentions=True)
    want = ref.step(new, output_attentions=True)
    # every layer took the eager fallback on the paged step's gathered K/V, not the paged kernel
    assert len(gathers) == model.config.num_hidden_layers
    assert len(paged_calls) == model.config.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(ours.out.attentions) == model.config.num_hidden_layers
    for a, b in zip(ours.out.attentions, ref.out.attentions):
        assert a.shape == b.shape == (3, 4, q_len, ids.shape[1] + 1 + q_len)
        real = mask.bool()[:, None, None, :].expand(-1, 4, q_len, -1)  # pad keys: eager vs SDPA differ only there
        torch.testing.assert_close(a[..., : ids.shape[1]][real], b[..., : ids.shape[1]][real], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a[..., ids.shape[1]:], b[..., ids.shape[1]:], rtol=1e-4, atol=1e-5)
    # the next plain step is back on the paged kernel path and still right
    nxt = _tokens(19, 3, 1)
    torch.testing.assert_close(ours.step(nxt), ref.step(nxt), rtol=1e-4, atol=1e-5)


# --- a PagedCache under another attention implementation -------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("how", ["never-accelerated", "reverted"])
def test_paged_cache_under_stock_attention_matches_stock(model_type, how, tiny, caplog, one_thread):
    """A model whose attention cannot read the pools gets contiguous K/V from ``update`` (logged), so greedy
    output equals the stock cache's; before, SDPA failed on the pools' shape."""
    from hf_accel import revert_model

    model = tiny.model(model_type, seed=21)
    ids, mask = tiny.batch(seed=21)
    want = tiny.greedy(model, ids, mask)
    if how == "reverted":
        model = revert_model(accelerate(model))
    cache = PagedCache(model.config, num_blocks=64, block_size=4)
    with caplog.at_level("INFO", logger="hf_accel"):
        got = tiny.greedy(model, ids, mask, **{CACHE_KWARG: cache})
    assert torch.equal(got, want)
    assert "cannot read the block pools" in caplog.text
    assert cache.get_seq_length() == ids.shape[1] + MAX_NEW - 1


def test_update_under_sdpa_returns_contiguous_kv(tiny):
    config = tiny.config("llama", num_hidden_layers=1)  # every forward updates every layer
    config._attn_implementation = "sdpa"
    cache = PagedCache(config, num_blocks=10, block_size=4)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    cache.update(k, v, 0)
    k1, v1 = torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g)
    keys, values = cache.update(k1, v1, 0)
    assert paged_cache_mod.active_step(keys) is None
    torch.testing.assert_close(keys, torch.cat([k, k1], 2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v, v1], 2), rtol=0, atol=0)


def test_update_of_a_layer_the_config_lacks(tiny):
    model = accelerate(tiny.model("llama"))
    short = tiny.config("llama", num_hidden_layers=1)
    ids, mask = tiny.batch(seed=2)
    with pytest.raises(ValueError, match="built for 1 layers and got an update of layer 1"):
        Stepper(model, PagedCache(short, num_blocks=40, block_size=4), ids, mask)


def test_arguments_that_are_not_ints_are_refused(tiny):
    """A layer index, row indices or a stats length of another type: ValueError naming it (were a TypeError from
    inside the cache, layer True taken as layer 1, a string length accepted), the cache unchanged."""
    model = accelerate(tiny.model("llama"))
    cache = PagedCache(model.config, num_blocks=40, block_size=4)
    ids, mask = tiny.batch(seed=3)
    Stepper(model, cache, ids, mask)
    stats = cache.memory_stats()
    k = torch.zeros(3, 2, 1, 16)
    for bad in (1.0, True):
        with pytest.raises(ValueError, match=f"layer_idx must be an int; got {bad!r}"):
            cache.update(k, k, bad)
    for bad in (1, None):
        with pytest.raises(ValueError, match="beam_idx must be a 1-D integer tensor \\(or a list\\) of row indices"):
            cache.reorder_cache(bad)
    with pytest.raises(ValueError, match="memory_stats' length must be an int"):
        cache.memory_stats(length="3")
    assert cache.memory_stats() == stats and cache.memory_stats(length=range(5)[3])["tokens_stored"] == 9
    cache.reorder_cache(range(3))  # a range is a list of row indices
    cache.manager.check()
