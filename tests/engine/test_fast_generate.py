"""generate's fast decode path on CPU: token-identical to stock transformers in float32, falls back (with
the reason logged) where it does not apply, keeps streamers and pipelines working, and revert_model
gives the stock ``generate`` back.

Tiny random llama / qwen2 / mistral / qwen3 models get a left-padded batch of three prompts and EOS ids
taken from stock's own greedy output, so rows finish at different steps (finished rows are padded) and,
with several EOS ids, the whole call stops before ``max_new_tokens``. The decode step runs as the model's
modules (the CPU default) and as the fused Triton step (``engine.fused = True``, Triton interpreter);
the real SmolLM2 checks a chat batch, ``TextStreamer`` and ``pipeline``. See test_sampling.py for the
sampling distribution.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

from hf_accel import accelerate_model, revert_model

FAST_MSG = "generate runs the fast decode path"
MODEL_TYPES = ["llama", "qwen2", "mistral", "qwen3"]


def _messages(caplog, needle):
    return [r.getMessage() for r in caplog.records if r.name == "hf_accel" and needle in r.getMessage()]


def _generate(model, ids, mask, pad, **kwargs):
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **kwargs)


def _accelerated(model, fused=False):
    ours = accelerate_model(copy.deepcopy(model))
    if fused:
        ours._hf_accel_engine.fused = True
    return ours


def finish_steps(generated: torch.Tensor, eos: list[int]) -> list[int | None]:
    """Per row: the step at which greedy decoding emits one of ``eos`` first (None: never)."""
    steps = []
    for row in generated.tolist():
        hits = [t for t, token in enumerate(row) if token in eos]
        steps.append(hits[0] if hits else None)
    return steps


def pick_eos(generated: torch.Tensor, at: dict[int, int]) -> list[int]:
    """EOS ids, taken from stock's own output ``generated`` (no EOS, [batch, steps]), that end row ``r``
    at step ``at[r]`` (or the nearest later step where no earlier-chosen id interferes)."""
    eos: list[int] = []
    wanted: dict[int, int] = {}
    for row, first in at.items():
        for t in range(first, generated.shape[1]):
            candidate = eos + [int(generated[row, t])]
            steps = finish_steps(generated, candidate)
            if steps[row] == t and all(steps[r] == s for r, s in wanted.items()):
                eos, wanted[row] = candidate, t
                break
        else:
            raise AssertionError(f"no EOS id ends row {row}")
    return eos


# --- greedy: token-identical to stock -----------------------------------------------------------------

# name -> (EOS rows/steps, generate options; WIDTH is replaced by the padded prompt width)
CASES = {
    # row 0 ends at step 2, the other rows run to the end: finished rows are padded
    "max_new_tokens": ({0: 2}, dict(max_new_tokens=12)),
    # every row ends, at steps 2 / 5 / 8 or so: the call stops before max_new_tokens (surplus steps trimmed)
    "all_rows_finish": ({0: 2, 1: 5, 2: 8}, dict(max_new_tokens=20)),
    "max_length": ({0: 2}, dict(max_length="WIDTH+9")),
    # the EOS id of step 2 is suppressed until 6 new tokens: transformers' processor on the host
    "min_new_tokens": ({0: 2}, dict(max_new_tokens=12, min_new_tokens=6)),
    "min_length": ({0: 2}, dict(max_new_tokens=12, min_length="WIDTH+6")),
}


def _case(tiny, model_type, case):
    """(model, ids, mask, generate kwargs with eos_token_id, stock output)."""
    model = tiny.model(model_type)
    ids, mask = tiny.batch(seed=1)
    width = ids.shape[1]
    eos_at, options = CASES[case]
    kwargs = {k: (width + int(v.split("+")[1]) if isinstance(v, str) else v) for k, v in options.items()}
    free = tiny.greedy(model, ids, mask, 20)[:, width:]  # stock, EOS suppressed: what each row would say
    eos = pick_eos(free, eos_at)
    kwargs["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    stock = _generate(model, ids, mask, tiny.PAD, **kwargs)
    # The EOS really is in the middle: rows finish at different steps (None: not within the limit).
    steps = finish_steps(stock[:, width:], eos)
    if case.startswith("min_"):  # row 0's EOS at step 2 was suppressed
        assert steps[0] is None or steps[0] >= 6, steps
    else:
        assert steps[0] == 2 and len(set(steps)) > 1, steps
    if case == "all_rows_finish":
        assert None not in steps and len(set(steps)) == 3 and stock.shape[1] == width + max(steps) + 1 < width + 16
    return model, ids, mask, kwargs, stock


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


FUSED = [(t, "max_new_tokens") for t in MODEL_TYPES] + [("qwen3", "min_new_tokens")]


@pytest.mark.interpreter
@pytest.mark.parametrize(("model_type", "case"), FUSED)
def test_greedy_identical_to_stock_fused_step(model_type, case, tiny, decode_steps, monkeypatch):
    """The fused Triton step (interpreter): in-graph greedy, and the host loop with a processor; the
    prompt is prefilled padded to a bucketed length (16 here)."""
    from hf_accel.engine.fast_generate import FastEngine

    bucketed = []
    original = FastEngine._prefill_bucketed
    monkeypatch.setattr(FastEngine, "_prefill_bucketed",
                        lambda self, *a: bucketed.append(a[-1]) or original(self, *a))
    model, ids, mask, kwargs, stock = _case(tiny, model_type, case)
    kwargs["max_new_tokens"] = 7  # the interpreter is slow
    stock = _generate(model, ids, mask, tiny.PAD, **kwargs)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, **kwargs)
    assert torch.equal(out, stock), f"{model_type} {case}\nstock:\n{stock}\nours:\n{out}"
    assert len(decode_steps) == 6 and all(decode_steps)
    assert all(step.fused for step in ours._hf_accel_engine.steps.values())
    # Decode steps (<= 16 rows) ran the fused norm/linear/SwiGLU kernels, not RMSNorm + F.linear.
    assert all(step.small_linear for step in ours._hf_accel_engine.steps.values())
    assert bucketed == [ids.shape[1]] and ids.shape[1] not in (16, 32)  # padded: 11 -> 16


def test_prefill_buckets():
    """Prompts are padded to a power of two >= 16 or 1.5 times one (at most 1.5x their length)."""
    from hf_accel.engine import fast_generate as fg

    got = {n: fg.prefill_bucket(n) for n in (1, 16, 17, 24, 25, 33, 48, 49, 200, 257, 324, 384, 385, 1500)}
    assert got == {1: 16, 16: 16, 17: 24, 24: 24, 25: 32, 33: 48, 48: 48, 49: 64, 200: 256, 257: 384, 324: 384,
                   384: 384, 385: 512, 1500: 1536}
    for n in range(1, 3000):
        assert n <= fg.prefill_bucket(n) <= max(16, 1.5 * n)


@pytest.mark.interpreter
@pytest.mark.parametrize("half_steps", [True, False], ids=["bucket-24", "bucket-32"])
def test_fused_prefill_in_a_half_step_bucket_identical_to_stock(tiny, monkeypatch, half_steps):
    """A 20-token prompt (batch of 2, left padded) prefilled padded to 24 tokens (32 without the 1.5x
    buckets) through the fused step: the padding rows' K/V land in slots the decode steps overwrite."""
    from hf_accel.engine import fast_generate as fg

    monkeypatch.setattr(fg, "PREFILL_HALF_STEPS", half_steps)
    lengths = []
    original = fg.FastEngine._prefill_bucketed
    monkeypatch.setattr(fg.FastEngine, "_prefill_bucketed",
                        lambda self, *a: lengths.append(fg.prefill_bucket(a[-1])) or original(self, *a))
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=3, lengths=(20, 13))
    kwargs = {"max_new_tokens": 5, "eos_token_id": None}
    stock = _generate(model, ids, mask, tiny.PAD, **kwargs)
    out = _generate(_accelerated(model, fused=True), ids, mask, tiny.PAD, **kwargs)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert lengths == [24 if half_steps else 32]


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


