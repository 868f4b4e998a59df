"""generate's fast decode path on CPU, token-identical to stock transformers in float32: EOS ids, lengths, pad ids.

Tiny random llama / qwen2 / mistral / qwen3 models get a left-padded batch of three prompts and EOS ids taken from
stock's own greedy output, so rows finish at different steps (finished rows are padded) and, with several EOS ids,
the whole call stops before ``max_new_tokens`` (the decode step as the model's modules, the CPU default; the fused
Triton step: test_fast_fused_step.py). Also: the default length, many EOS ids, EOS ids changing between calls or
given as numpy ints / tensors, non-int lengths, a prompt longer than max_length, no attention mask, a pad id
outside the vocabulary, token ids that are not ints, the random state after seeded sampling, and decoding that
stops right after the last EOS.
"""

from __future__ import annotations

import copy

import pytest
import torch
from fast_generate_helpers import CASES, FAST_MSG, MODEL_TYPES, _accelerated, _case, _generate, _messages, finish_steps

from hf_accel import accelerate_model


# --- greedy: token-identical to stock -----------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_greedy_identical_to_stock_module_step(model_type, case, tiny, decode_steps, hf_log):
    model, ids, mask, kwargs, stock = _case(tiny, model_type, case)
    ours = _accelerated(model)
    out = _generate(ours, ids, mask, tiny.PAD, **kwargs)
    assert torch.equal(out, stock), f"{model_type} {case}\nstock:\n{stock}\nours:\n{out}"
    assert _messages(hf_log, FAST_MSG) and not _messages(hf_log, "not used")
    assert len(decode_steps) >= stock.shape[1] - ids.shape[1] - 1 and not any(decode_steps)
    # A second call on the same engine (cache and step reused) gives the same tokens again.
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, **kwargs), stock)


def test_default_length_identical_to_stock(tiny):
    """No length option: transformers generates 20 new tokens (capped by max_position_embeddings)."""
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    stock = _generate(model, ids, mask, tiny.PAD, eos_token_id=None)
    assert stock.shape[1] == ids.shape[1] + 20
    assert torch.equal(_generate(_accelerated(model), ids, mask, tiny.PAD, eos_token_id=None), stock)


def test_many_eos_ids_identical_to_stock(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    free = tiny.greedy(model, ids, mask, 12)[:, ids.shape[1]:]
    eos = [int(free[0, 2])] + [t for t in range(3, 40) if t not in free.flatten().tolist()][:9]
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=eos)
    assert finish_steps(stock[:, ids.shape[1]:], eos)[0] == 2
    assert torch.equal(_generate(_accelerated(model), ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=eos),
                       stock)


def test_eos_ids_changing_between_calls_identical_to_stock(tiny):
    # the decode step keeps the EOS ids it wrote while they stay the same: calls with other ids, fewer ids and
    # none at all on one accelerated model must each see their own
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    free = tiny.greedy(model, ids, mask, 12)[:, ids.shape[1]:]
    ours = _accelerated(model)
    for eos in ([int(free[0, 2])], [int(free[1, 4]), int(free[2, 1])], [int(free[1, 4])], None, [int(free[0, 2])]):
        stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=eos)
        assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=eos), stock), eos


@pytest.mark.parametrize("spec", [None, "prompt_lookup"])
def test_eos_id_of_any_int_kind_identical_to_stock(spec, tiny, hf_log):
    # numpy ints and 0-d / 1-d tensors are EOS ids transformers takes; the fast path (plain and speculative) must
    # stop where stock stops with them, and pad ids may be numpy ints too
    import numpy as np

    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    free = tiny.greedy(model, ids, mask, 12)[:, ids.shape[1]:]
    eos = int(free[0, 2])
    ours = accelerate_model(copy.deepcopy(model), **({"speculative": spec} if spec else {}))
    for kind in (np.int64(eos), np.int32(eos), torch.tensor(eos), torch.tensor([eos, int(free[1, 4])])):
        stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=12, eos_token_id=kind)
        got = _generate(ours, ids, mask, np.int64(tiny.PAD), max_new_tokens=12, eos_token_id=kind)
        assert torch.equal(got, stock), kind
    assert _messages(hf_log, FAST_MSG)


def test_non_int_lengths_and_int_penalty_behave_as_stock(tiny, hf_log):
    # a float max_new_tokens runs as transformers runs it (its loop compares lengths: 3.5 gives 4 tokens); an
    # int repetition_penalty is refused by transformers, so it must be here too
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    ours = _accelerated(model)
    for n in (3.0, 3.5):
        stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=n, eos_token_id=None)
        assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=n, eos_token_id=None), stock), n
    assert _messages(hf_log, "max_new_tokens=3.5 is not an int")
    with pytest.raises(ValueError, match="penalty"):
        _generate(model, ids, mask, tiny.PAD, max_new_tokens=4, repetition_penalty=2)
    with pytest.raises(ValueError, match="penalty"):
        _generate(ours, ids, mask, tiny.PAD, max_new_tokens=4, repetition_penalty=2)


