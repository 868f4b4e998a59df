"""``hf_accel.measure_generate``: its inputs are checked before generate runs."""

import pytest
import torch

from hf_accel import measure_generate


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
