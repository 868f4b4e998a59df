"""PagedCache inside transformers, on tiny random llama / qwen2 models (float32, CPU).

Forward steps are driven by hand with a PagedCache passed as the cache argument (``cache`` in
transformers >= 5.2x, ``past_key_values`` before: :data:`CACHE_KWARG`), and compared with the same
steps on a fresh cache or on stock transformers (DynamicCache, SDPA). On CPU the paged decode runs
``paged_attention_sdpa`` (the PyTorch runtime path) and the writes ``reshape_and_cache_ref``; the ``triton``
variants route both through the Triton kernels (interpreter), so the kernels themselves run inside ``generate``.
"""

from __future__ import annotations

import copy
import gc
import inspect
import random
import weakref

import pytest
import torch

import hf_accel.cache.paged_cache as paged_cache_mod
import hf_accel.integrations.attention as hf_attn
import hf_accel.integrations.generate as gen_mod
from hf_accel import accelerate_model
from hf_accel.cache import OutOfBlocksError, PagedCache
from hf_accel.engine.call_options import output_cache
from hf_accel.integrations.generate import CACHE_KWARG, last_cache_stats
from hf_accel.kernels.paged_attention import gather_kv, paged_attention
from hf_accel.kernels.reshape_and_cache import reshape_and_cache

MODEL_TYPES = ["llama", "qwen2"]
MAX_NEW = 10
HAS_FAST_DECODE = "fast_decode" in inspect.signature(accelerate_model).parameters


def accelerate(model, loop: str = "transformers", **kw):
    """``accelerate_model``; with ``loop="transformers"`` generate runs transformers' own loop on a
    PagedCache (hf-accel's own decode engine, where the installed version has one, switched off)."""
    if loop == "transformers" and HAS_FAST_DECODE:
        kw["fast_decode"] = False
    return accelerate_model(model, **kw)


# --- helpers ---------------------------------------------------------------------------------------


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded mask (as generate computes them)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class Stepper:
    """Runs forward steps of ``model`` over one growing left-padded batch with a given cache."""

    def __init__(self, model, cache, ids, mask):
        self.model, self.cache = model, cache
        self.mask = mask.clone()
        self.logits = self._run(ids)

    def _run(self, new_ids, **kw):
        with torch.no_grad():
            out = self.model(input_ids=new_ids, attention_mask=self.mask,
                             position_ids=_positions(self.mask)[:, -new_ids.shape[1]:],
                             use_cache=True, **{CACHE_KWARG: self.cache}, **kw)
        self.out = out
        return out.logits

    def step(self, new_ids, **kw):
        """Feed ``new_ids`` [batch, q_len] (all real tokens)."""
        old = self.mask
        self.mask = torch.cat([old, torch.ones(old.shape[0], new_ids.shape[1], dtype=old.dtype)], 1)
        try:
            self.logits = self._run(new_ids, **kw)
        except Exception:
            self.mask = old
            raise
        return self.logits

    def crop_mask(self, new_length: int):
        self.mask = self.mask[:, :new_length]


def _tokens(seed, batch, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, n), generator=g)


def _state(cache: PagedCache):
    """Everything observable of a PagedCache: lengths, block tables, refcounts, stats, pool contents."""
    m = cache.manager
    return {
        "lengths": [layer.length for layer in cache.layers],
        "seq_len": cache.get_seq_length(),
        "tables": [m.block_table(s) for s in cache.seq_ids],
        "seq_lengths": [m.length(s) for s in cache.seq_ids],
        "free": list(m._free),
        "refcount": list(m._refcount),
        "stats": cache.memory_stats(),
        "pools": [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers if layer.is_initialized],
    }


def _assert_same_state(a, b):
    pools_a, pools_b = a.pop("pools"), b.pop("pools")
    assert a == b
    for (ka, va), (kb, vb) in zip(pools_a, pools_b):
        # NaN-safe bitwise comparison (unwritten slots of torch.empty pools may hold anything)
        assert torch.equal(ka.view(torch.int32), kb.view(torch.int32))
        assert torch.equal(va.view(torch.int32), vb.view(torch.int32))