def test_prompt_longer_than_max_length_raises_like_stock(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    with pytest.raises(ValueError, match="max_length"):
        _generate(model, ids, mask, tiny.PAD, max_length=ids.shape[1])
    with pytest.raises(ValueError, match="max_length"):
        _generate(_accelerated(model), ids, mask, tiny.PAD, max_length=ids.shape[1])


def test_left_padded_prompt_without_attention_mask(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    assert (ids == tiny.PAD).any()
    kwargs = dict(max_new_tokens=8, eos_token_id=None)
    stock = _generate(model, ids, None, tiny.PAD, **kwargs)
    assert torch.equal(stock, _generate(model, ids, mask, tiny.PAD, **kwargs))  # the mask stock infers
    assert torch.equal(_generate(_accelerated(model), ids, None, tiny.PAD, **kwargs), stock)


# --- pad and token ids, the random state, the last EOS ------------------------------------------------------


@pytest.mark.parametrize("pad", [128, -1], ids=["vocab_size", "negative"])
@pytest.mark.parametrize("route", ["greedy", "sampling", "prepared_loop", "speculative"])
def test_pad_id_outside_the_vocabulary(route, pad, tiny, hf_log):
    """A pad id the embedding does not have (a pad token added to a tokenizer without resizing the model): a
    one-row call ends at its EOS as stock's does (the fast path runs a few steps past it, fed a valid id);
    a batch with a row that finishes early raises in transformers' loop, as stock's does."""
    model = tiny.model("llama", seed=6)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    plain = _generate(model, ids, torch.ones_like(ids), 0, max_new_tokens=12, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 3])  # the row ends after 4 of its 12 tokens
    options = dict(max_new_tokens=12, eos_token_id=eos)
    if route == "sampling":
        options.update(do_sample=True, top_k=1)
    if route == "prepared_loop":
        options.update(no_repeat_ngram_size=4)
    stock = _generate(model, ids, torch.ones_like(ids), pad, **options)
    assert stock.shape[1] < ids.shape[1] + 12, "the row must end early for the test to see steps past its end"
    ours = accelerate_model(copy.deepcopy(model), speculative="prompt_lookup" if route == "speculative" else None)
    assert torch.equal(_generate(ours, ids, torch.ones_like(ids), pad, **options), stock)
    assert _messages(hf_log, FAST_MSG)
    batch = torch.cat([ids, torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(5))])
    with pytest.raises(IndexError):
        _generate(model, batch, torch.ones_like(batch), pad, **options)
    with pytest.raises(IndexError):
        _generate(ours, batch, torch.ones_like(batch), pad, **options)
    assert _messages(hf_log, f"pad_token_id {pad} is outside the vocabulary of 128 tokens")


@pytest.mark.parametrize("sync_every", [16, None], ids=["check-every-16", "device-default"])
@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.interpreter)],
                         ids=["module-step", "fused-step"])
def test_seeded_sampling_leaves_the_random_state_as_stock(fused, sync_every, tiny):
    """Steps past the last EOS (the fast path learns of it some steps late: every 16 steps, as on a GPU without CUDA
    graphs; the device default checks every step on a CPU) draw random numbers too: the state after stock's draws
    is put back, so the next call and later draws are stock's as well."""
    model = tiny.model("llama", seed=8)
    ids, mask = tiny.batch(seed=9)
    ours = _accelerated(model, fused=fused)
    ours._hf_accel_engine.sync_every = sync_every
    results = []
    for m in (model, ours):
        torch.manual_seed(0)
        first = _generate(m, ids, mask, tiny.PAD, do_sample=True, max_new_tokens=30, eos_token_id=list(range(3, 60)))
        second = _generate(m, ids, mask, tiny.PAD, do_sample=True, max_new_tokens=6, eos_token_id=None)
        results.append((first, second, torch.rand(3)))
    (f0, s0, r0), (f1, s1, r1) = results
    assert f0.shape[1] < ids.shape[1] + 30 - 16, "every row must end early, more than 16 steps before the limit"
    assert torch.equal(f1, f0) and torch.equal(s1, s0) and torch.equal(r1, r0)


@pytest.mark.parametrize("options", [dict(eos_token_id="a"), dict(pad_token_id="x", eos_token_id=3)])
def test_token_ids_that_are_not_ints_raise_what_stock_raises(options, tiny, hf_log):
    model = tiny.model("llama")
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(Exception) as want:
        model.generate(ids, max_new_tokens=3, **options)
    with pytest.raises(type(want.value)) as got:
        accelerate_model(copy.deepcopy(model)).generate(ids, max_new_tokens=3, **options)
    assert str(got.value) == str(want.value)
    if "eos_token_id" in options and "pad_token_id" not in options:  # (a bad pad id fails transformers' own
        assert _messages(hf_log, "are not token ids")                 # preparation, before the fast path looks)


@pytest.mark.parametrize("sampled", [False, True])
def test_cpu_decoding_stops_right_after_the_last_eos(sampled, tiny, decode_steps):
    """On a CPU the host checks the unfinished flags after every step (the check waits for nothing): no decode
    step runs after the one that emits the last row's EOS; the tokens are stock's."""
    model = tiny.model("llama", seed=8)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(11))
    kw = {"do_sample": True, "top_k": 1} if sampled else {"do_sample": False}
    free = _generate(model, ids, torch.ones_like(ids), tiny.PAD, max_new_tokens=30, eos_token_id=None, **kw)
    new = free[0, ids.shape[1]:].tolist()
    at = next(i for i in range(3, 30) if new[i] not in new[:i])  # a token first emitted at new index `at`
    want = _generate(model, ids, torch.ones_like(ids), tiny.PAD, max_new_tokens=30, eos_token_id=new[at], **kw)
    ours = _accelerated(model)
    assert ours._hf_accel_engine.sync_interval("cpu") == 1
    decode_steps.clear()
    assert torch.equal(_generate(ours, ids, torch.ones_like(ids), tiny.PAD, max_new_tokens=30,
                                 eos_token_id=new[at], **kw), want)
    assert len(decode_steps) == at  # the prefill gives new token 0, step s new token s
