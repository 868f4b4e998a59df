"""Calls with transformers' logits processors, stopping criteria or per-step outputs on the fast path.

Such calls run transformers' own ``generate`` preparation with hf-accel's decoding method as its
``custom_generate`` (``FastEngine.decode_prepared``): the processors and criteria are the very objects
transformers builds for the call, the forward passes are the fast path's paged prefill and decode steps.
Float32 tiny models, a left-padded batch whose rows end at different steps: tokens (and scores / logits where
asked) equal stock transformers', greedy and seeded sampling.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_accel import accelerate_model
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.engine.call_options import output_cache
from hf_accel.integrations.generate import last_cache_stats

PREPARED_MSG = "generate runs the fast decode path inside transformers' generate"
MAX_NEW = 10


def _messages(caplog, needle):
    return [r.getMessage() for r in caplog.records if r.name == "hf_accel" and needle in r.getMessage()]


class _BanToken(LogitsProcessor):
    """Bans one token at every step (a caller's own processor)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        return scores.masked_fill(torch.arange(scores.shape[-1], device=scores.device) == self.token, float("-inf"))


class _StopAfter(StoppingCriteria):
    """Stops a row once it holds ``n`` more tokens than the prompt of ``prompt_len`` (a caller's criterion)."""

    def __init__(self, prompt_len: int, n: int):
        self.end = prompt_len + n

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] >= self.end
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


# name -> (options, whether the option must change stock's plain greedy tokens on these prompts)
GREEDY = {
    "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), True),
    "bad_words_ids": (dict(bad_words_ids=[[11], [12, 13]]), False),
    "suppress_tokens": (dict(suppress_tokens=[20, 21, 22], begin_suppress_tokens=[30]), False),
    "sequence_bias": (dict(sequence_bias={(40,): 6.0}), True),
    "forced_eos_token_id": (dict(forced_eos_token_id=5), True),
    "repetition_penalty_padded": (dict(repetition_penalty=1.8), True),
    "renormalize_logits": (dict(renormalize_logits=True, remove_invalid_values=True), False),
    "exponential_decay": (dict(exponential_decay_length_penalty=(2, 1.5)), False),
    "logits_processor": ("ban", True),
    "stopping_criteria": ("stop", True),
    "prefix_allowed_tokens_fn": (dict(prefix_allowed_tokens_fn=lambda row, ids: list(range(30, 90))), True),
}
SAMPLING = {
    "min_p": dict(min_p=0.2),
    "typical_p": dict(typical_p=0.7),
    "epsilon_cutoff": dict(epsilon_cutoff=0.02, temperature=0.8),
    "eta_cutoff": dict(eta_cutoff=0.05, top_k=30),
    "num_return_sequences": dict(num_return_sequences=2, no_repeat_ngram_size=3),
}


def _options(spec, prompt_len, first_token: int):
    if spec == "ban":  # the token stock's greedy output starts the first row with
        return dict(logits_processor=LogitsProcessorList([_BanToken(first_token)]))
    if spec == "stop":
        return dict(stopping_criteria=StoppingCriteriaList([_StopAfter(prompt_len, 4)]))
    return dict(spec)


def _run(model, ids, mask, seed=0, **kwargs):
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


def _model(tiny, model_type, seed=1):
    model = tiny.model(model_type, seed=seed)
    model.generation_config.pad_token_id = tiny.PAD
    return model


def _plain(model, ids, mask):
    """Stock's greedy new tokens without an EOS [batch, MAX_NEW]."""
    return _run(model, ids, mask, eos_token_id=None)[:, ids.shape[1]:]


def _eos_mid_batch(model, ids, mask):
    """An EOS id that stock's greedy output emits in some row before the end (rows finish at other steps)."""
    return int(_plain(model, ids, mask)[0, 3])


