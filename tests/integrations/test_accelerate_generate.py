"""accelerate_model on tiny random llama, qwen2, mistral, qwen3 models and the real SmolLM2: the accelerated attention
gives stock transformers' greedy tokens (float32) and logits, on every cache path.

Greedy left-padded generate, the decode paths (generate's fast path, transformers' loop over a PagedCache or a
DynamicCache), forward logits and an exact revert, an unpadded batch passing no mask, chunked decode over a
DynamicCache, the log lines naming the active path, and SmolLM2-135M-Instruct's answers (slow). On CPU the attention
function runs the PyTorch reference of the kernel; the ``triton`` variants route that call through the Triton
kernel (interpreter), so the kernel itself runs inside ``generate``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import hf_accel.integrations.attention as hf_attn
from hf_accel import accelerate_model, is_accelerated, revert_model


MODEL_TYPES = ["llama", "qwen2", "mistral", "qwen3"]
MAX_NEW = 10
# The Triton variants run the kernels on the tiny models' CPU tensors: Triton's interpreter.
PATHS = ["reference", pytest.param("triton", marks=pytest.mark.interpreter)]


# --- greedy generation, logits, revert --------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_greedy_generate_token_identical(model_type, path, tiny, attention_spy):
    model = tiny.model(model_type)
    ids, mask = tiny.batch(seed=1)
    stock = tiny.greedy(model, ids, mask, MAX_NEW)
    assert torch.equal(stock, tiny.greedy(copy.deepcopy(model), ids, mask, MAX_NEW))

    spy = attention_spy(route_to_triton=(path == "triton"))
    assert accelerate_model(model) is model
    assert model.config._attn_implementation == hf_attn.ATTN_NAME
    ours = tiny.greedy(model, ids, mask, MAX_NEW)

    assert ours.shape == (3, ids.shape[1] + MAX_NEW)
    assert torch.equal(ours, stock), f"{model_type}: accelerated greedy tokens differ\n{stock}\n{ours}"
    # hf-accel's attention really ran: the prefill of every layer with the 2-D key padding mask (left
    # padding present), then every decode step on a paged kernel, and nothing fell back.
    layers = model.config.num_hidden_layers
    assert spy.fallbacks == []
    assert spy.calls[:layers] == [("dense", (2, (3, ids.shape[1])))] * layers
    decode = spy.calls[layers:]
    assert len(decode) >= layers * (MAX_NEW - 1)
    assert {kind for kind, _ in decode} <= {"engine", "paged"}
    assert all(m is not None and m[0] == 2 and m[1][0] == 3 for _, m in decode)


GENERATE_PATHS = {
    # option of accelerate_model -> attention kind of the decode steps
    "fast": ({}, "engine"),
    "paged": ({"fast_decode": False}, "paged"),
    "dynamic": ({"paged_cache": False}, "dense"),
}


@pytest.mark.parametrize("generate_path", list(GENERATE_PATHS))
@pytest.mark.parametrize("path", PATHS)
def test_generate_cache_paths(generate_path, path, tiny, attention_spy):
    """Prefill runs the contiguous kernel; decode runs on generate's fast path (default), on
    transformers' loop over a PagedCache (fast_decode=False) or over its DynamicCache
    (paged_cache=False). All give stock HF's tokens."""
    options, decode_kind = GENERATE_PATHS[generate_path]
    model = tiny.model("llama", seed=21)
    ids, mask = tiny.batch(seed=22, lengths=(13, 9, 2))
    stock = tiny.greedy(model, ids, mask, 12)
    spy = attention_spy(route_to_triton=(path == "triton"))
    try:
        accelerate_model(model, **options)
    except TypeError as e:  # an option this version does not have
        pytest.fail(f"accelerate_model does not take {options}: {e}")
    ours = tiny.greedy(model, ids, mask, 12)
    assert torch.equal(ours, stock)
    layers = model.config.num_hidden_layers
    assert spy.fallbacks == []
    assert spy.kinds[:layers] == ["dense"] * layers
    assert set(spy.kinds[layers:]) == {decode_kind}
    assert len(spy.kinds) >= layers * 12
    if decode_kind != "engine":
        assert len(spy.kinds) == layers * 12
    revert_model(model)
    assert "generate" not in vars(model)  # the instance-level generate wrapper is gone
    assert torch.equal(tiny.greedy(model, ids, mask, 12), stock)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_forward_logits_close_and_revert_exact(model_type, tiny, attention_spy):
    model = tiny.model(model_type, seed=2)
    ids, mask = tiny.batch(seed=3)
    before = tiny.logits(model, ids, mask)
    impl_before = model.config._attn_implementation
    assert impl_before == "sdpa"

    spy = attention_spy()
    accelerate_model(model)
    assert is_accelerated(model)
    ours = tiny.logits(model, ids, mask)
    assert spy.kernel_calls == model.config.num_hidden_layers and spy.fallbacks == []
    valid = mask.bool()  # logits at padding positions are meaningless (stock and ours differ there)
    torch.testing.assert_close(ours[valid], before[valid], atol=2e-5, rtol=1e-5)
    assert torch.isfinite(ours).all()

    assert revert_model(model) is model
    assert not is_accelerated(model)
    assert model.config._attn_implementation == impl_before
    assert torch.equal(tiny.logits(model, ids, mask), before)


