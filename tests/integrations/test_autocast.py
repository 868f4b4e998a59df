"""Mixed precision by autocast: hf-accel's kernels take one dtype, so under ``torch.autocast`` its attention falls
back to SDPA (which casts as autocast asks, as in transformers) and ``generate`` keeps transformers' loop and cache;
a forward wrapped on the instance (accelerate's ``prepare`` with ``mixed_precision``, which wraps it in autocast)
keeps the fast path off, since that path runs the layers itself. Tokens and logits are stock's under the same
autocast; both used to raise ("query/key/value dtypes differ")."""

from __future__ import annotations

import copy
from types import MethodType

import torch

from hf_accel import accelerate_model


def _messages(hf_log, needle):
    return [r.getMessage() for r in hf_log.records if needle in r.getMessage()]


def test_generate_and_forward_under_autocast_equal_stock(tiny, hf_log):
    model = tiny.model("llama", seed=20)
    ids, mask = tiny.batch(seed=21)
    ours = accelerate_model(copy.deepcopy(model))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock_tokens = tiny.greedy(model, ids, mask, max_new_tokens=6)
        stock_logits = tiny.logits(model, ids, mask)
        assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=6), stock_tokens)
        torch.testing.assert_close(tiny.logits(ours, ids, mask), stock_logits, rtol=0, atol=0)
    assert _messages(hf_log, "generate keeps transformers' cache: autocast is on")
    assert _messages(hf_log, "SDPA fallback: autocast is on")
    # outside autocast the same model takes hf-accel's path again
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=6), tiny.greedy(model, ids, mask, max_new_tokens=6))
    assert _messages(hf_log, "generate runs the fast decode path")


def _autocast_forward(model):
    """What accelerate's ``prepare`` does with ``mixed_precision="bf16"``: the instance's forward under autocast."""
    model.forward = MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward), model)
    return model


def test_forward_wrapped_in_autocast_on_the_instance_keeps_the_fast_path_off(tiny, hf_log):
    model = _autocast_forward(tiny.model("llama", seed=22))
    ids, mask = tiny.batch(seed=23)
    stock = tiny.greedy(model, ids, mask, max_new_tokens=6)
    ours = accelerate_model(_autocast_forward(tiny.model("llama", seed=22)))
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=6), stock)
    assert _messages(hf_log, "fast decode path not used: its forward is replaced on the instance")
    # the wrapper removed: the fast path runs, and the check is not stuck on its first answer
    del ours.forward
    plain = tiny.greedy(tiny.model("llama", seed=22), ids, mask, max_new_tokens=6)
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=6), plain)
    assert _messages(hf_log, "generate runs the fast decode path")