def _gathered(cache: PagedCache):
    """Per layer (keys, values) [batch, kv_heads, len, d] read through the block tables."""
    m, n = cache.manager, cache.get_seq_length()
    table = torch.tensor([m.block_table(s) for s in cache.seq_ids], dtype=torch.int32).reshape(len(cache.seq_ids), -1)
    out = []
    for layer in cache.layers:
        k = torch.stack([gather_kv(layer.keys, table, n, b) for b in range(table.shape[0])])
        v = torch.stack([gather_kv(layer.values, table, n, b) for b in range(table.shape[0])])
        out.append((k, v))
    return out


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


def _route_to_triton(monkeypatch, calls):
    """CPU paged path -> Triton kernels (interpreter): paged attention and the cache writes."""

    def kernel(q, kc, vc, table, lens, max_len, key_mask=None, **kw):
        calls.append(q.shape)
        kw.pop("compute_dtype", None)
        return paged_attention(q, kc, vc, table, lens, max_len, key_mask, **kw)

    monkeypatch.setattr(hf_attn, "paged_attention_sdpa", kernel)
    monkeypatch.setattr(paged_cache_mod, "reshape_and_cache_ref", reshape_and_cache)


# --- accelerated generate (default PagedCache) vs stock ---------------------------------------------


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


# --- crop ------------------------------------------------------------------------------------------


CROPS = {
    "negative": lambda length: -3,
    "absolute": lambda length: length - 3,
    "tensor-negative": lambda length: torch.tensor(-3),
    "tensor-absolute": lambda length: torch.tensor(length - 3),
}


@pytest.mark.parametrize("how", list(CROPS))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_crop_then_continue_equals_never_decoded(model_type, how, tiny, one_thread):
    model = accelerate(tiny.model(model_type, seed=4))
    stock = tiny.model(model_type, seed=4)  # same weights, stock attention and DynamicCache
    ids, mask = tiny.batch(seed=5)  # width 11
    drafted = _tokens(6, 3, 5)
    accepted, cont = drafted[:, :2], _tokens(7, 3, 3)

    # A: decode 5 draft tokens (crossing a block boundary at 12), roll 3 back, continue
    a = Stepper(model, PagedCache(model.config, num_blocks=40, block_size=4), ids, mask)
    for t in range(5):
        a.step(drafted[:, t : t + 1])
    assert a.cache.get_seq_length() == 16
    blocks_before = a.cache.memory_stats()["blocks_allocated"]
    a.cache.crop(CROPS[how](16))
    a.crop_mask(13)
    assert a.cache.get_seq_length() == 13
    assert all(layer.length == 13 for layer in a.cache.layers)
    assert [a.cache.manager.length(s) for s in a.cache.seq_ids] == [13] * 3
    a.cache.manager.check()
    assert a.cache.memory_stats()["blocks_allocated"] == blocks_before  # 13 and 16 both need 4 blocks

    # B: never decoded the rejected tokens
    b = Stepper(model, PagedCache(model.config, num_blocks=40, block_size=4), ids, mask)
    for t in range(2):
        b.step(accepted[:, t : t + 1])
    assert a.cache.memory_stats() == b.cache.memory_stats()

    # continue: one token, then a 2-token chunk (speculative verification: q_len > 1 on the paged path)
    for stepper in (a, b):
        stepper.step(cont[:, :1])
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-6)
    for stepper in (a, b):
        stepper.step(cont[:, 1:])
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-6)

    # and both agree with stock transformers fed the same tokens
    full = torch.cat([ids, accepted, cont], 1)
    full_mask = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], 1)
    with torch.no_grad():
        want = stock(input_ids=full, attention_mask=full_mask, position_ids=_positions(full_mask)).logits[:, -2:]
    torch.testing.assert_close(a.logits, want, rtol=1e-4, atol=1e-4)


