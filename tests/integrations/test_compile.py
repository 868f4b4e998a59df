"""``torch.compile`` over an accelerated model's forward: traced without graph breaks (hf-accel's mask function and
log lines used to break the graph three times per forward, with a long warning each)."""

from __future__ import annotations

import pytest
import torch

from hf_accel import accelerate_model


def test_forward_traces_without_graph_breaks_and_equals_eager(tiny):
    import torch._dynamo as dynamo

    model = tiny.model("llama", seed=3)
    ids, mask = tiny.batch(seed=4)
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask).logits
    accelerate_model(model)
    dynamo.reset()
    with torch.no_grad():
        explained = dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    with torch.no_grad():
        got = torch.compile(model, backend="eager")(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], stock[valid], atol=1e-5, rtol=1e-5)
    dynamo.reset()


@pytest.mark.gpu
def test_inductor_compile_on_cuda_equals_eager_and_generate_still_runs(tiny):
    """``torch.compile`` with its default backend (inductor) over an accelerated model on a GPU: while traced, the
    attention takes the PyTorch path (inductor refused the Triton kernels' launch code: a bool mask viewed as uint8),
    so the compiled logits equal the uncompiled forward's, which ran the Triton kernels; ``generate`` on the same
    model still gives the stock greedy tokens."""
    import torch._dynamo as dynamo

    model = tiny.model("llama", seed=3).to("cuda")
    ids, mask = (t.to("cuda") for t in tiny.batch(seed=4))
    stock_tokens = tiny.greedy(model, ids, mask, max_new_tokens=8)
    accelerate_model(model)
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
    dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], eager[valid], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(tiny.greedy(model, ids, mask, max_new_tokens=8), stock_tokens, atol=0, rtol=0)
    dynamo.reset()


def test_generate_of_a_model_compiled_in_place_runs_its_prompt_uncompiled(tiny):
    """``model.compile()`` (in place) on an accelerated model: generate's fast path on the CPU ran the prompt's forward
    through the compiled call with hf-accel's paged cache, which broke the graph in every layer and recompiled per
    layer (SmolLM2, 20 tokens: 18 s for the first call against 1.3 s). It now runs that forward uncompiled (logged);
    the tokens equal stock's."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    model = tiny.model("llama", seed=5)
    ids, mask = tiny.batch(seed=6)
    with torch.no_grad():
        stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    accelerate_model(model)
    model.compile(backend="eager")
    dynamo.reset()
    counters.clear()
    try:
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        traced = counters["frames"]["total"]
    finally:
        dynamo.reset()
    assert torch.equal(got, stock)
    assert traced == 0, f"dynamo traced {traced} frames during generate"