# --- fallbacks: stock tokens, reason logged ---------------------------------------------------------------


class _BanToken(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.masked_fill(torch.arange(scores.shape[-1]) == 5, float("-inf"))


FALLBACKS = {
    # name -> (generate options, logged reason)
    "beams": (dict(num_beams=2), "generate keeps transformers' cache: beam search"),
    # (logits processors, stopping criteria and per-step scores run the fast path inside transformers' generate:
    # test_prepared_loop.py; these cannot)
    "guidance_scale": (dict(guidance_scale=1.5), "not used: generation option guidance_scale=1.5"),
    "output_hidden_states": (dict(output_hidden_states=True, return_dict_in_generate=True),
                             "not used: unsupported generate arguments: output_hidden_states"),
    "use_cache_false": (dict(use_cache=False), "generate keeps transformers' cache: use_cache=False"),
    "own_cache": ({}, "generate keeps transformers' cache: the caller passed its own cache"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallback_gives_stock_tokens_and_logs_why(name, tiny, hf_log, decode_steps):
    model = tiny.model("qwen3")
    ids, mask = tiny.batch(seed=2)
    options, reason = FALLBACKS[name]
    kwargs = dict(max_new_tokens=8, eos_token_id=None, **options)

    def run(m):
        call = dict(kwargs)
        if name == "own_cache":
            call[tiny.cache_kwarg(m)] = DynamicCache(config=m.config)
        torch.manual_seed(0)
        return _generate(m, ids, mask, tiny.PAD, **call)

    stock = run(model)
    ours = _accelerated(model)
    out = run(ours)
    if name == "output_hidden_states":
        assert torch.equal(out.sequences, stock.sequences)
        assert len(out.hidden_states) == len(stock.hidden_states) == 8
    else:
        assert torch.equal(out, stock), f"{name}\nstock:\n{stock}\nours:\n{out}"
    assert _messages(hf_log, reason), [r.getMessage() for r in hf_log.records]
    assert not _messages(hf_log, FAST_MSG) and decode_steps == []


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_num_return_sequences_samples_on_the_fast_path_as_stock(model_type, tiny, hf_log, decode_steps):
    """Sampling with num_return_sequences = 3 over a left-padded batch decodes n rows per prompt on the fast path
    (rows repeated in place, transformers' order): the same samples as stock for the same seed, EOS rows padded."""
    model = tiny.model(model_type, seed=4)
    ids, mask = tiny.batch(seed=6)
    kwargs = dict(max_new_tokens=9, do_sample=True, num_return_sequences=3, top_k=20, temperature=1.3,
                  eos_token_id=[5, 9])

    def run(m):
        torch.manual_seed(11)
        return _generate(m, ids, mask, tiny.PAD, **kwargs)

    stock = run(model)
    ours = _accelerated(model)
    out = run(ours)
    assert out.shape[0] == 3 * ids.shape[0] and torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(3, 0))
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert (out[:, ids.shape[1]:] == tiny.PAD).any(), "no row ended early: the EOS bookkeeping is not exercised"
    assert _messages(hf_log, FAST_MSG) and decode_steps


def test_num_return_sequences_without_sampling_raises_as_stock(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=6)
    with pytest.raises(ValueError, match="num_return_sequences") as want:
        _generate(model, ids, mask, tiny.PAD, max_new_tokens=4, num_return_sequences=2)
    ours = _accelerated(model)
    with pytest.raises(ValueError, match="num_return_sequences") as got:
        _generate(ours, ids, mask, tiny.PAD, max_new_tokens=4, num_return_sequences=2)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("do_sample", [False, True])
def test_repetition_penalty_on_the_fast_path_matches_stock(do_sample, tiny, hf_log, decode_steps):
    """Unpadded rows with repetition_penalty decode on the fast path (the penalty as transformers' processor,
    first in the list), token-identical to stock: greedy, and sampling with the same seed."""
    model = tiny.model("llama")
    ids, _ = tiny.batch(seed=5, lengths=(9, 9))
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=10, eos_token_id=None, repetition_penalty=1.8)
    if do_sample:
        kwargs.update(do_sample=True, top_k=8, temperature=0.9)

    def run(m):
        torch.manual_seed(0)
        return _generate(m, ids, mask, tiny.PAD, **kwargs)

    stock = run(model)
    ours = _accelerated(model)
    out = run(ours)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert _messages(hf_log, FAST_MSG) and decode_steps
    # the penalty changed the answer: the call without it differs
    torch.manual_seed(0)
    no_penalty = _generate(model, ids, mask, tiny.PAD, **{**kwargs, "repetition_penalty": 1.0})
    assert not torch.equal(no_penalty, stock)


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


def test_an_answer_whose_cache_does_not_fit_runs_on_a_pool_of_what_fits(tiny, decode_steps, hf_log, monkeypatch):
    """max_new_tokens far beyond what device memory holds (here free memory is set to 40 blocks): the fast path, which reserves the whole answer, declines; transformers' loop runs on a
    pool of the blocks that fit, with stock's tokens where the rows stop in time, and a clear OutOfBlocksError
    where they do not."""
    import hf_accel.cache.paged_cache as paged_cache
    from hf_accel.cache.block_manager import OutOfBlocksError
    from hf_accel.integrations.generate import last_cache_stats

    model, ids, mask, kwargs, stock = _case(tiny, "llama", "all_rows_finish")
    ours = _accelerated(model)
    monkeypatch.setattr(paged_cache, "blocks_that_fit", lambda device, block_bytes, fraction=0.9: 40)
    kwargs["max_new_tokens"] = 100_000
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, **kwargs), stock)
    assert _messages(hf_log, "does not fit in free device memory (40 blocks)") and not decode_steps
    assert _messages(hf_log, "the PagedCache gets 40 blocks")
    assert last_cache_stats(ours)["num_blocks"] == 40
    with pytest.raises(OutOfBlocksError, match="out of blocks"):
        _generate(ours, ids, mask, tiny.PAD, max_new_tokens=1000, eos_token_id=None)
    # an answer that fits takes the fast path again
    kwargs["max_new_tokens"] = 20
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, **kwargs), stock) and decode_steps


