"""The weight snapshot's comparison runs after the prompt's prefill is queued (``check(defer_snapshot=True)``, then
``deferred_snapshot_intact`` in ``start``): a model changed since its steps were built is found there, the call's
prefill is dropped and the call runs again on steps built for the current weights; the steps hold every weight
they read meanwhile."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from fast_generate_helpers import _accelerated, _generate

from hf_accel import accelerate_model
from hf_accel.engine import eligibility
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.engine.decode_step import DecodeStep
from hf_accel.engine.fast_generate import FastEngine


@pytest.fixture
def events(monkeypatch):
    """What a generate call does, in order: ``start`` entered / left, the snapshot compared, StaleSteps raised, a
    forward of the fused step (``fused``; the prefill's first), a K/V write through the PagedCache (``update``: the
    modules' prefill)."""
    seen: list[str] = []
    compare, start = eligibility.snapshot_intact, FastEngine.start
    fused, update = DecodeStep._forward_fused, PagedCache.update

    def comparing(snapshot):
        seen.append("compare")
        return compare(snapshot)

    def starting(self, *args, **kwargs):
        seen.append("start")
        try:
            return start(self, *args, **kwargs)
        except eligibility.StaleSteps:
            seen.append("stale")
            raise
        finally:
            seen.append("started")

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(eligibility, "snapshot_intact", comparing)
    monkeypatch.setattr(FastEngine, "start", starting)
    monkeypatch.setattr(DecodeStep, "_forward_fused", recording("fused", fused))
    monkeypatch.setattr(PagedCache, "update", recording("update", update))
    return seen


def _replace_o_proj(model, seed):
    proj = model.model.layers[1].self_attn.o_proj
    proj.weight = torch.nn.Parameter(torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(seed)))


def _ours(model, speculative, fused):
    ours = accelerate_model(copy.deepcopy(model), speculative=speculative)
    ours._hf_accel_engine.fused = fused
    return ours


@pytest.fixture
def replays(monkeypatch):
    """``start``'s test of whether a prefill replays a captured graph, answered True for fused steps: on the CPU
    (no graphs) this runs the deferred comparison's machinery after the fused step's eager prefill, which calls no
    module at these sizes (on a GPU only a graph's replay goes ahead of the comparison)."""
    monkeypatch.setattr(FastEngine, "_prefill_replays", lambda self, step, *args: bool(step.fused))


def _second_call(tiny, events, speculative, fused):
    """Two equal calls on a tiny llama; ``events`` then holds the second's, which gave the first's tokens."""
    ours = _ours(tiny.model("llama", seed=80), speculative, fused)
    ids, mask = tiny.batch(seed=81, lengths=(9,))
    first = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=4)
    events.clear()
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=4), first)


@pytest.mark.interpreter
@pytest.mark.parametrize("speculative", [None, "prompt_lookup"])
def test_a_comparison_left_for_after_the_prefill_runs_once(tiny, events, replays, speculative):
    """A second call on kept steps whose prefill may go ahead compares the snapshot once, inside ``start`` after
    the prompt's prefill, and gives the first call's tokens."""
    _second_call(tiny, events, speculative, fused=True)
    inside = events[events.index("start"): events.index("started")]
    assert inside[:2] == ["start", "fused"] and inside.count("compare") == 1 and events.count("compare") == 1


@pytest.mark.parametrize("fused", [pytest.param(True, marks=pytest.mark.interpreter), False], ids=["fused", "modules"])
def test_a_prefill_that_runs_python_compares_the_snapshot_first(tiny, events, fused):
    """Without a captured prefill graph to replay (on the CPU always; the fused step's eager forward, or the
    modules' with their hooks) the snapshot is compared before the prefill, once."""
    _second_call(tiny, events, None, fused)
    assert events[:3] == ["start", "compare", "fused" if fused else "update"] and events.count("compare") == 1


@pytest.mark.parametrize("fused", [pytest.param(True, marks=pytest.mark.interpreter), False], ids=["fused", "modules"])
@pytest.mark.parametrize("speculative", [None, "prompt_lookup"])
def test_a_weight_replaced_between_calls_gives_stocks_tokens(tiny, events, replays, speculative, fused):
    """A Parameter replaced after a call is found in the next call's ``start`` (StaleSteps), which runs the call
    again on steps built for the new weight: after the prompt's prefill (dropped) where it may go ahead, before it
    otherwise. Either way the tokens are stock's for the new weight."""
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
    assert events.count("stale") == 1 and events.count("start") == 2
    first_forward = events.index("fused" if fused else "update")
    assert (first_forward < events.index("stale")) == fused  # the dropped prefill ran only where it may go ahead
    assert engine.steps and not any(engine.steps.get(k) is s for k, s in old_steps.items())
    assert (ours._hf_accel_spec_stats is not None) == (speculative is not None)  # the speculative path ran


@pytest.mark.parametrize("how", ["parameter", "data"])
def test_steps_hold_the_storage_they_read_until_a_call_drops_them(tiny, how):
    """A weight replaced in the model (a new Parameter, or new storage behind it as ``model.cpu()`` gives) keeps
    its old storage held by the steps built on it (a prefill graph may replay before the comparison), until the
    next call has found the change and dropped them."""
    model = _accelerated(tiny.model("llama", seed=85))
    ids, mask = tiny.batch(seed=86)
    _generate(model, ids, mask, tiny.PAD, max_new_tokens=3)
    engine = model._hf_accel_engine
    proj = model.model.layers[1].self_attn.o_proj
    old = proj.weight.data_ptr()
    new = torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(87))
    if how == "parameter":
        proj.weight = torch.nn.Parameter(new)
    else:
        proj.weight.data = new
    gc.collect()
    assert any(t.data_ptr() == old for step in engine.steps.values() for t in step.keepalive)
    _generate(model, ids, mask, tiny.PAD, max_new_tokens=3)
    assert engine.steps and not any(t.data_ptr() == old for step in engine.steps.values() for t in step.keepalive)


@pytest.mark.interpreter
def test_a_hook_added_between_calls_runs_as_often_as_in_stock(tiny):
    """A forward hook added after a call on the fused steps, on a module a long prompt's eager fused prefill calls
    (the LM head at more than 72 rows), runs as often as in stock: the snapshot is compared before that prefill."""
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


def test_a_call_refused_after_a_deferred_check_leaves_nothing_for_start(tiny):
    """A check that defers the comparison and then refuses the call (an option of the prepared loop) leaves no
    comparison pending: the call's own route (transformers' generate with hf-accel's decoding method) checks
    the model itself, and gives stock's tokens after a weight change."""
    model = tiny.model("llama", seed=88)
    ids, mask = tiny.batch(seed=89)
    ours = _accelerated(model)
    _generate(ours, ids, mask, tiny.PAD, max_new_tokens=3)
    engine = ours._hf_accel_engine
    for m in (model, ours):
        _replace_o_proj(m, seed=90)
    gc_ = copy.deepcopy(ours.generation_config)
    gc_.no_repeat_ngram_size = 2
    reason = engine.check(gc_, {"input_ids": ids, "attention_mask": mask}, defer_snapshot=True)
    assert reason is not None and engine.deferred_snapshot is None
    want = _generate(model, ids, mask, tiny.PAD, max_new_tokens=5, no_repeat_ngram_size=2)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=5, no_repeat_ngram_size=2), want)
