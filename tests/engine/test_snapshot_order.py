"""The weight snapshot of the fast path's steps is compared at each call before the prompt's prefill, once: a model
changed since its steps were built (a replaced weight, a forward hook added) is found before any step runs, and the
call gives stock's tokens for the changed model."""

from __future__ import annotations

import copy

import pytest
import torch
from fast_generate_helpers import _generate

from hf_accel import accelerate_model
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.engine import eligibility
from hf_accel.engine.decode_step import DecodeStep
from hf_accel.engine.fast_generate import FastEngine


@pytest.fixture
def events(monkeypatch):
    """What a generate call does, in order: the snapshot compared, ``start`` entered, a forward of the fused step
    (``fused``; the prefill's first), a K/V write through the PagedCache (``update``: the modules' prefill)."""
    seen: list[str] = []

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(eligibility, "snapshot_intact", recording("compare", eligibility.snapshot_intact))
    monkeypatch.setattr(FastEngine, "start", recording("start", FastEngine.start))
    monkeypatch.setattr(DecodeStep, "_forward_fused", recording("fused", DecodeStep._forward_fused))
    monkeypatch.setattr(PagedCache, "update", recording("update", PagedCache.update))
    return seen


def _replace_o_proj(model, seed):
    proj = model.model.layers[1].self_attn.o_proj
    proj.weight = torch.nn.Parameter(torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(seed)))


def _ours(model, speculative, fused):
    ours = accelerate_model(copy.deepcopy(model), speculative=speculative)
    ours._hf_accel_engine.fused = fused
    return ours


FUSED = pytest.mark.parametrize("fused", [pytest.param(True, marks=pytest.mark.interpreter), False],
                                ids=["fused", "modules"])
SPECULATIVE = pytest.mark.parametrize("speculative", [None, "prompt_lookup"])


@FUSED
@SPECULATIVE
def test_a_call_on_kept_steps_compares_the_snapshot_once_before_its_prefill(tiny, events, speculative, fused):
    """A second equal call on the steps the first built compares the snapshot once, before ``start`` (and so
    before the prompt's prefill), and gives the first call's tokens."""
    ours = _ours(tiny.model("llama", seed=80), speculative, fused)
    ids, mask = tiny.batch(seed=81, lengths=(9,))
    first = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=4)
    events.clear()
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=4), first)
    forward = events.index("fused" if fused else "update")
    assert events.count("compare") == 1 and events.index("compare") < events.index("start") < forward


@FUSED
@SPECULATIVE
def test_a_weight_replaced_between_calls_gives_stocks_tokens(tiny, events, speculative, fused):
    """A Parameter replaced after a call is found by the next call's comparison, before its prefill: the steps
    built for the old weight are dropped, new ones run, and the tokens are stock's for the new weight."""
    model = tiny.model("llama", seed=82)
    ids, mask = tiny.batch(seed=83, lengths=(9,))
    ours = _ours(model, speculative, fused)
    _generate(ours, ids, mask, tiny.PAD, max_new_tokens=4)
    engine = ours._hf_accel_engine
    old_steps = dict(engine.steps)
    assert old_steps
    for m in (model, ours):
        _replace_o_proj(m, seed=84)
    want = _generate(model, ids, mask, tiny.PAD, max_new_tokens=4)
    events.clear()
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=4), want)
    assert events.index("compare") < events.index("fused" if fused else "update")
    assert engine.steps and not any(engine.steps.get(k) is s for k, s in old_steps.items())
    assert (ours._hf_accel_spec_stats is not None) == (speculative is not None)  # the speculative path ran


@pytest.mark.interpreter
def test_a_hook_added_between_calls_runs_as_often_as_in_stock(tiny):
    """A forward hook added after a call on the fused steps, on a module a long prompt's eager fused prefill calls
    (the LM head at more than 72 rows), runs as often as in stock."""
    model = tiny.model("llama", seed=80)
    ids, mask = tiny.batch(seed=81, lengths=(80,))
    ours = _ours(model, None, fused=True)
    _generate(ours, ids, mask, tiny.PAD, max_new_tokens=3)
    counts = {"stock": 0, "ours": 0}
    for name, m in (("stock", model), ("ours", ours)):
        m.lm_head.register_forward_hook(lambda mod, args, out, name=name: counts.__setitem__(name, counts[name] + 1))
    want = _generate(model, ids, mask, tiny.PAD, max_new_tokens=3)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=3), want)
    assert counts["ours"] == counts["stock"] > 0