def test_cpu_memory_bounds_the_reservation(tiny, decode_steps, hf_log, monkeypatch):
    """On a CPU the reservation is checked against the system's available memory (here set to 64 MiB): a
    max_new_tokens of 10**12 (stock generate stops at EOS; the fast path used to try to allocate the whole
    answer and failed) declines the fast path and runs transformers' loop on the blocks that fit, with
    stock's tokens."""
    import hf_accel.cache.paged_cache as paged_cache

    assert paged_cache.free_kv_bytes("cpu") > 0  # read from this machine (Linux /proc/meminfo)
    monkeypatch.setattr(paged_cache, "_available_system_memory", lambda: 64 * 2**20)
    assert paged_cache.free_kv_bytes("cpu") == int(0.9 * 64 * 2**20)
    model, ids, mask, kwargs, stock = _case(tiny, "llama", "all_rows_finish")
    ours = _accelerated(model)
    kwargs["max_new_tokens"] = 10**12
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, **kwargs), stock)
    assert _messages(hf_log, "does not fit in free device memory") and not decode_steps


def test_inputs_keyword_takes_the_fast_path(tiny, decode_steps, hf_log):
    """``inputs=`` (transformers' name of generate's first parameter) is the token ids, as positionally."""
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=1)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6, eos_token_id=None)
    ours = _accelerated(model)
    with torch.no_grad():
        out = ours.generate(inputs=ids, attention_mask=mask, pad_token_id=tiny.PAD, do_sample=False,
                            max_new_tokens=6, eos_token_id=None)
    assert torch.equal(out, stock)
    assert decode_steps and _messages(hf_log, FAST_MSG)
    assert not _messages(hf_log, "keeps transformers' cache")