def test_crop_argument_forms(tiny):
    model = accelerate(tiny.model("llama", num_hidden_layers=1))
    ids, mask = tiny.batch(seed=8)
    s = Stepper(model, PagedCache(model.config, num_blocks=20, block_size=4), ids, mask)
    for t in range(5):
        s.step(_tokens(t, 3, 1))
    cache = s.cache

    def expect(length):
        assert cache.get_seq_length() == length
        assert all(layer.length == length for layer in cache.layers)
        assert [cache.manager.length(q) for q in cache.seq_ids] == [length] * 3
        assert cache.memory_stats()["blocks_allocated"] == 3 * -(-length // 4)
        cache.manager.check()

    expect(16)
    cache.crop(0)  # no-op
    expect(16)
    cache.crop(torch.tensor(0))
    expect(16)
    cache.crop(-2)
    expect(14)
    cache.crop(torch.tensor(-2))  # 0-d tensor count
    expect(12)
    cache.crop(10)  # absolute length (legacy positive form)
    expect(10)
    cache.crop(torch.tensor(9, dtype=torch.int32))
    expect(9)
    cache.crop(100)  # longer than the cache: nothing to remove
    expect(9)
    with pytest.raises(ValueError):
        cache.crop(-10)
    expect(9)
    cache.crop(-9)  # everything: all blocks back
    expect(0)

    # an emptied cache takes a fresh prefill and gives the fresh cache's logits
    s.crop_mask(0)
    s.mask = mask.clone()
    with torch.no_grad():
        again = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                      **{CACHE_KWARG: cache}).logits
    fresh = Stepper(model, PagedCache(model.config, num_blocks=20, block_size=4), ids, mask)
    torch.testing.assert_close(again, fresh.logits, rtol=0, atol=1e-6)
    assert cache.memory_stats() == fresh.cache.memory_stats()


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


def test_crop_then_a_step_of_the_same_shape_gets_fresh_slots(tiny):
    """Speculative rollback: verify k tokens from position s, crop them, verify k other tokens from s again. The
    step the cache kept for the layers of one forward (same start and q_len) must not be reused after the crop:
    the block tables grow again and the new K/V land where the next step reads them."""
    config = tiny.config("llama")
    config._attn_implementation = hf_attn.register()
    cache = PagedCache(config, num_blocks=12, block_size=4)
    g = torch.Generator().manual_seed(5)

    def forward(q_len):
        k, v = torch.randn(2, 2, q_len, 16, generator=g), torch.randn(2, 2, q_len, 16, generator=g)
        for layer in range(config.num_hidden_layers):
            cache.update(k, v, layer)
        return k, v

    k0, v0 = forward(5)
    forward(3)
    cache.crop(-3)
    assert cache.get_seq_length() == 5 and [cache.manager.length(q) for q in cache.seq_ids] == [5, 5]
    k1, v1 = forward(3)
    assert [cache.manager.length(q) for q in cache.seq_ids] == [8, 8]
    k2, v2 = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
    pool_k, _ = cache.update(k2, v2, 0)
    keys, values = paged_cache_mod.active_step(pool_k).gather()
    torch.testing.assert_close(keys, torch.cat([k0, k1, k2], 2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v0, v1, v2], 2), rtol=0, atol=0)


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


# --- cache lifetime --------------------------------------------------------------------------------------


def test_dropping_cache_frees_its_pools(tiny):
    model = accelerate(tiny.model("llama"))
    ids, mask = tiny.batch(seed=1)
    s = Stepper(model, PagedCache(model.config, num_blocks=30, block_size=4), ids, mask)
    s.step(_tokens(1, 3, 1))
    pools = [weakref.ref(t) for layer in s.cache.layers for t in (layer.keys, layer.values)]
    cache = weakref.ref(s.cache)
    del s
    gc.collect()
    assert cache() is None
    assert all(p() is None for p in pools), "K/V pools still referenced after the cache was dropped"


def test_out_of_blocks_on_first_forward_leaves_cache_reusable(tiny):
    model = accelerate(tiny.model("llama"))
    ids, mask = tiny.batch(seed=1)  # 3 rows of 11 tokens: 9 blocks of 4
    cache = PagedCache(model.config, num_blocks=4, block_size=4)
    with pytest.raises(OutOfBlocksError):
        Stepper(model, cache, ids, mask)
    assert cache.seq_ids == []
    s = Stepper(model, cache, ids[:1], mask[:1])  # 3 blocks: fits
    assert cache.memory_stats()["blocks_allocated"] == 3 and s.logits.shape[0] == 1


