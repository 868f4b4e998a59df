"""``hf_accel.measure_generate`` and ``TimingStreamer``: inputs checked before generate runs; what is counted, timed."""

import pytest
import torch

from hf_accel import TimingStreamer, measure_generate


@pytest.mark.parametrize(("inputs", "message"), [
    (torch.ones(1, 4, dtype=torch.long), "inputs must be a mapping .* got Tensor"),
    ({}, r"inputs\['input_ids'\] must be a \[batch, prompt_len\] tensor, got NoneType"),
    ({"input_ids": torch.ones(4, dtype=torch.long)}, r"got a tensor of shape \(4,\)"),
    ({"input_ids": [[1, 2]]}, "got list"),
])
def test_inputs_that_are_not_a_tokenizer_output_raise_type_error(inputs, message, tiny):
    model = tiny.model("llama")
    with pytest.raises(TypeError, match=message):
        measure_generate(model, inputs, max_new_tokens=2)


def test_a_tokenizer_output_is_measured(tiny):
    from transformers import BatchEncoding

    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=2)
    stats = measure_generate(model, BatchEncoding({"input_ids": ids, "attention_mask": mask}), max_new_tokens=3,
                             do_sample=False, pad_token_id=tiny.PAD, eos_token_id=None)
    assert stats.new_tokens == 3 * ids.shape[0] and stats.sequences.shape == (ids.shape[0], ids.shape[1] + 3)


def _first_eos_counts(sequences, prompt_len, eos):
    """Per row: new tokens up to and including the first of ``eos`` (all of them when none appears)."""
    counts = []
    for row in sequences[:, prompt_len:].tolist():
        hits = [i for i, t in enumerate(row) if t in eos]
        counts.append(hits[0] + 1 if hits else len(row))
    return counts


def test_the_eos_of_a_generation_config_argument_ends_the_count(tiny):
    """Rows stopped by the EOS of the call's ``generation_config`` are padded to the longest row: the padding is not
    counted (the count used to read the EOS only from the keywords or the model's config)."""
    from transformers import GenerationConfig

    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=3)
    free = tiny.greedy(model, ids, mask, 8)
    eos = int(free[0, ids.shape[1] + 1])  # row 0's 2nd new token
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=tiny.PAD)
    stats = measure_generate(model, {"input_ids": ids, "attention_mask": mask}, generation_config=gc)
    counts = _first_eos_counts(stats.sequences, ids.shape[1], {eos})
    assert counts[0] <= 2 and stats.sequences.shape[1] - ids.shape[1] > counts[0]  # row 0 was padded after its EOS
    assert stats.new_tokens == sum(counts)
    # the call's keyword wins over its generation_config, as in generate
    stats = measure_generate(model, {"input_ids": ids, "attention_mask": mask}, generation_config=gc,
                             eos_token_id=None)
    assert stats.new_tokens == ids.shape[0] * 8


def test_return_dict_in_generate_is_measured_from_its_sequences(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=5)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tiny.PAD)
    plain = measure_generate(model, {"input_ids": ids, "attention_mask": mask}, **kw)
    as_dict = measure_generate(model, {"input_ids": ids, "attention_mask": mask}, return_dict_in_generate=True,
                               output_scores=True, **kw)
    assert torch.equal(as_dict.sequences, plain.sequences) and as_dict.new_tokens == plain.new_tokens == 12


def test_beam_search_and_time_first_token_false_run_without_a_streamer(tiny):
    """Beam search refuses streamers: it is timed without one (it used to fail on the streamer measure_generate
    added). ``time_first_token=False`` passes none either: the call runs as given."""
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=6)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=tiny.PAD)
    want = model.generate(input_ids=ids, attention_mask=mask, num_beams=2, **kw)
    stats = measure_generate(model, {"input_ids": ids, "attention_mask": mask}, num_beams=2, **kw)
    assert torch.equal(stats.sequences, want) and stats.ttft_s is None
    calls = []
    generate = model.generate
    model.generate = lambda **k: calls.append(k) or generate(**k)
    stats = measure_generate(model, {"input_ids": ids, "attention_mask": mask}, time_first_token=False, **kw)
    assert "streamer" not in calls[0] and stats.ttft_s is None and stats.new_tokens > 0
    stats = measure_generate(model, {"input_ids": ids, "attention_mask": mask}, **kw)
    assert isinstance(calls[1]["streamer"], TimingStreamer) and stats.ttft_s is not None


def test_a_streamer_among_the_inputs_is_refused(tiny):
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=6)
    with pytest.raises(TypeError, match="its own `streamer` argument"):
        measure_generate(model, {"input_ids": ids, "attention_mask": mask, "streamer": object()}, max_new_tokens=2)


def test_timing_streamer_device_strings_reuse_and_multi_token_puts():
    assert TimingStreamer(sync_device="cpu").sync_device == torch.device("cpu")
    with pytest.raises(ValueError, match="sync_device must be"):
        TimingStreamer(sync_device="not-a-device")
    timer = TimingStreamer()
    timer.put(torch.ones(2, 5))  # the prompt
    timer.put(torch.ones(2))  # one token per row
    timer.put(torch.ones(1, 3))  # an assisted-generation round: 3 tokens
    timer.end()
    assert (timer.steps, timer.tokens) == (2, 4) and timer.t_first is not None
    first_end = timer.t_end
    timer.put(torch.ones(1, 4))  # the next call's prompt: a new measurement
    assert (timer.steps, timer.tokens, timer.t_first, timer.t_end) == (0, 0, None, None)
    assert timer.t_start >= first_end
    timer.put(torch.ones(1))
    assert (timer.steps, timer.tokens) == (1, 1)