def test_unpadded_batch_passes_no_mask(tiny, attention_spy):
    model = tiny.model("llama", seed=3)
    ids, mask = tiny.batch(seed=4, lengths=(7, 7))
    before = tiny.logits(model, ids, mask)
    spy = attention_spy()
    accelerate_model(model)
    torch.testing.assert_close(tiny.logits(model, ids, mask), before, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(tiny.logits(model, ids), before, atol=2e-5, rtol=1e-5)
    assert spy.kernel_masks == [None] * (2 * model.config.num_hidden_layers)


@pytest.mark.interpreter
def test_decode_with_cache_matches_full_forward(tiny, attention_spy):
    """Prefill, then a 1-token and a 3-token step over HF's DynamicCache (q_len < kv_len)."""
    from transformers import DynamicCache

    model = tiny.model("llama", seed=4)
    ids, mask = tiny.batch(seed=5, lengths=(12, 8, 4))
    full_ref = tiny.logits(model, ids, mask)
    spy = attention_spy(route_to_triton=True)
    accelerate_model(model)
    cache = DynamicCache(config=model.config)
    pieces = [
        tiny.logits(model, ids[:, start:end], mask[:, :end], **{tiny.cache_kwarg(model): cache}, use_cache=True)
        for start, end in [(0, 8), (8, 9), (9, 12)]
    ]
    chunked = torch.cat(pieces, dim=1)
    valid = mask.bool()
    torch.testing.assert_close(chunked[valid], full_ref[valid], atol=2e-5, rtol=1e-5)
    assert spy.fallbacks == [] and spy.kernel_calls == 3 * model.config.num_hidden_layers


def test_logs_active_path_once(tiny, caplog):
    caplog.set_level(logging.INFO, logger="hf_accel")
    model = tiny.model("llama")
    ids, mask = tiny.batch()
    accelerate_model(model)
    tiny.greedy(model, ids, mask, 3)
    tiny.greedy(model, ids, mask, 3)
    path_msgs = [r.getMessage() for r in caplog.records if "attention runs" in r.getMessage()]
    assert len(path_msgs) == 1
    assert "PyTorch" in path_msgs[0] or "Triton" in path_msgs[0]
    assert any("now uses attention" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fast_decode", [True, False])
def test_fast_decode_without_paged_cache_is_logged(tiny, caplog, fast_decode):
    """fast_decode runs on the paged cache: with paged_cache=False it is off, and said so when it was asked for
    (it is the default) instead of being dropped without a word."""
    caplog.set_level(logging.INFO, logger="hf_accel")
    model = tiny.model("llama")
    accelerate_model(model, paged_cache=False, fast_decode=fast_decode)
    said = [r.getMessage() for r in caplog.records if "fast_decode is off" in r.getMessage()]
    assert len(said) == (1 if fast_decode else 0)
    assert "generate" not in vars(model)  # transformers' own generate


# --- the real SmolLM2-135M-Instruct (float32) -------------------------------------------------------


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


@pytest.mark.slow
def test_smollm2_32_token_answer_identical(smollm2, attention_spy):
    model, tokenizer = smollm2
    enc = tokenizer(_chat(tokenizer, "Explain in a few sentences why the sky is blue during the day."),
                    return_tensors="pt")
    n = enc["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        stock = model.generate(**enc, **kwargs)
    assert stock.shape[1] - n == 32  # a full 32-token answer, no early stop

    spy = attention_spy()
    accelerate_model(model)
    try:
        with torch.no_grad():
            ours = model.generate(**enc, **kwargs)
    finally:
        revert_model(model)
    layers = model.config.num_hidden_layers
    assert spy.fallbacks == [] and spy.kinds[:layers] == ["dense"] * layers
    assert len(spy.calls) >= layers * 32  # prefill + 31 decode steps, every layer on hf-accel's attention
    answer = tokenizer.decode(ours[0, n:], skip_special_tokens=True)
    assert torch.equal(ours, stock), f"stock: {tokenizer.decode(stock[0, n:])!r}\nours: {answer!r}"
    assert "scatter" in answer.lower() or "light" in answer.lower()


@pytest.mark.slow
def test_smollm2_left_padded_batch_identical(smollm2, attention_spy, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    prompts = [
        _chat(tokenizer, "What is the capital of France?"),
        _chat(tokenizer, "Write one sentence about a cat who likes to sleep in the sun all afternoon."),
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    assert (enc["attention_mask"][:, 0] == 0).any()  # really left padded
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    alone_enc = tokenizer(prompts[0], return_tensors="pt")
    with torch.no_grad():
        stock = model.generate(**enc, **kwargs)
        alone = model.generate(**alone_enc, **kwargs)[0, alone_enc["input_ids"].shape[1]:]
    spy = attention_spy()
    accelerate_model(model)
    try:
        with torch.no_grad():
            ours = model.generate(**enc, **kwargs)
    finally:
        revert_model(model)
    assert spy.fallbacks == [] and spy.kernel_masks[0] == (2, tuple(enc["input_ids"].shape))
    assert torch.equal(ours, stock)
    # The padded prompt gets the answer it gets alone: the padding really is masked.
    n = enc["input_ids"].shape[1]
    assert tokenizer.decode(ours[0, n:], skip_special_tokens=True) == tokenizer.decode(alone, skip_special_tokens=True)