@pytest.mark.parametrize("path", ["stock", "accelerated"])
def test_num_blocks_larger_than_memory_raises_before_anything_runs(path, tiny, monkeypatch):
    """PagedCache(num_blocks=10**12): pools of thousands of TiB. A clear ValueError comes before any pool or block
    list is made (before, the block manager's list of 10**12 free ids ran out of host memory), and on the fast
    path before decoding (it fills the caller's cache at the end, after the whole answer)."""
    model = tiny.model("llama")
    if path == "accelerated":
        model = accelerate_model(model)
        steps = []
        monkeypatch.setattr(gen_mod, "_run_fast", lambda *a, **k: steps.append(1))
    ids, mask = tiny.batch(seed=1)
    cache = PagedCache(model.config, num_blocks=10**12)
    with pytest.raises(ValueError, match=r"PagedCache\(num_blocks=1000000000000, block_size=16\): its pools take "
                                         r"[0-9.]+ GiB .* has [0-9.]+ GiB free"), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=tiny.PAD,
                       **{CACHE_KWARG: cache})
    assert cache.manager is None and not any(layer.is_initialized for layer in cache.layers)
    if path == "accelerated":
        assert steps == []
    small = PagedCache(model.config, num_blocks=64)  # a size that fits is unaffected
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=tiny.PAD,
                       **{CACHE_KWARG: small})
    assert small.get_seq_length() > 0


# --- 1,000 generate calls leave zero blocks allocated -----------------------------------------------


def _assert_all_empty(caches, call):
    for cache in caches:
        stats = cache.memory_stats()
        assert stats["blocks_allocated"] == 0 and stats["tokens_stored"] == 0, f"call {call}: {stats}"
        assert cache.manager is None or cache.manager.num_free_blocks == cache.manager.num_blocks
        assert cache.seq_ids == [] and all(layer.length == 0 for layer in cache.layers)