@pytest.mark.parametrize("name", list(GREEDY))
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_greedy_with_processors_equals_stock(model_type, name, tiny, hf_log, decode_steps):
    model = _model(tiny, model_type)
    ids, mask = tiny.batch(seed=3)
    plain = _plain(model, ids, mask)
    eos = int(plain[0, 3])
    spec, changes = GREEDY[name]
    options = dict(_options(spec, ids.shape[1], int(plain[0, 0])), eos_token_id=eos)
    stock = _run(model, ids, mask, **options)
    if changes:  # the option acts on these prompts: a run without it would not pass for one with it
        assert not torch.equal(stock, _run(model, ids, mask, eos_token_id=eos)), name
    ours = accelerate_model(copy.deepcopy(model))
    out = _run(ours, ids, mask, **options)
    assert torch.equal(out, stock), f"{name}\nstock:\n{stock}\nours:\n{out}"
    assert _messages(hf_log, PREPARED_MSG) and decode_steps
    assert last_cache_stats(ours)["blocks_allocated"] > 0


@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampling_with_processors_equals_stock_for_a_seed(name, tiny, hf_log, decode_steps):
    model = _model(tiny, "llama", seed=2)
    ids, mask = tiny.batch(seed=4)
    options = dict(SAMPLING[name], do_sample=True, eos_token_id=_eos_mid_batch(model, ids, mask))
    stock = _run(model, ids, mask, seed=5, **options)
    ours = accelerate_model(copy.deepcopy(model))
    out = _run(ours, ids, mask, seed=5, **options)
    assert torch.equal(out, stock), f"{name}\nstock:\n{stock}\nours:\n{out}"
    assert _messages(hf_log, PREPARED_MSG) and decode_steps


@pytest.mark.parametrize("do_sample", [False, True])
def test_scores_and_logits_equal_stock(do_sample, tiny, hf_log, decode_steps):
    """``output_scores`` / ``output_logits``: one processed and one raw [batch, vocab] float32 tensor per step, as
    stock's; the returned cache is a PagedCache."""
    model = _model(tiny, "qwen3")
    ids, mask = tiny.batch(seed=5)
    options = dict(output_scores=True, output_logits=True, return_dict_in_generate=True, do_sample=do_sample,
                   eos_token_id=_eos_mid_batch(model, ids, mask), top_k=10)
    stock = _run(model, ids, mask, seed=2, **options)
    ours = accelerate_model(copy.deepcopy(model))
    out = _run(ours, ids, mask, seed=2, **options)
    assert torch.equal(out.sequences, stock.sequences)
    for name in ("scores", "logits"):
        got, want = getattr(out, name), getattr(stock, name)
        assert len(got) == len(want) == out.sequences.shape[1] - ids.shape[1]
        for a, b in zip(got, want):
            assert a.dtype == b.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert isinstance(output_cache(out), PagedCache) and _messages(hf_log, PREPARED_MSG) and decode_steps


@pytest.mark.interpreter
def test_fused_triton_step_with_a_processor_equals_stock(tiny, hf_log, decode_steps):
    """The fused decode step (Triton kernels under the interpreter) in the prepared loop."""
    model = _model(tiny, "llama")
    ids, mask = tiny.batch(seed=3)
    stock = _run(model, ids, mask, max_new_tokens=5, no_repeat_ngram_size=2)
    ours = accelerate_model(copy.deepcopy(model))
    ours._hf_accel_engine.fused = True
    out = _run(ours, ids, mask, max_new_tokens=5, no_repeat_ngram_size=2)
    assert torch.equal(out, stock)
    assert decode_steps and all(decode_steps)


def test_streamer_gets_what_stock_gives_it(tiny):
    class Recorder(BaseStreamer):
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(value.tolist())

        def end(self):
            self.calls.append("end")

    model = _model(tiny, "llama")
    ids, mask = tiny.batch(seed=3, lengths=(9,))
    recorded = []
    for m in (model, accelerate_model(copy.deepcopy(model))):
        streamer = Recorder()
        _run(m, ids, mask, streamer=streamer, no_repeat_ngram_size=2, eos_token_id=None)
        recorded.append(streamer.calls)
    assert recorded[0] == recorded[1] and recorded[0][-1] == "end" and len(recorded[0]) == MAX_NEW + 2


