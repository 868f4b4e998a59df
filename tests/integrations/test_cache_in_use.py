"""hf_accel.cache_in_use: the KV cache a running generate call writes, read from a streamer."""

from __future__ import annotations

import copy

import torch
from transformers.generation.streamers import BaseStreamer

import hf_accel
from hf_accel import accelerate_model, cache_in_use
from hf_accel.cache import PagedCache


class Watch(BaseStreamer):
    """Records cache_in_use(model) and its allocated blocks at every put."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def put(self, value):
        cache = cache_in_use(self.model)
        self.seen.append((cache, None if cache is None else cache.memory_stats()["blocks_allocated"]))

    def end(self):
        pass


def _run(model, tiny, **kw):
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    watch = Watch(model)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=tiny.PAD, streamer=watch, **kw)
    return out, watch.seen


def test_fast_path_cache_is_named_while_the_call_runs(tiny, hf_log):
    stock = tiny.model("llama", seed=5)
    model = accelerate_model(copy.deepcopy(stock), block_size=4)
    out, seen = _run(model, tiny)
    assert any("generate runs the fast decode path" in r.getMessage() for r in hf_log.records)
    assert torch.equal(out, _run(stock, tiny)[0])
    caches = {id(c) for c, _ in seen}
    assert len(seen) == 7 and len(caches) == 1 and isinstance(seen[0][0], PagedCache)
    # the whole answer is reserved after the prefill: ceil((9 + 6 + lookahead) / 4) blocks or more, from the start
    assert len({n for _, n in seen}) == 1 and seen[0][1] >= 4
    assert cache_in_use(model) is None  # between calls


def test_transformers_loop_cache_and_none_where_hf_accel_has_no_cache(tiny):
    stock = tiny.model("llama", seed=6)
    loop = accelerate_model(copy.deepcopy(stock), fast_decode=False)
    _, seen = _run(loop, tiny)
    assert all(isinstance(c, PagedCache) for c, _ in seen)
    assert [n for _, n in seen][-1] >= [n for _, n in seen][0]
    assert cache_in_use(loop) is None
    beams = accelerate_model(copy.deepcopy(stock))
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(7))
    seen_beams = []

    def hook(*_a):  # beam search takes no streamer: a forward pre-hook sees the call in progress
        seen_beams.append(cache_in_use(beams))

    handle = beams.model.embed_tokens.register_forward_pre_hook(hook)
    with torch.no_grad():
        beams.generate(input_ids=ids, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=tiny.PAD)
    handle.remove()
    assert seen_beams and all(c is None for c in seen_beams)  # beam search keeps transformers' own cache
    assert cache_in_use(stock) is None and cache_in_use(object()) is None
    assert hf_accel.cache_in_use is cache_in_use


def test_a_passed_paged_cache_in_transformers_loop_is_named_and_gives_the_stats(tiny):
    """A PagedCache passed back for the next turn, continued by transformers' loop (fast_decode=False): named by
    cache_in_use while the call runs, and last_cache_stats are its stats after the call (they were the previous
    call's)."""
    from hf_accel.integrations.generate import last_cache_stats

    model = accelerate_model(tiny.model("llama", seed=8), fast_decode=False, block_size=4)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        first = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=tiny.PAD,
                               return_dict_in_generate=True)
    cache = first.cache if hasattr(first, "cache") and first.cache is not None else first.past_key_values
    ids2 = torch.cat([first.sequences, torch.tensor([[7, 8, 9]])], 1)
    watch = Watch(model)
    with torch.no_grad():
        model.generate(input_ids=ids2, max_new_tokens=4, do_sample=False, pad_token_id=tiny.PAD, streamer=watch,
                       **{tiny.cache_kwarg(model): cache})
    assert watch.seen and all(c is cache for c, _ in watch.seen)
    assert last_cache_stats(model)["tokens_stored"] == cache.memory_stats()["tokens_stored"] == ids2.shape[1] + 3


def test_overlapping_calls_each_see_their_own_cache(tiny):
    """Two calls on transformers' loop at once (no call lock there): each streamer sees its own call's cache for the
    whole call; another thread sees None while both run."""
    import threading

    model = accelerate_model(tiny.model("llama", seed=10), fast_decode=False)
    started, release = threading.Event(), threading.Event()
    seen = {"a": [], "b": []}

    class Slow(BaseStreamer):
        def __init__(self, key, first):
            self.key, self.first = key, first

        def put(self, value):
            seen[self.key].append(cache_in_use(model))
            if self.first and len(seen[self.key]) == 2:
                started.set()
                release.wait(30)  # hold call a while call b runs from start to end

        def end(self):
            pass

    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(11))

    def run(key, first):
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=tiny.PAD,
                           streamer=Slow(key, first))

    a = threading.Thread(target=run, args=("a", True))
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=run, args=("b", False))
    b.start()
    b.join(60)
    release.set()
    a.join(60)
    assert all(isinstance(c, PagedCache) for c in seen["a"] + seen["b"])
    assert len({id(c) for c in seen["a"]}) == 1 and len({id(c) for c in seen["b"]}) == 1
    assert seen["a"][0] is not seen["b"][0]
    assert cache_in_use(model) is None


def test_prepared_loop_names_no_stale_cache_before_its_prefill(tiny):
    """On the fast path inside transformers' generate (a logits processor list), transformers hands the prompt to
    the streamer before hf-accel's prefill: cache_in_use is None then (it used to be the previous call's released
    cache), and the call's cache after."""
    from transformers import LogitsProcessorList

    model = accelerate_model(tiny.model("llama", seed=12))
    for _ in range(2):
        _, seen = _run(model, tiny, logits_processor=LogitsProcessorList())
        assert seen[0][0] is None
        assert all(isinstance(c, PagedCache) and n > 0 for c, n in seen[1:])


class _Hostile:
    def __getattr__(self, name):
        raise RuntimeError("no attributes here")


def test_cache_in_use_never_raises():
    for thing in (None, 3, "model", _Hostile(), torch.nn.Linear(2, 2)):
        assert cache_in_use(thing) is None


def test_none_ids_with_input_ids_keyword_take_the_fast_path(tiny, hf_log):
    """generate(None, generation_config, input_ids=ids): the ids come from the keyword, as in transformers, and the
    fast path takes the call (it logged "no 2-D integer input_ids" and ran transformers' loop)."""
    from transformers import GenerationConfig

    stock = tiny.model("llama", seed=13)
    model = accelerate_model(copy.deepcopy(stock))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(14))
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=tiny.PAD)
    with torch.no_grad():
        got = model.generate(None, gc, input_ids=ids)
        want = stock.generate(None, gc, input_ids=ids)
    assert torch.equal(got, want)
    assert any("generate runs the fast decode path" in r.getMessage() for r in hf_log.records)
    assert not any("input_ids" in r.getMessage() and "not used" in r.getMessage() for r in hf_log.records)
