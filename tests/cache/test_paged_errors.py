"""PagedCache bad arguments and recovery from a failed forward (tiny random models, float32, CPU).

Constructor and method arguments that are wrong raise ValueError / TypeError and leave the cache unchanged (also
on an empty cache); a forward that failed part-way (or a first forward that was interrupted) is refused by the next
forward with a message that names the ``crop`` (or ``release``) that recovers, after which the cache continues
exactly as one that never saw the failed step.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from paged_cache_helpers import Stepper, _assert_same_state, _state, _tokens, accelerate

from hf_accel import accelerate_model
from hf_accel.cache import PagedCache


# --- bad arguments -----------------------------------------------------------------------------------


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


def test_bad_arguments_raise_and_leave_the_cache_unchanged(tiny):
    config = tiny.config("llama")
    assert PagedCache(config, num_blocks=np.int64(8))._num_blocks == 8  # a numpy int is an int, as BlockManager has it
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


def test_row_selections_are_checked_on_an_empty_cache_too(tiny):
    cache = PagedCache(tiny.config("llama"), num_blocks=4)
    for name, arg in (("batch_select_indices", torch.tensor([0.5])), ("reorder_cache", torch.tensor([True]))):
        with pytest.raises(ValueError, match="integer tensor"):
            getattr(cache, name)(arg)
    with pytest.raises(ValueError, match="growable must be True or False"):
        PagedCache(tiny.config("llama"), num_blocks=4, growable="no")


# --- a forward that failed part-way ------------------------------------------------------------------


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
    # crops that would keep positions the later layers never wrote (their pool slots hold stale K/V) are refused,
    # the cache unchanged: one token fewer than layer 0 holds, and an absolute length past the shorter layers'
    for bad in (-1, length + 1):
        with pytest.raises(ValueError, match=rf"cannot keep {length + 1} tokens: a forward failed part-way and "
                                             rf"layers? 1.* only {length}; crop to {length} tokens or fewer"):
            s.cache.crop(bad)
    _assert_same_state(_state(s.cache), dict(before, pools=[(k.clone(), v.clone()) for k, v in before["pools"]]))
    s.cache.crop(length)
    s.crop_mask(length)  # the interrupt left the Stepper's own mask two columns ahead too
    s.cache.manager.check()
    x = _tokens(64, 3, 2)
    torch.testing.assert_close(s.step(x), ref.step(x), rtol=0, atol=1e-6)


def test_a_cache_built_for_more_layers_names_that_cause(tiny):
    """A PagedCache made from a config with more layers than the model runs: after the first forward its last layers
    are a step behind; the next forward's error names the layer counts as a possible cause, not only a failed
    forward."""
    import copy as copy_mod

    from hf_accel.integrations.generate import CACHE_KWARG

    model = accelerate(tiny.model("llama", seed=67, num_hidden_layers=2))
    bigger = copy_mod.deepcopy(model.config)
    bigger.num_hidden_layers = 3
    cache = PagedCache(bigger, num_blocks=16, block_size=4)
    ids = _tokens(68, 1, 5)
    with torch.no_grad():
        model(input_ids=ids, **{CACHE_KWARG: cache})
        with pytest.raises(RuntimeError, match="the model runs 2 decoder layers and this cache was built for 3"):
            model(input_ids=ids[:, :1], **{CACHE_KWARG: cache})


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


# --- a first layer's write that fails ------------------------------------------------------------------


def _direct_cache(tiny, **kw):
    """A PagedCache fed directly (no model): 2 layers, 2 KV heads of size 8, 2 tokens cached in 1 row."""
    config = tiny.config("llama")
    config.num_hidden_layers, config.num_key_value_heads, config.head_dim = 2, 2, 8
    cache = PagedCache(config, num_blocks=8, block_size=3, **kw)
    g = torch.Generator().manual_seed(90)
    for layer in range(2):
        cache.update(torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 2, 2, 8, generator=g), layer)
    return cache


def _tables(cache):
    m = cache.manager
    return ([layer.length for layer in cache.layers], [m.block_table(s) for s in cache.seq_ids],
            [m.length(s) for s in cache.seq_ids], sorted(m._free), list(m._refcount))


def _continue(cache, seed):
    """One more 2-token step through both layers; layer 1's returned K/V."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):
        k, v = cache.update(torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 2, 2, 8, generator=g), layer)
    return torch.cat([k, v], dim=-1)


@pytest.mark.parametrize("bad", ["value_length", "heads", "interrupt"])
def test_a_failed_first_layer_write_leaves_the_block_tables_as_they_were(tiny, monkeypatch, bad):
    """Layer 0 prepares the step (advances the block tables) before it writes: a write that fails there (K and V
    of different lengths, another model's head count, an interrupt inside the write) used to leave the tables one
    step ahead of every layer, and the next step raised "out of sync" with a crop that changed nothing. Now the
    bad shapes are refused before anything changes, a failed write takes the step back, and the cache continues
    exactly as one that never saw the call."""
    cache, ref = _direct_cache(tiny), _direct_cache(tiny)
    before = _tables(cache)
    if bad == "value_length":
        with pytest.raises(ValueError, match="key and value states must have one shape"):
            cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 2, 8), 0)
    elif bad == "heads":
        with pytest.raises(ValueError, match="holds 2 KV heads of size 8 and got 4 of size 8"):
            cache.update(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), 0)
    else:
        import hf_accel.cache.paged_cache as paged_cache

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(paged_cache, "reshape_and_cache_ref", interrupted)
        with pytest.raises(KeyboardInterrupt):
            cache.update(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), 0)
        monkeypatch.undo()
    assert _tables(cache) == before
    cache.manager.check()
    assert torch.equal(_continue(cache, 91), _continue(ref, 91))