def test_multi_turn_with_a_processor_continues_the_paged_cache(tiny, hf_log):
    """A turn with a processor returns a PagedCache and continues one passed back, as stock's DynamicCache."""
    model = _model(tiny, "llama")
    ids, mask = tiny.batch(seed=3, lengths=(9,))
    user = torch.randint(3, 100, (1, 4), generator=torch.Generator().manual_seed(9))
    options = dict(no_repeat_ngram_size=2, eos_token_id=None, return_dict_in_generate=True)
    results = []
    for m in (model, accelerate_model(copy.deepcopy(model))):
        first = _run(m, ids, mask, **options)
        turn = torch.cat([first.sequences, user], dim=1)
        second = _run(m, turn, torch.ones_like(turn), **{tiny.cache_kwarg(m): output_cache(first)}, **options)
        results.append((first.sequences, second.sequences, output_cache(second)))
    (s1, s2, _), (o1, o2, cache) = results
    assert torch.equal(o1, s1) and torch.equal(o2, s2)
    assert isinstance(cache, PagedCache) and cache.get_seq_length() == o2.shape[1] - 1


def test_speculative_model_runs_the_prepared_loop_plain(tiny, hf_log):
    model = _model(tiny, "llama")
    ids, mask = tiny.batch(seed=3)
    stock = _run(model, ids, mask, no_repeat_ngram_size=2)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup")
    assert torch.equal(_run(ours, ids, mask, no_repeat_ngram_size=2), stock)
    assert _messages(hf_log, "speculative decoding not used: generation option no_repeat_ngram_size=2")
    assert _messages(hf_log, PREPARED_MSG)


@pytest.mark.parametrize("options", [dict(stop_strings=["ab"]), dict(guidance_scale=2.0),
                                     dict(output_attentions=True, return_dict_in_generate=True)])
def test_options_the_prepared_loop_cannot_take_keep_transformers_loop(options, tiny, hf_log, decode_steps):
    """Stop strings without a tokenizer (transformers raises its own error), classifier-free guidance (its processor
    runs the model) and attention outputs: transformers' loop, as before."""
    model = _model(tiny, "llama")
    ids, mask = tiny.batch(seed=3)
    ours = accelerate_model(copy.deepcopy(model))
    try:
        _run(ours, ids, mask, **options)
    except ValueError as e:  # stop_strings without a tokenizer: transformers' own error
        assert "tokenizer" in str(e)
    assert not _messages(hf_log, PREPARED_MSG) and not decode_steps


@pytest.mark.slow
def test_stop_strings_with_a_tokenizer_on_the_embedded_model(smollm2, hf_log, decode_steps):
    """``stop_strings=`` with ``tokenizer=`` (transformers' StopStringCriteria, built for the prepared loop because
    transformers passes no tokenizer to a custom decoding method): the answer stops where stock's stops."""
    from hf_accel import revert_model

    model, tokenizer = smollm2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to ten in words."}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    options = dict(max_new_tokens=24, do_sample=False, stop_strings=["3."], tokenizer=tokenizer,
                   pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        unstopped = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        stock = model.generate(**inputs, **options)
    assert stock.shape[1] < unstopped.shape[1], "the stop string does not occur: the test would not see a stop"
    assert tokenizer.decode(stock[0, inputs["input_ids"].shape[1]:]).rstrip().endswith("3.")
    try:
        accelerate_model(model)
        with torch.no_grad():
            out = model.generate(**inputs, **options)
    finally:
        revert_model(model)
    assert torch.equal(out, stock)
    assert _messages(hf_log, PREPARED_MSG) and decode_steps


@pytest.mark.parametrize("route", ["direct", "prepared_loop", "speculative"])
def test_outputs_are_ordinary_tensors_usable_under_autograd(route, tiny):
    """What generate returns can be fed to a forward tracked by autograd (scoring samples for a loss, as RL
    fine-tuning scripts do) and written into, as stock's output: not inference tensors."""
    model = _model(tiny, "llama")
    ids, mask = tiny.batch(seed=3)
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup" if route == "speculative" else None)
    options = dict(no_repeat_ngram_size=2, return_dict_in_generate=True, output_scores=True) \
        if route == "prepared_loop" else {}
    out = _run(ours, ids, mask, **options)
    sequences = out.sequences if route == "prepared_loop" else out
    tensors = [sequences, *(out.scores if route == "prepared_loop" else ())]
    assert not any(t.is_inference() for t in tensors)
    stock = _model(tiny, "llama")  # a trainable copy: its forward is tracked
    stock.train()
    loss = stock(input_ids=sequences).logits.float().log_softmax(-1).mean()
    loss.backward()
    assert stock.lm_head.weight.grad is not None
    sequences[:, -1] = tiny.PAD  # writable outside inference mode


