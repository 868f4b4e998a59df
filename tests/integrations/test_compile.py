"""``torch.compile`` over an accelerated model's forward: traced without graph breaks (hf-accel's mask function and
log lines used to break the graph three times per forward, with a long warning each)."""

from __future__ import annotations

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