@pytest.mark.parametrize("loop", ["transformers", "default"])
def test_thousand_generate_calls_leave_zero_blocks(loop, tiny, monkeypatch, one_thread):
    model = accelerate(tiny.model("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=32), loop)
    alive = weakref.WeakSet()  # every PagedCache made, by whichever path generate takes
    init = PagedCache.__init__

    def recording_init(self, *a, **kw):
        init(self, *a, **kw)
        alive.add(self)

    monkeypatch.setattr(PagedCache, "__init__", recording_init)
    rng = random.Random(0)
    for i in range(1000):
        lengths = tuple(rng.randint(1, 8) for _ in range(rng.randint(1, 3)))
        ids, mask = tiny.batch(seed=i, lengths=lengths)
        new = rng.randint(2, 3)
        out = tiny.greedy(model, ids, mask, new)
        assert out.shape == (len(lengths), max(lengths) + new)
        assert len(alive) >= 1
        _assert_all_empty(alive, i)
        used = last_cache_stats(model)
        assert used["blocks_allocated"] > 0
        if loop == "transformers":
            assert used["tokens_stored"] == len(lengths) * (max(lengths) + new - 1)
        assert paged_cache_mod._active.step is None
    if loop == "transformers":
        gc.collect()
        assert len(alive) == 0, f"{len(alive)} PagedCache objects still referenced after generate returned"


def test_blocks_freed_when_generate_raises(tiny, monkeypatch):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Boom(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("boom")
            return scores

    model = accelerate(tiny.model("llama", num_hidden_layers=1))
    created = []

    class Recording(PagedCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            created.append(self)

    monkeypatch.setattr(gen_mod, "PagedCache", Recording)
    ids, mask = tiny.batch(seed=1)
    with pytest.raises(RuntimeError, match="boom"):
        tiny.greedy(model, ids, mask, 6, logits_processor=LogitsProcessorList([Boom()]))
    (cache,) = created
    assert cache.memory_stats()["blocks_allocated"] == 0
    assert last_cache_stats(model)["tokens_stored"] == 3 * (ids.shape[1] + 2)
    assert paged_cache_mod._active.step is None


# --- out of blocks ------------------------------------------------------------------------------------


def test_out_of_blocks_in_decode_leaves_cache_unchanged(tiny):
    model = accelerate(tiny.model("llama", seed=9))
    ids, mask = tiny.batch(seed=9, lengths=(8, 5, 2))  # width 8 = 2 blocks of 4 per row
    s = Stepper(model, PagedCache(model.config, num_blocks=6, block_size=4), ids, mask)
    before = _state(s.cache)
    with pytest.raises(OutOfBlocksError) as e:
        s.step(_tokens(10, 3, 1))
    assert (e.value.needed, e.value.available) == (3, 0)
    assert "needed 3 more block(s) of 4 tokens" in str(e.value) and "0 free of 6" in str(e.value)
    _assert_same_state(_state(s.cache), before)

    # still usable: roll back one token and decode into the free slot of the last block
    s.cache.crop(-1)
    s.crop_mask(7)
    x = _tokens(11, 3, 1)
    got = s.step(x)
    ref = Stepper(model, PagedCache(model.config, num_blocks=6, block_size=4), ids[:, :7], mask[:, :7])
    torch.testing.assert_close(got, ref.step(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["prefill", "decode"])
def test_out_of_blocks_in_generate(case, tiny):
    model = accelerate(tiny.model("qwen2", seed=9))
    ids, mask = tiny.batch(seed=9, lengths=(11, 6, 3) if case == "prefill" else (8, 5, 2))
    cache = PagedCache(model.config, num_blocks=4 if case == "prefill" else 6, block_size=4)
    with pytest.raises(OutOfBlocksError) as e:
        tiny.greedy(model, ids, mask, 4, **{CACHE_KWARG: cache})
    needed, available = (9, 4) if case == "prefill" else (3, 0)
    assert (e.value.needed, e.value.available) == (needed, available)
    msg = str(e.value)
    assert f"needed {needed} more block(s)" in msg and f"{available} free of {cache.manager.num_blocks}" in msg
    stats = cache.memory_stats()
    if case == "prefill":
        assert cache.get_seq_length() == 0 and stats["blocks_allocated"] == 0
    else:
        assert cache.get_seq_length() == 8 and stats["blocks_allocated"] == 6 and stats["tokens_stored"] == 24
    cache.manager.check()
    cache.release()
    assert cache.memory_stats()["blocks_allocated"] == 0


# --- memory_stats --------------------------------------------------------------------------------------


def test_memory_stats_fields(tiny):
    model = accelerate(tiny.model("llama"))  # 2 layers, 2 KV heads, head_dim 16
    cache = PagedCache(model.config, num_blocks=30, block_size=4)
    assert cache.memory_stats() == {"blocks_allocated": 0, "num_blocks": 30, "tokens_stored": 0,
                                    "slots_allocated": 0, "waste_pct": 0.0, "bytes_allocated": 0,
                                    "bytes_reserved": 0}
    ids, mask = tiny.batch(seed=1)  # width 11
    s = Stepper(model, cache, ids, mask)
    per_block = 2 * 2 * (4 * 2 * 16) * 4  # layers * (K+V) * slots * heads * d * fp32 bytes
    stats = cache.memory_stats()
    assert stats == {"blocks_allocated": 9, "num_blocks": 30, "tokens_stored": 33, "slots_allocated": 36,
                     "waste_pct": pytest.approx(100 * 3 / 36), "bytes_allocated": 9 * per_block,
                     "bytes_reserved": 30 * per_block}
    s.step(_tokens(1, 3, 1))
    stats = cache.memory_stats()
    assert (stats["blocks_allocated"], stats["tokens_stored"], stats["waste_pct"]) == (9, 36, 0.0)
    s.step(_tokens(2, 3, 1))
    assert cache.memory_stats()["blocks_allocated"] == 12
    cache.release()
    stats = cache.memory_stats()
    assert (stats["blocks_allocated"], stats["tokens_stored"], stats["bytes_allocated"]) == (0, 0, 0)
    assert stats["bytes_reserved"] == 30 * per_block  # the pools stay allocated
    assert cache.get_seq_length() == 0
    # the sizing helper counts the same bytes
    from hf_accel.cache.paged_cache import kv_block_bytes

    assert kv_block_bytes(model.config, 4, torch.float32) == per_block
    assert kv_block_bytes(model.config, 4, torch.bfloat16, num_layers=1) == per_block // 4


def test_blocks_that_fit_in_cpu_memory(monkeypatch):
    """On a CPU free memory is the system's available memory (90% of it); where it cannot be read, and on
    devices other than CPU and CUDA, nothing is checked (None)."""
    import hf_accel.cache.paged_cache as pc

    assert pc.blocks_that_fit("cpu", 2048) > 0 and pc.free_kv_bytes("cpu") > 0  # this machine's (it changes)
    monkeypatch.setattr(pc, "_available_system_memory", lambda: 10 * 2**20)
    assert pc.free_kv_bytes("cpu") == 9 * 2**20 and pc.blocks_that_fit("cpu", 2**20) == 9
    monkeypatch.setattr(pc, "_available_system_memory", lambda: None)
    assert pc.free_kv_bytes("cpu") is None and pc.blocks_that_fit("cpu", 2048) is None
    assert pc.free_kv_bytes("meta") is None


def test_memory_stats_with_shared_blocks(tiny):
    model = accelerate(tiny.model("llama"))
    cache = PagedCache(model.config, num_blocks=30, block_size=4)
    ids, mask = tiny.batch(seed=1)  # width 11: 3 blocks per row, the last one 3/4 full
    Stepper(model, cache, ids, mask)
    cache.reorder_cache(torch.tensor([0, 0, 0]))  # three beams share row 0's blocks
    stats = cache.memory_stats()
    assert (stats["blocks_allocated"], stats["slots_allocated"]) == (3, 12)
    assert stats["waste_pct"] == pytest.approx(100 / 12)  # 11 tokens in 12 shared slots


def test_constructor_errors(tiny):
    config = tiny.config("llama")
    for kw in ({}, {"num_blocks": 4, "memory_fraction": 0.5}, {"num_blocks": 0}, {"memory_fraction": 0.0},
               {"memory_fraction": 1.5}, {"num_blocks": 4, "block_size": 0}):
        with pytest.raises(ValueError):
            PagedCache(config, **kw)
    from hf_accel.cache.paged_cache import MAX_BLOCK_SIZE

    for bad in (MAX_BLOCK_SIZE + 1, 10**9, 2.5, True):  # 10**9: the pool reservation would fail much later
        with pytest.raises(ValueError, match=f"block_size must be an int in \\[1, {MAX_BLOCK_SIZE}\\]"):
            PagedCache(config, num_blocks=1, block_size=bad)
        with pytest.raises(ValueError, match=f"block_size must be an int in \\[1, {MAX_BLOCK_SIZE}\\]"):
            accelerate_model(tiny.model("llama"), block_size=bad)
    assert PagedCache(config, num_blocks=1, block_size=MAX_BLOCK_SIZE).block_size == MAX_BLOCK_SIZE
    empty = tiny.config("llama")
    empty.num_hidden_layers = 0  # e.g. left by an interrupted early-exit draft of another library
    with pytest.raises(ValueError, match="0 layers"):
        PagedCache(empty, num_blocks=4)
    if not torch.cuda.is_available():
        model = accelerate(tiny.model("llama"))
        ids, mask = tiny.batch(seed=1)
        with pytest.raises(ValueError, match="num_blocks"):
            Stepper(model, PagedCache(model.config, memory_fraction=0.5), ids, mask)


# --- reorder_cache / batch_select_indices / batch_repeat_interleave ------------------------------------


@pytest.mark.parametrize("op", ["reorder_cache", "batch_select_indices", "batch_repeat_interleave"])
@pytest.mark.parametrize("prompt_width", [10, 12], ids=["partial-last-block", "full-last-block"])
def test_reindex_keeps_data_correct(op, prompt_width, tiny):
    model = accelerate(tiny.model("llama", seed=12))
    lengths = (prompt_width, prompt_width - 4, 2)
    ids, mask = tiny.batch(seed=12, lengths=lengths)
    s = Stepper(model, PagedCache(model.config, num_blocks=60, block_size=4), ids, mask)
    s.step(_tokens(13, 3, 1))
    cache = s.cache
    old = _gathered(cache)
    blocks_before = cache.memory_stats()["blocks_allocated"]
    if op == "reorder_cache":
        rows = [2, 0, 2]
        cache.reorder_cache(torch.tensor(rows))
    elif op == "batch_select_indices":
        rows = [2, 0]
        cache.batch_select_indices(torch.tensor(rows))
    else:
        rows = [0, 0, 1, 1, 2, 2]
        cache.batch_repeat_interleave(2)
    cache.manager.check()
    assert len(cache.seq_ids) == len(rows)
    # forks share blocks: nothing copied, unselected rows' blocks freed
    per_row = blocks_before // 3
    assert cache.memory_stats()["blocks_allocated"] == per_row * len(set(rows))
    for (k_new, v_new), (k_old, v_old) in zip(_gathered(cache), old):
        assert torch.equal(k_new, k_old[rows]) and torch.equal(v_new, v_old[rows])

    # the next step writes different tokens into every row: copy-on-write keeps siblings apart
    idx = torch.tensor(rows)
    s.mask = s.mask[idx]
    x = _tokens(14, len(rows), 1)
    got = s.step(x)
    cache.manager.check()
    fresh_ids = torch.cat([ids[idx], _tokens(13, 3, 1)[idx], x], 1)
    fresh_mask = torch.cat([mask[idx], torch.ones(len(rows), 2, dtype=mask.dtype)], 1)
    ref = Stepper(model, PagedCache(model.config, num_blocks=60, block_size=4), fresh_ids[:, :-1], fresh_mask[:, :-1])
    want = ref.step(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for (k1, v1), (k2, v2) in zip(_gathered(cache), _gathered(ref.cache)):
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=0, atol=1e-5)
    cache.release()
    assert cache.memory_stats()["blocks_allocated"] == 0


# --- beam search with an explicitly passed PagedCache ---------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_beam_search_with_paged_cache_matches_stock(model_type, tiny, one_thread):
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
    cache.release()  # the caller owns a cache it passed
    assert cache.memory_stats()["blocks_allocated"] == 0


# --- fallback (output_attentions) on a paged step -------------------------------------------------------


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


# --- a PagedCache under another attention implementation; bad arguments -------------------------------


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


def test_bad_arguments_raise_and_leave_the_cache_unchanged(tiny):
    config = tiny.config("llama")
    for kw in ({"num_blocks": 2.5}, {"num_blocks": "4"}, {"num_blocks": True}, {"memory_fraction": "0.5"},
               {"memory_fraction": True}):
        with pytest.raises(ValueError, match="num_blocks must be an int|memory_fraction must be a number"):
            PagedCache(config, **kw)

    model = accelerate(tiny.model("llama", seed=4))
    ids, mask = tiny.batch(seed=4)
    s = Stepper(model, PagedCache(model.config, num_blocks=60, block_size=4), ids, mask)
    s.step(_tokens(5, 3, 2))
    cache = s.cache
    before = _state(cache)
    bad_calls = [
        ("reorder_cache", torch.tensor([0, 3, 1]), "out of range"),
        ("reorder_cache", torch.tensor([0, -1, 1]), "out of range"),
        ("reorder_cache", torch.tensor([True, False, True]), "integer tensor"),
        ("reorder_cache", torch.tensor([0.0, 1.0, 2.0]), "integer tensor"),
        ("batch_select_indices", torch.tensor([[0, 1]]), "1-D integer tensor"),
        ("batch_select_indices", torch.tensor([5]), "out of range"),
        ("batch_select_indices", torch.tensor([], dtype=torch.long), "need at least one row index"),
        ("reorder_cache", [], "need at least one row index"),
        ("batch_repeat_interleave", 0, "repeats must be an int >= 1"),
        ("batch_repeat_interleave", -1, "repeats must be an int >= 1"),
        ("batch_repeat_interleave", 2.0, "repeats must be an int >= 1"),
        ("crop", 2.7, "must be an int"),
        ("crop", -0.5, "must be an int"),
        ("crop", torch.tensor(1.0), "one-element integer tensor"),
        ("crop", torch.tensor([1, 2]), "one-element integer tensor"),
        ("crop", True, "must be an int"),
    ]
    for name, arg, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            getattr(cache, name)(arg)
        cache.manager.check()
        _assert_same_state(_state(cache), dict(before, pools=[(k.clone(), v.clone()) for k, v in before["pools"]]))
    cache.release()
    assert cache.memory_stats()["blocks_allocated"] == 0


@pytest.mark.parametrize("config", [None, {"num_hidden_layers": 2}], ids=["none", "dict"])
def test_a_config_that_is_not_a_transformers_config_raises(config):
    with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig"):
        PagedCache(config, num_blocks=4)


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


def test_growable_cache_grows_and_keeps_its_contents(tiny, one_thread):
    """A growable PagedCache of 2 blocks takes a prefill and steps far past them: the pools grow (the cached
    K/V copied over), the logits equal those of a cache large enough from the start; a non-growable one
    raises OutOfBlocksError, unchanged."""
    model = accelerate(tiny.model("llama", seed=53))
    ids, mask = tiny.batch(seed=54)
    small = Stepper(model, PagedCache(model.config, num_blocks=2, block_size=4, growable=True), ids, mask)
    big = Stepper(model, PagedCache(model.config, num_blocks=80, block_size=4), ids, mask)
    for i in range(6):
        x = _tokens(55 + i, 3, 1 + i % 3)
        torch.testing.assert_close(small.step(x), big.step(x), rtol=0, atol=1e-5)
        small.cache.manager.check()
    assert small.cache.manager.num_blocks > 2
    assert small.cache.memory_stats()["num_blocks"] == small.cache.manager.num_blocks
    fixed = PagedCache(model.config, num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocksError, match="needed"):
        Stepper(model, fixed, ids, mask)
    assert fixed.memory_stats()["blocks_allocated"] == 0


def test_a_forward_that_fails_part_way_is_named_and_recoverable(tiny, monkeypatch, one_thread):
    """An error inside a forward after layer 0 wrote its K/V leaves the layers one step apart; the next
    forward refuses before changing anything (also when the pool is full: not an OutOfBlocksError), naming
    the crop that drops the partial step, and after that crop the cache continues exactly as a cache that
    never saw the failed step."""
    model = accelerate(tiny.model("llama", seed=60))
    ids, mask = tiny.batch(seed=61)
    # 12 blocks: the 3 rows' 11 + 2 tokens fill them; the retry's 4 more tokens would need 3 more
    s = Stepper(model, PagedCache(model.config, num_blocks=12, block_size=4), ids, mask)
    ref = Stepper(model, PagedCache(model.config, num_blocks=60, block_size=4), ids, mask)
    length = s.cache.get_seq_length()
    mlp = model.model.layers[0].mlp  # after layer 0 wrote its K/V, before layer 1 did
    monkeypatch.setattr(mlp, "forward", lambda x: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        s.step(_tokens(62, 3, 2))
    monkeypatch.undo()
    lengths = [layer.length for layer in s.cache.layers]
    assert lengths[0] == length + 2 and min(lengths) == length
    before = _state(s.cache)
    with pytest.raises(RuntimeError, match=rf"partial step. .* a forward failed part-way .* cache.crop\({length}\)"):
        s.step(_tokens(63, 3, 4))
    _assert_same_state(_state(s.cache), dict(before, pools=[(k.clone(), v.clone()) for k, v in before["pools"]]))
    s.cache.crop(length)
    s.crop_mask(length)  # the interrupt left the Stepper's own mask two columns ahead too
    s.cache.manager.check()
    x = _tokens(64, 3, 2)
    torch.testing.assert_close(s.step(x), ref.step(x), rtol=0, atol=1e-6)


def test_an_interrupted_first_forward_names_release(tiny, monkeypatch, one_thread):
    """No step completed (the prefill was interrupted in layer 0's MLP): crop cannot express "back to 0"
    (crop(0) changes nothing), so the message names release(), which recovers."""
    model = accelerate(tiny.model("llama", seed=65))
    ids, mask = tiny.batch(seed=66)
    cache = PagedCache(model.config, num_blocks=60, block_size=4)
    monkeypatch.setattr(model.model.layers[0].mlp, "forward", lambda x: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        Stepper(model, cache, ids, mask)
    monkeypatch.undo()
    for _ in range(2):  # a retry changes nothing
        with pytest.raises(RuntimeError, match=r"no step completed: cache.release\(\) empties the cache"):
            Stepper(model, cache, ids, mask)
        assert [layer.length for layer in cache.layers][1:] == [0] * (len(cache.layers) - 1)
    cache.release()
    ref = Stepper(model, PagedCache(model.config, num_blocks=60, block_size=4), ids, mask)
    torch.testing.assert_close(Stepper(model, cache, ids, mask).logits, ref.logits, rtol=0, atol=1e-6)


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


def test_row_selections_are_checked_on_an_empty_cache_too(tiny):
    cache = PagedCache(tiny.config("llama"), num_blocks=4)
    for name, arg in (("batch_select_indices", torch.tensor([0.5])), ("reorder_cache", torch.tensor([True]))):
        with pytest.raises(ValueError, match="integer tensor"):
            getattr(cache, name)(arg)
    with pytest.raises(ValueError, match="growable must be True or False"):
        PagedCache(tiny.config("llama"), num_blocks=4, growable="no")