def test_an_interrupted_first_write_of_an_empty_cache_frees_its_rows(tiny, monkeypatch):
    """The first step allocates the rows; an interrupt inside layer 0's write gives them back, so the empty cache
    takes any batch size next."""
    import hf_accel.cache.paged_cache as paged_cache

    config = tiny.config("llama")
    config.num_hidden_layers, config.num_key_value_heads, config.head_dim = 2, 2, 8
    cache = PagedCache(config, num_blocks=8, block_size=3)
    monkeypatch.setattr(paged_cache, "reshape_and_cache_ref", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        cache.update(torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8), 0)
    monkeypatch.undo()
    assert cache.seq_ids == [] and cache.manager.num_free_blocks == 8
    k = torch.randn(1, 2, 4, 8)
    for layer in range(2):
        got, _ = cache.update(k, k, layer)
    assert torch.equal(got, k) and cache.get_seq_length() == 4


def test_crop_also_brings_block_tables_ahead_of_the_layers_back(tiny):
    """``crop(n)`` with the layers already at ``n`` still truncates block tables that ran ahead of them (the state
    the out-of-sync message describes), so the crop it recommends recovers."""
    cache, ref = _direct_cache(tiny), _direct_cache(tiny)
    for s in cache.seq_ids:
        cache.manager.append(s, 2)
    cache._step = None
    with pytest.raises(RuntimeError, match=r"out of sync.*cache.crop\(2\)"):
        _continue(cache, 92)
    cache.crop(2)
    assert _tables(cache) == _tables(ref)
    assert torch.equal(_continue(cache, 93), _continue(ref, 93))


@pytest.mark.parametrize("growable", [False, True])
def test_rows_sharing_a_partly_filled_block_need_one_copy_fewer_than_rows(tiny, growable):
    """Rows forked from one sequence (``batch_repeat_interleave``, beam search) share its partly filled last block: of
    three rows appending a token, two copy it and the last writes into it in place, so 2 free blocks suffice. The
    step counted a copy per row: it raised OutOfBlocksError ("needed 3 ... 2 free"), or grew a growable pool. The
    rows' K/V then read back as written."""
    config = tiny.config("llama")
    cache = PagedCache(config, num_blocks=4, block_size=4, growable=growable)
    g = torch.Generator().manual_seed(0)
    def kv(batch, q):
        return tuple(torch.randn(batch, config.num_key_value_heads, q, config.head_dim, generator=g) for _ in range(2))

    prompt = [kv(1, 6) for _ in range(config.num_hidden_layers)]
    for i, (k, v) in enumerate(prompt):
        cache.update(k, v, i)
    cache.batch_repeat_interleave(3)
    assert cache.manager.num_free_blocks == 2
    step = [kv(3, 1) for _ in range(config.num_hidden_layers)]
    for i, (k, v) in enumerate(step):
        cache.update(k, v, i)
    assert cache.manager.num_blocks == 4 and cache.manager.num_free_blocks == 0
    cache.manager.check()
    for i in range(config.num_hidden_layers):
        keys, values = cache.layer_kv(i)
        assert torch.equal(keys, torch.cat([prompt[i][0].expand(3, -1, -1, -1), step[i][0]], 2))
        assert torch.equal(values, torch.cat([prompt[i][1].expand(3, -1, -1, -1), step[i][1]], 2))


def test_k_v_of_another_dtype_raise_unless_the_cache_is_empty(tiny):
    """A cache holding float32 K/V given bfloat16 K/V (another model's): written into the float32 pools silently
    (or SDPA's dtype error one call later). Now a ValueError names both, with the cache unchanged; an emptied cache
    (``reset()`` / ``release()`` keep the pools) gets new pools of the new dtype, as transformers' DynamicCache
    does after ``reset()``."""
    config = tiny.config("llama")
    cache = PagedCache(config, num_blocks=8, block_size=4)
    g = torch.Generator().manual_seed(3)

    def kv(q, dtype=torch.float32):
        return [torch.randn(1, config.num_key_value_heads, q, config.head_dim, generator=g).to(dtype)
                for _ in range(2)]

    for i in range(config.num_hidden_layers):
        cache.update(*kv(3), i)
    before = _state(cache)
    for k, v in (kv(1, torch.bfloat16), (kv(1)[0], kv(1, torch.bfloat16)[1])):
        with pytest.raises(ValueError, match="PagedCache layer 0 holds keys torch.float32 on cpu, values torch.float32 "
                           "on cpu and got keys"):
            cache.update(k, v, 0)
        _assert_same_state(_state(cache), dict(before, pools=[(k.clone(), v.clone()) for k, v in before["pools"]]))
    cache.reset()
    written = [kv(5, torch.bfloat16) for _ in range(config.num_hidden_layers)]
    for i, (k, v) in enumerate(written):
        assert cache.update(k, v, i)[0].dtype == torch.bfloat16
    for i, (k, v) in enumerate(written):
        keys, values = cache.layer_kv(i)
        assert torch.equal(keys, k) and torch.equal(values, v)


@pytest.mark.parametrize("shape", [(2, 3, 16), (1, 2, 2, 3, 16), (0, 2, 3, 16)])
def test_k_v_that_are_not_a_4d_batch_raise_naming_the_shape(tiny, shape):
    """3-D or 5-D K/V, or a batch of no rows, raised IndexError / unpacking / max() errors from inside the cache."""
    cache = PagedCache(tiny.config("llama"), num_blocks=8, block_size=4)
    message = rf"key states must be a tensor \[batch >= 1, .*got shape {re.escape(str(shape))}"
    with pytest.raises(ValueError, match=message):
        cache.update(torch.zeros(shape), torch.zeros(shape), 0)
    assert cache.get_seq_length() == 0 and not cache.seq_ids