def _char_tokenizer(vocab: int = 128):
    """One character per token id (a tokenizer for stop strings on tiny models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel(vocab={_char(i): i for i in range(vocab)}, unk_token=_char(0)))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token=_char(0))


def _char(i: int) -> str:
    return chr(97 + i) if i < 26 else chr(0x100 + i)


@pytest.mark.parametrize("own_criterion", [False, True], ids=["stop_strings", "with-callers-StopStringCriteria"])
def test_stop_strings_on_a_tiny_model_stop_where_stock_stops(own_criterion, tiny, hf_log):
    """stop_strings with tokenizer= run the prepared loop; with a caller's own StopStringCriteria as well, transformers
    lets the caller's replace the one of stop_strings (only its strings stop the call): that call keeps
    transformers' loop, as the prepared loop would stop on both."""
    from transformers import StopStringCriteria

    model = _model(tiny, "llama", seed=3)
    ids = torch.tensor([[40, 41, 42, 43]])
    tok = _char_tokenizer()
    new = _plain(model, ids, torch.ones_like(ids))[0].tolist()
    options = dict(max_new_tokens=MAX_NEW, eos_token_id=None, tokenizer=tok, stop_strings=[_char(new[1])])
    if own_criterion:
        options["stopping_criteria"] = StoppingCriteriaList([StopStringCriteria(tok, [_char(new[5])])])
    stock = _run(model, ids, torch.ones_like(ids), **options)
    if own_criterion:  # the caller's string stops it, later than stop_strings' would have
        assert ids.shape[1] + 2 < stock.shape[1] < ids.shape[1] + MAX_NEW
    else:
        assert stock.shape[1] == ids.shape[1] + 2
    ours = accelerate_model(copy.deepcopy(model))
    assert torch.equal(_run(ours, ids, torch.ones_like(ids), **options), stock)
    assert bool(_messages(hf_log, PREPARED_MSG)) is not own_criterion


def test_a_prompt_ending_in_the_pad_id_without_a_mask_gets_transformers_inferred_mask(tiny, hf_log):
    """Without an attention_mask transformers infers one from the pad id: a prompt whose last token is the pad id
    gets a 0 there. The fast path assumes left padding; such calls keep transformers' loop (both routes)."""
    model = _model(tiny, "llama", seed=4)
    ids = torch.tensor([[40, 41, 42, 5], [7, 8, 9, 10]])
    for extra in ({}, dict(no_repeat_ngram_size=3)):
        options = dict(max_new_tokens=6, do_sample=False, pad_token_id=5, eos_token_id=None, **extra)
        with torch.no_grad():
            stock = model.generate(ids, **options)
            ours = accelerate_model(copy.deepcopy(model)).generate(ids, **options)
        assert torch.equal(ours, stock)
    assert _messages(hf_log, "right-padded batch")


def test_synced_gpus_keeps_transformers_loop(tiny):
    """synced_gpus=True (DeepSpeed ZeRO-3 / FSDP: every rank steps until all have finished) is transformers' loop's;
    without a process group it raises there, as stock does."""
    model = _model(tiny, "llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError) as want:
        model.generate(ids, max_new_tokens=4, synced_gpus=True)
    with pytest.raises(ValueError) as got:
        accelerate_model(copy.deepcopy(model)).generate(ids, max_new_tokens=4, synced_gpus=True)
    assert str(got.value) == str(want.value)


def test_output_scores_without_return_dict_takes_the_direct_path(tiny, hf_log, decode_steps):
    """transformers returns scores only with return_dict_in_generate: without it the flag changes nothing, and the
    call decodes on the direct fast path (not inside transformers' generate)."""
    model = _model(tiny, "llama")
    ids, mask = tiny.batch(seed=3)
    stock = _run(model, ids, mask, output_scores=True, output_logits=True)
    ours = accelerate_model(copy.deepcopy(model))
    assert torch.equal(_run(ours, ids, mask, output_scores=True, output_logits=True), stock)
    assert not _messages(hf_log, PREPARED_MSG) and _messages(hf_log, "generate runs the fast decode path") and decode_steps
