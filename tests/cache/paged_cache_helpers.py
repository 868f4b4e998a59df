"""Helpers shared by the PagedCache test modules in this folder (imported as ``from paged_cache_helpers import ...``;
pytest puts this folder on ``sys.path`` for its test modules).

``accelerate``: ``accelerate_model``, by default with transformers' own generate loop on the PagedCache;
``Stepper``: forward steps driven by hand over one growing left-padded batch with a given cache (``_positions``: the
position ids generate computes for a left-padded mask); ``_tokens``: seeded random token ids; ``_state`` /
``_assert_same_state``: everything observable of a PagedCache, and a bitwise comparison of two such snapshots;
``MODEL_TYPES`` / ``MAX_NEW``: the tiny model types and the number of new tokens of the generate tests.
"""

from __future__ import annotations

import inspect

import torch

from hf_accel import accelerate_model
from hf_accel.cache import PagedCache
from hf_accel.integrations.generate import CACHE_KWARG

MODEL_TYPES = ["llama", "qwen2"]
MAX_NEW = 10
HAS_FAST_DECODE = "fast_decode" in inspect.signature(accelerate_model).parameters


def accelerate(model, loop: str = "transformers", **kw):
    """``accelerate_model``; with ``loop="transformers"`` generate runs transformers' own loop on a
    PagedCache (hf-accel's own decode engine, where the installed version has one, switched off)."""
    if loop == "transformers" and HAS_FAST_DECODE:
        kw["fast_decode"] = False
    return accelerate_model(model, **kw)


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
