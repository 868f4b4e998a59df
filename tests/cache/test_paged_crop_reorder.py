"""PagedCache crop and row re-indexing inside transformers (tiny random models, float32, CPU; forward steps driven by
hand).

``crop`` (speculative rollback): every argument form, a crop then a continuation equal to never having decoded
the rejected tokens (and to stock transformers), a step of the same shape after a crop getting fresh slots;
``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``: forked rows share blocks, the data read
through the block tables stays right, and copy-on-write keeps siblings apart on the next step.
"""

from __future__ import annotations

import pytest
import torch
from paged_cache_helpers import MODEL_TYPES, Stepper, _positions, _tokens, accelerate

import hf_accel.cache.paged_cache as paged_cache_mod
import hf_accel.integrations.attention as hf_attn
from hf_accel.cache import PagedCache
from hf_accel.integrations.generate import CACHE_KWARG
from hf_accel.kernels.paged_attention_torch import gather_kv


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
    cache.crop(tokens_to_remove=-1)  # transformers' Cache.crop keyword
    expect(8)
    cache.crop(100)  # longer than the cache: nothing to remove
    expect(8)
    with pytest.raises(ValueError):
        cache.crop(-9)
    expect(8)
    cache.crop(-8)  # everything: all blocks back
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


# --- reorder_cache / batch_select_indices / batch_repeat_interleave ------------------------------------


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
