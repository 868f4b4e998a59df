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
