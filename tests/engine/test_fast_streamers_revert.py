"""generate's fast decode path keeps streamers and pipelines working, and revert_model gives the stock ``generate``
back (tiny random models, float32, CPU); the real SmolLM2 (slow) checks a left-padded chat batch, ``TextStreamer``
and ``pipeline``. See test_sampling.py for the sampling distribution.
"""

from __future__ import annotations

import pytest
import torch
from fast_generate_helpers import FAST_MSG, _accelerated, _case, _generate, _messages, finish_steps
from transformers import TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

from hf_accel import accelerate_model, revert_model


# --- streamers ---------------------------------------------------------------------------------------------


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value):
        assert self.ends == 0, "put after end"
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("do_sample", [False, True])
def test_streamer_gets_prompt_then_each_token_then_end(do_sample, tiny, decode_steps, hf_log):
    model, ids, mask, kwargs, stock = _case(tiny, "llama", "all_rows_finish")
    if do_sample:
        kwargs.update(do_sample=True, top_k=5)
    streams = []
    for m in (model, _accelerated(model)):
        streamer = _Recorder()
        torch.manual_seed(0)
        out = _generate(m, ids, mask, tiny.PAD, streamer=streamer, **kwargs)
        assert streamer.ends == 1
        assert torch.equal(streamer.puts[0], ids)
        streamed = torch.stack(streamer.puts[1:], 1)
        assert torch.equal(streamed, out[:, ids.shape[1]:])  # one put per generated token, as returned
        streams.append(streamed)
    assert _messages(hf_log, FAST_MSG) and decode_steps
    if do_sample:
        assert streams[1].shape[0] == streams[0].shape[0] == 3
    else:
        assert torch.equal(streams[0], stock[:, ids.shape[1]:]) and torch.equal(streams[1], streams[0])


# --- revert -------------------------------------------------------------------------------------------------


def test_revert_after_fast_path_restores_stock_generate(tiny, decode_steps, hf_log):
    model = tiny.model("mistral")
    ids, mask = tiny.batch(seed=3)
    kwargs = dict(max_new_tokens=6, eos_token_id=None)
    stock = _generate(model, ids, mask, tiny.PAD, **kwargs)
    attn = model.config._attn_implementation
    accelerate_model(model)
    engine = model._hf_accel_engine
    assert torch.equal(_generate(model, ids, mask, tiny.PAD, **kwargs), stock)
    assert engine.steps and engine.cache is not None and len(decode_steps) == 5

    revert_model(model)
    assert "generate" not in vars(model) and model.generate.__func__ is type(model).generate
    assert not hasattr(model, "_hf_accel_engine")
    assert engine.steps == {} and engine.cache is None  # step buffers and KV pools released
    assert model.config._attn_implementation == attn
    hf_log.clear()
    assert torch.equal(_generate(model, ids, mask, tiny.PAD, **kwargs), stock)
    assert len(decode_steps) == 5 and not _messages(hf_log, "")


# --- the real SmolLM2 -------------------------------------------------------------------------------------


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


@pytest.mark.slow
def test_smollm2_left_padded_chat_batch_identical(smollm2, decode_steps, hf_log, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    prompts = [_chat(tokenizer, "What is the capital of France?"),
               _chat(tokenizer, "Write two sentences about a cat who likes to sleep in the sun all afternoon.")]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    assert (enc["attention_mask"][:, 0] == 0).any()
    kwargs = dict(max_new_tokens=28, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        stock = model.generate(**enc, **kwargs)
    n = enc["input_ids"].shape[1]
    steps = finish_steps(stock[:, n:], [tokenizer.eos_token_id])
    assert steps[0] is not None and steps[0] < 27 and steps[1] is None  # EOS in the middle of the batch
    accelerate_model(model)
    try:
        with torch.no_grad():
            ours = model.generate(**enc, **kwargs)
    finally:
        revert_model(model)
    assert _messages(hf_log, FAST_MSG) and len(decode_steps) == 27
    assert torch.equal(ours, stock), "\n".join(tokenizer.batch_decode(torch.cat([stock, ours])[:, n:]))


@pytest.mark.slow
def test_smollm2_text_streamer_and_pipeline(smollm2, decode_steps, hf_log, capsys):
    model, tokenizer = smollm2
    question = "Name three colors of the rainbow."
    enc = tokenizer(_chat(tokenizer, question), return_tensors="pt")
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    messages = [{"role": "user", "content": question}]

    def run():
        with torch.no_grad():
            out = model.generate(**enc, **kwargs, streamer=TextStreamer(tokenizer, skip_prompt=True,
                                                                        skip_special_tokens=True))
        printed = capsys.readouterr().out
        steps_before = len(decode_steps)
        # device: the pipeline would move the shared CPU model to a GPU when one is present
        chat = pipeline("text-generation", model=model, tokenizer=tokenizer, device=model.device)
        reply = chat(messages, **kwargs)[0]["generated_text"][-1]["content"]
        return out, printed, reply, len(decode_steps) - steps_before

    stock, stock_printed, stock_reply, _ = run()
    assert not decode_steps
    accelerate_model(model)
    try:
        ours, printed, reply, pipeline_steps = run()
    finally:
        revert_model(model)
    # Both the streamed generate and the pipeline's generate ran the fast path's decode steps.
    assert _messages(hf_log, FAST_MSG) and pipeline_steps > 0 and len(decode_steps) > pipeline_steps
    assert torch.equal(ours, stock)
    text = tokenizer.decode(ours[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert printed == stock_printed and printed.strip() == text.strip() and text.strip()
    assert reply == stock_reply and reply.strip()
