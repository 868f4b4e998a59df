"""The demo caps max new tokens at the model's context (max_position_embeddings), as the CLI does, and refuses
a prompt that fills it; both panes then generate the same capped number of tokens."""

from __future__ import annotations

import pytest
from test_demo_app import CPU, _drain, _loader_for, _tiny_llama, _TinyTokenizer, app

from request import cap_to_context  # demo/request.py (demo/ is on sys.path once the app is loaded)


def test_cap_to_context():
    assert cap_to_context(32, 10, 128) == (32, None)
    assert cap_to_context(118, 10, 128) == (118, None)
    n, note = cap_to_context(500, 10, 128)
    assert n == 118 and note == ("capped to 118 new tokens: the 10-token prompt and 500 new tokens would run past "
                                 "the model's context of 128 positions")
    assert cap_to_context(500, 10, None) == (500, None)
    with pytest.raises(ValueError, match=r"The prompt \(128 tokens\) fills the model's context \(128 positions\)"):
        cap_to_context(1, 128, 128)


@pytest.fixture(scope="module")
def demo_tiny():
    return _tiny_llama(), _TinyTokenizer()  # max_position_embeddings 128; no EOS: every run is max_new_tokens long


def test_run_comparison_caps_at_the_context_and_refuses_a_full_prompt(demo_tiny):
    pytest.importorskip("gradio")
    store = app.ModelStore(CPU, loader=_loader_for(demo_tiny))
    feats = [f for f in app.available_features() if f.key == "attention"]
    outs = _drain(app.run_comparison(store, feats, "", "hello", 1000, "Greedy", 0.7, 0.9, "sequential",
                                     [True, None], run_id=3))
    assert any("capped to 123 new tokens" in o[0] for o in outs if isinstance(o[0], str))
    status, s_text, _, _, a_text, _, summary, _ = outs[-1]
    assert 'data-kind="ok"' in status and s_text == a_text and s_text.count("t") == 123  # 5 + 123 = 128 positions
    outs = _drain(app.run_comparison(store, feats, "", "x" * 128, 4, "Greedy", 0.7, 0.9, "sequential",
                                     [True, None], run_id=4))
    assert "The prompt (128 tokens) fills the model&#x27;s context (128 positions)" in outs[-1][0]  # HTML-escaped
    assert 'data-kind="error"' in outs[-1][0]