def test_right_padded_batch_falls_back_to_stock(tiny, hf_log):
    """A right-padded batch (a user mistake transformers warns about) is not decoded on the fast path,
    which assumes left padding: transformers' loop runs it, same tokens as stock, and the reason is logged."""
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=3)
    # move each row's padding to the right
    lengths = mask.sum(1)
    right_ids = torch.full_like(ids, tiny.PAD)
    right_mask = torch.zeros_like(mask)
    for r, n in enumerate(lengths.tolist()):
        right_ids[r, :n] = ids[r, ids.shape[1] - n:]
        right_mask[r, :n] = 1
    assert not bool(right_mask[:, -1].all()), "the batch must have a right-padded row"
    stock = _generate(model, right_ids, right_mask, tiny.PAD, max_new_tokens=6)
    ours = _accelerated(model)
    assert torch.equal(_generate(ours, right_ids, right_mask, tiny.PAD, max_new_tokens=6), stock)
    assert _messages(hf_log, "right-padded batch")


def test_all_padding_row_falls_back_with_its_own_reason(tiny, hf_log):
    """A row whose attention_mask is all zeros is not called right padding in the logged reason; the call
    still matches stock transformers."""
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=4)
    mask = mask.clone()
    mask[0] = 0
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=4)
    ours = _accelerated(model)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=4), stock)
    assert _messages(hf_log, "is all padding")
    assert not _messages(hf_log, "right-padded batch")


