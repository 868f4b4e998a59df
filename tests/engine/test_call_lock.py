"""generate calls that share one accelerated model's fast-path state (``FastEngine.call_lock``).

The fast path keeps one paged cache, its buffers and captured graphs per model, so two calls at once would
overwrite each other's cache: calls from several threads run one after the other, with the tokens each
would get alone, and a call from inside a running one (a streamer's callback) raises. Each test holds a
call inside the engine for a while (a sleep) so that, without the lock, the threads would overlap.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from hf_accel import SpeculativeConfig, accelerate_model, speculative_stats

HOLD_S = 0.3


def _greedy(model, ids, mask, pad, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, do_sample=False,
                              max_new_tokens=8, eos_token_id=None, **kwargs)


class _Overlap:
    """Wraps callables so that each call holds for HOLD_S; ``most`` is the largest number inside at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self.inside = self.most = 0

    def wrap(self, fn):
        def held(*args, **kwargs):
            with self._lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            try:
                time.sleep(HOLD_S)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.inside -= 1
        return held


def _run_threads(calls):
    """Run ``calls`` (name -> no-argument callable) in threads started together; name -> result or exception."""
    results, start = {}, threading.Barrier(len(calls))

    def run(name, fn):
        start.wait()
        try:
            results[name] = fn()
        except Exception as e:  # reported by the assertions
            results[name] = e

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_calls_run_one_after_the_other(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    refs = {"one": _greedy(model, ids[:1], mask[:1], tiny.PAD), "three": _greedy(model, ids, mask, tiny.PAD)}
    ours = accelerate_model(copy.deepcopy(model))
    overlap = _Overlap()
    ours._hf_accel_engine.generate = overlap.wrap(ours._hf_accel_engine.generate)
    for _ in range(2):
        got = _run_threads({"one": lambda: _greedy(ours, ids[:1], mask[:1], tiny.PAD),
                            "three": lambda: _greedy(ours, ids, mask, tiny.PAD)})
        for name, ref in refs.items():
            assert isinstance(got[name], torch.Tensor), got[name]
            assert torch.equal(got[name], ref), name
    assert overlap.most == 1


def test_draft_model_waits_for_the_target_using_it(tiny):
    """A draft model's own generate in another thread waits while a target drafts with it."""
    model = tiny.model("llama", num_hidden_layers=4)
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:2])
    draft.config.num_hidden_layers = 2
    ids, mask = tiny.batch(seed=2)
    refs = {"target": _greedy(model, ids, mask, tiny.PAD), "draft": _greedy(draft, ids, mask, tiny.PAD)}
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("draft_model", draft_model=draft,
                                                                               adaptive=False))
    spec = next(iter(ours._hf_accel_spec_engines.values()))
    overlap = _Overlap()
    spec._generate = overlap.wrap(spec._generate)
    draft._hf_accel_engine.generate = overlap.wrap(draft._hf_accel_engine.generate)
    got = _run_threads({"target": lambda: _greedy(ours, ids, mask, tiny.PAD),
                        "draft": lambda: _greedy(draft, ids, mask, tiny.PAD)})
    for name, ref in refs.items():
        assert isinstance(got[name], torch.Tensor), got[name]
        assert torch.equal(got[name], ref), name
    assert overlap.most == 1
    assert speculative_stats(ours)["verify_steps"] > 0


class _CallsGenerateAgain(BaseStreamer):
    def __init__(self, model, ids, mask, pad):
        self.args = (model, ids, mask, pad)

    def put(self, value):
        _greedy(*self.args)

    def end(self):
        pass


def test_generate_from_inside_a_running_generate_raises_and_the_model_still_works(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    ref = _greedy(model, ids, mask, tiny.PAD)
    ours = accelerate_model(copy.deepcopy(model))
    with pytest.raises(RuntimeError, match="already running in this thread"):
        _greedy(ours, ids, mask, tiny.PAD, streamer=_CallsGenerateAgain(ours, ids, mask, tiny.PAD))
    assert torch.equal(_greedy(ours, ids, mask, tiny.PAD), ref)


class _HandsGenerateToAThread(BaseStreamer):
    """A streamer whose first ``put`` runs ``generate`` on the same model in another thread and waits for it."""

    def __init__(self, model, ids, mask, pad, wait_s):
        self.args, self.wait_s = (model, ids, mask, pad), wait_s
        self.inner = self.finished = None

    def put(self, value):
        if self.finished is not None:
            return
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("out", _greedy(*self.args)), daemon=True)
        thread.start()
        thread.join(timeout=self.wait_s)
        self.finished, self.inner = not thread.is_alive(), result.get("out")

    def end(self):
        pass


def test_a_call_the_running_call_waits_for_runs_transformers_loop(tiny, hf_log, monkeypatch):
    """A streamer that hands a generate on the same model to another thread and joins it: that call stops waiting
    for the lock once the running call has made no step for STALL_S, runs transformers' loop (logged) and returns
    the tokens it would get alone; the running call then finishes with its own."""
    from hf_accel.engine import call_lock

    monkeypatch.setattr(call_lock, "STALL_S", 0.3)
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    ref = _greedy(model, ids, mask, tiny.PAD)
    ours = accelerate_model(copy.deepcopy(model))
    streamer = _HandsGenerateToAThread(ours, ids[:1], mask[:1], tiny.PAD, wait_s=30)
    t0 = time.monotonic()
    out = _greedy(ours, ids, mask, tiny.PAD, streamer=streamer)
    assert streamer.finished, "the inner generate was still waiting after 30 s"
    assert time.monotonic() - t0 < 20
    assert torch.equal(streamer.inner, _greedy(model, ids[:1], mask[:1], tiny.PAD))
    assert torch.equal(out, ref)
    assert any("ran no step for 0.3 s while this one waited" in m for m in hf_log.messages)
    assert torch.equal(_greedy(ours, ids, mask, tiny.PAD), ref)  # the fast path again, lock free


def test_a_waiter_keeps_waiting_while_the_holder_steps():
    """unless_stalled: a holder that keeps stepping for longer than the stall time is waited for; one that stops
    stepping is not (the waiter gets False after about the stall time, without the lock)."""
    from hf_accel.engine.call_lock import CallLock

    lock, got = CallLock(), {}

    def waiter(name):
        with lock.unless_stalled(0.3) as held:
            got[name] = (held, time.monotonic())

    with lock:
        thread = threading.Thread(target=waiter, args=("stepping",))
        thread.start()
        for _ in range(10):  # 1 s of steps, each 0.1 s apart
            time.sleep(0.1)
            lock.step()
        assert "stepping" not in got
        released = time.monotonic()
    thread.join(timeout=10)
    assert got["stepping"][0] is True and got["stepping"][1] >= released
    with lock:
        start = time.monotonic()
        thread = threading.Thread(target=waiter, args=("stalled",))
        thread.start()
        thread.join(timeout=10)
        assert got["stalled"][0] is False and 0.3 <= got["stalled"][1] - start < 5
    with lock.unless_stalled() as held:  # free: taken at once
        assert held and lock.held_here()
        with pytest.raises(RuntimeError, match="already running in this thread"):
            with lock.unless_stalled():
                pass
    assert not lock.held_here()