@pytest.mark.interpreter
@pytest.mark.parametrize("gemv_rope,head_norm", [(False, True), (True, True), (False, False)],
                         ids=["rope-kernel", "rope-in-gemv", "lm-head-norm-kernel"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_batch1_fused_step_runs_gemv(model_type, gemv_rope, head_norm, tiny, monkeypatch):
    """Batch-1 decode steps of the fused step run every matmul, the LM head included, through gemv
    (interpreter), and greedy output stays token-identical to stock in float32 (with the final norm fused
    into the LM head or not)."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "GEMV_ROPE", gemv_rope)
    monkeypatch.setattr(step_switches, "GEMV_LM_HEAD_NORM", head_norm)
    calls = []
    original, original_rope = decode_step.gemv, decode_step.gemv_rope
    monkeypatch.setattr(decode_step, "gemv", lambda *a, **k: calls.append(k.get("swiglu", False)) or original(*a, **k))
    monkeypatch.setattr(decode_step, "gemv_rope", lambda *a, **k: calls.append("rope") or original_rope(*a, **k))
    model = tiny.model(model_type)
    ids, mask = tiny.batch(seed=1)
    ids, mask = ids[:1], mask[:1]
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6, eos_token_id=None)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    layers = model.config.num_hidden_layers
    # 5 decode steps; Q/K/V with RoPE + cache write in the GEMV's epilogue
    assert len(calls) == 5 * (4 * layers + 1) and calls.count(True) == 5 * layers
    assert calls.count("rope") == (5 * layers if gemv_rope else 0)


def _fused_five_tokens_match_stock(tiny, seed: int, *model_args, **model_kwargs):
    """A tiny model and its fused-step accelerated copy; 5 greedy tokens of ``tiny.batch(seed)`` (float32,
    no EOS) must be identical. Returns ``(model, accelerated)``."""
    model = tiny.model(*model_args, **model_kwargs)
    ids, mask = tiny.batch(seed=seed)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=5, eos_token_id=None)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    return model, ours


@pytest.mark.interpreter
@pytest.mark.parametrize("gather_by_index", [True, False], ids=["index", "embedding"])
def test_fused_step_gathers_embeddings_and_rotary_rows(gather_by_index, tiny, monkeypatch):
    """The fused step's token-embedding and rotary-row gathers (by indexing, or through the embedding
    function) give greedy output token-identical to stock (float32, batch 3); a subclass of nn.Embedding
    (which may scale its rows) is called as the module even with gathering by index."""
    from hf_accel.engine import step_switches

    monkeypatch.setattr(step_switches, "GATHER_BY_INDEX", gather_by_index)
    _fused_five_tokens_match_stock(tiny, 2, "llama")

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = tiny.model("llama")
    old = model.model.embed_tokens
    scaled = Scaled(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx)
    scaled.weight = old.weight  # tied to the LM head as before
    model.model.embed_tokens = scaled
    ids, mask = tiny.batch(seed=3)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None)
    out = _generate(_accelerated(model, fused=True), ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"


@pytest.mark.interpreter
def test_fused_step_split_k_and_in_kernel_merge(tiny, monkeypatch):
    """Batch-3 fused decode steps with fused_linear split into 2 K shares per output tile and 3 KV splits
    merged inside the attention kernel (both through the step's arrival counters, reused by every layer
    and step): greedy output token-identical to stock in float32, counters back at zero."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_WHOLE_K", False)  # split-K is a K-loop option
    seen = {"split": 0, "merge": 0}
    linear, attention = decode_step.fused_linear, decode_step.paged_attention

    def split_linear(x, w, **kw):
        seen["split"] += 1
        return linear(x, w, **{**kw, "split_k": 2, "block_k": 16})

    def merging_attention(*a, **kw):
        seen["merge"] += kw.get("merge_counters") is not None and kw.get("num_splits") == 3
        return attention(*a, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", split_linear)
    monkeypatch.setattr(decode_step, "paged_attention", merging_attention)
    monkeypatch.setattr(decode_step, "default_num_splits", lambda *a: 3)
    monkeypatch.setattr(step_switches, "FUSED_MERGE", True)  # off by default (measured slower on the H200)
    model, ours = _fused_five_tokens_match_stock(tiny, 1, "llama")
    layers = model.config.num_hidden_layers
    assert seen["split"] == 4 * 4 * layers and seen["merge"] == 4 * layers  # 4 decode steps
    for step in ours._hf_accel_engine.steps.values():
        assert step.num_splits == 3
        assert int(step.merge_counters.abs().sum()) == 0 and int(step.linear_counters.abs().sum()) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("fused_rope", [True, False], ids=["rope-in-fused-linear", "rope-kernel"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_small_batch_fused_step_rope_epilogue(model_type, fused_rope, tiny, monkeypatch):
    """Batch-3 fused decode steps (fused_linear, 3 token rows) with head_dim 32 take RoPE + the cache write
    in the Q/K/V fused_linear's epilogue (FUSED_LINEAR_ROPE; head_dim 16 models cannot), greedy output
    token-identical to stock in float32, with the switch on or off."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_ROPE", fused_rope)
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 16)  # the prefill's rows (more than 16) stay on cuBLAS
    calls = {"fused_rope": 0, "rope_kernel": 0}
    original, original_kernel = decode_step.fused_linear_rope, decode_step.rope_and_cache

    def spy(*a, **k):
        calls["fused_rope"] += 1
        return original(*a, **k)

    def spy_kernel(*a, **k):
        calls["rope_kernel"] += 1
        return original_kernel(*a, **k)

    monkeypatch.setattr(decode_step, "fused_linear_rope", spy)
    monkeypatch.setattr(decode_step, "rope_and_cache", spy_kernel)
    model, ours = _fused_five_tokens_match_stock(tiny, 2, model_type, head_dim=32)
    layers = model.config.num_hidden_layers
    # 4 decode steps of 3 rows (the prefill has more rows than fused_linear takes: the RoPE kernel)
    assert calls["fused_rope"] == (4 * layers if fused_rope else 0)
    assert calls["rope_kernel"] == (layers if fused_rope else 5 * layers)


@pytest.mark.interpreter
def test_small_batch_fused_step_preload_and_attention_overlap(tiny, monkeypatch):
    """Batch-3 fused decode steps with FUSED_LINEAR_PRELOAD (first weight tile before the PDL wait) and
    MULTI_ROW_ATTENTION_OVERLAP (attention preloading its cached K/V, triggering the merge): the options reach
    every 3-row kernel, and greedy output stays token-identical to stock in float32."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_WHOLE_K", False)  # the preload is a K-loop option
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_PRELOAD", True)
    monkeypatch.setattr(step_switches, "MULTI_ROW_ATTENTION_OVERLAP", True)
    seen = {"preload": 0, "rope_preload": 0, "preload_kv": 0, "trigger": 0}
    linear, rope_linear = decode_step.fused_linear, decode_step.fused_linear_rope
    attention = decode_step.paged_attention

    def spy_linear(x, w, **kw):
        seen["preload"] += kw.get("preload") is True
        return linear(x, w, **{**kw, "block_k": 16})  # several K tiles: a loop after the preloaded one

    def spy_rope(*a, **kw):
        seen["rope_preload"] += kw.get("preload") is True
        return rope_linear(*a, **{**kw, "block_k": 16})

    def spy_attention(q, *a, **kw):
        if q.shape[2] == 1:  # [batch, heads, q_len, head_dim]: the decode steps, not the prefill
            seen["preload_kv"] += kw.get("preload_kv") is True
            seen["trigger"] += kw.get("trigger") is True
        return attention(q, *a, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", spy_linear)
    monkeypatch.setattr(decode_step, "fused_linear_rope", spy_rope)
    monkeypatch.setattr(decode_step, "paged_attention", spy_attention)
    model, ours = _fused_five_tokens_match_stock(tiny, 2, "llama", head_dim=32)
    layers = model.config.num_hidden_layers
    assert seen["rope_preload"] == 4 * layers  # 4 decode steps
    assert seen["preload"] == 3 * 4 * layers  # o, gate/up, down
    assert seen["preload_kv"] == seen["trigger"] == 4 * layers


@pytest.mark.interpreter
def test_small_batch_fused_step_whole_k(tiny, monkeypatch):
    """Batch-3 fused decode steps with FUSED_LINEAR_WHOLE_K (no K loop in the 3-row matmuls): it reaches every
    3-row matmul, and greedy output stays token-identical to stock in float32."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_WHOLE_K", True)
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 16)  # the prefill's rows (more than 16) stay on cuBLAS
    seen = {"whole_k": 0, "rope_whole_k": 0}
    linear, rope_linear = decode_step.fused_linear, decode_step.fused_linear_rope

    def spy_linear(x, w, **kw):
        seen["whole_k"] += kw.get("whole_k") is True
        return linear(x, w, **kw)

    def spy_rope(*a, **kw):
        seen["rope_whole_k"] += kw.get("whole_k") is True
        return rope_linear(*a, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", spy_linear)
    monkeypatch.setattr(decode_step, "fused_linear_rope", spy_rope)
    model, ours = _fused_five_tokens_match_stock(tiny, 2, "llama", head_dim=32)
    layers = model.config.num_hidden_layers
    assert seen["rope_whole_k"] == 4 * layers  # 4 decode steps
    assert seen["whole_k"] == 3 * 4 * layers  # o, gate/up, down


@pytest.mark.interpreter
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_small_batch_fused_step_lm_head(model_type, tiny, monkeypatch):
    """Batch-3 fused decode steps with FUSED_LINEAR_LM_HEAD (final residual add + RMSNorm + LM head in one
    fused_linear launch, float32 logits): it reaches every 3-row step, and greedy output stays token-identical
    to stock in float32."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_LM_HEAD", True)
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 16)  # the prefill's rows (more than 16) stay on cuBLAS
    heads = []
    linear = decode_step.fused_linear

    def spy_linear(x, w, **kw):
        if w.shape[0] == vocab:
            heads.append((x.shape[0], kw.get("out_dtype"), kw.get("norm_weight") is not None))
        return linear(x, w, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", spy_linear)
    vocab = tiny.model(model_type).config.vocab_size
    _fused_five_tokens_match_stock(tiny, 2, model_type, head_dim=32)
    assert heads == [(3, torch.float32, True)] * 4  # 4 decode steps of 3 rows


def test_model_reason_follows_mode_dtype_and_layers(tiny):
    """The fast path's model check is cached per call, but training mode, a cast, a device move of the
    whole model and a replaced layer are seen at the next call (and generate falls back / recovers)."""
    model = _accelerated(tiny.model("llama"))
    fast = model._hf_accel_engine
    assert fast._model_reason() is None
    model.train()
    assert "training" in fast._model_reason()
    model.eval()
    assert fast._model_reason() is None
    model.double()
    assert "float64" in fast._model_reason()
    model.float()
    assert fast._model_reason() is None
    original = model.model.layers[0]
    model.model.layers[0] = copy.deepcopy(original).to("meta")  # a new layer module on another device
    assert "several devices" in fast._model_reason()
    model.model.layers[0] = original
    assert fast._model_reason() is None
    ids, mask = tiny.batch(seed=1)
    model2 = _accelerated(tiny.model("llama"))
    stock = _generate(tiny.model("llama"), ids, mask, tiny.PAD, max_new_tokens=4)
    assert torch.equal(_generate(model2, ids, mask, tiny.PAD, max_new_tokens=4), stock)
    model2.train()
    out = _generate(model2, ids, mask, tiny.PAD, max_new_tokens=4)  # transformers' loop, dropout 0: same
    assert torch.equal(out, stock)


@pytest.mark.interpreter
def test_after_fused_generate_model_stays_trainable_and_castable(tiny):
    """A fused generate merges q/k/v and gate/up into shared matrices inside inference mode. The parameters
    must stay ordinary trainable tensors (requires_grad kept, backward and load_state_dict work, also after
    revert_model), and a cast after the call rebuilds the engine instead of using the old merged weights."""
    from hf_accel import revert_model

    base = tiny.model("llama", head_dim=32)
    ids, mask = tiny.batch(seed=5)
    stock = _generate(base, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None)
    model = _accelerated(base, fused=True)
    params = list(model.parameters())  # what an optimizer made before the first call holds
    assert torch.equal(_generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None), stock)
    fast = model._hf_accel_engine
    assert fast.merged, "the fused step merged the projections"
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.requires_grad and not q.is_inference()
    other = tiny.model("llama", seed=9, head_dim=32)
    model.load_state_dict(other.state_dict())  # in-place copies into the merged storage
    rows = q.shape[0]
    assert torch.equal(fast.merged[0].qkv_weight[:rows], other.model.layers[0].self_attn.q_proj.weight)
    model.load_state_dict(base.state_dict())
    # a cast: the merged matrices are stale now; the next call must not use them
    model.double()
    assert "float64" in fast._model_reason() and not fast.merged and not fast.steps
    model.float()
    assert torch.equal(_generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None), stock)
    revert_model(model)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.requires_grad for p in model.parameters())
    assert all(a is b for a, b in zip(params, model.parameters()))  # the same Parameter objects throughout


@pytest.mark.interpreter
def test_fused_flag_change_rebuilds_steps(tiny, monkeypatch):
    """Switching the engine between its PyTorch and Triton step after a call takes effect at the next call."""
    from hf_accel.engine import decode_step

    calls = []
    original = decode_step.paged_attention
    monkeypatch.setattr(decode_step, "paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _accelerated(tiny.model("llama"))
    ids, mask = tiny.batch(seed=6)
    first = _generate(model, ids, mask, tiny.PAD, max_new_tokens=3, eos_token_id=None)
    assert not calls  # CPU default: the modules step with the PyTorch reference
    model._hf_accel_engine.fused = True
    again = _generate(model, ids, mask, tiny.PAD, max_new_tokens=3, eos_token_id=None)
    assert calls and torch.equal(again, first)


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


@pytest.mark.interpreter
def test_fused_step_with_a_matmul_input_narrower_than_16_gives_stock_tokens(tiny, decode_steps):
    """An intermediate size of 8 (down_proj's input): the fused step's batched matmuls took fused_linear's whole-K
    path, whose first column chunk is 16 wide and unmasked (wrong tokens, or heap corruption for a hidden size
    of 8); they take the K loop there."""
    model = tiny.model("llama", intermediate_size=8)
    ids, mask = tiny.batch(seed=5)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=4)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=4)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert decode_steps and all(decode_steps)
    assert all(step.small_linear for step in ours._hf_accel_engine.steps.values())


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
