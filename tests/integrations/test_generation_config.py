"""The remembered prepared GenerationConfig equals transformers' own for every call, also after the configs
it depends on change between calls."""

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_accel.integrations.generation_config import prepare_generation_config


@pytest.fixture()
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = LlamaForCausalLM(cfg)
    m.generation_config.eos_token_id = [2, 3]
    return m


def _call(**options):
    ids = torch.randint(4, 64, (2, 7))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **options}


def _same(model, user_config, call):
    want_gc, want_kw = model._prepare_generation_config(user_config, **call)
    got_gc, got_kw = prepare_generation_config(model, user_config, call)
    assert got_gc.to_dict() == want_gc.to_dict()
    assert got_kw.keys() == want_kw.keys()
    for k, v in want_kw.items():
        assert got_kw[k] is v or got_kw[k] == v, k
    return got_gc, got_kw


def test_remembered_config_equals_transformers_across_calls(model):
    calls = [_call(max_new_tokens=8), _call(max_new_tokens=9), _call(max_new_tokens=8, do_sample=True, top_k=5),
             _call(max_new_tokens=8), _call(max_length=30, eos_token_id=[7])]
    for call in calls * 2:  # the second pass hits the memo
        gc, kw = _same(model, None, call)
        assert kw["input_ids"] is call["input_ids"]  # tensors pass through, this call's own
    assert len(model.__dict__["_hf_accel_generation_configs"]) == 4


def test_changes_to_the_model_generation_config_are_seen(model):
    call = _call(max_new_tokens=8)
    _same(model, None, call)
    model.generation_config.eos_token_id.append(9)  # in place
    gc, _ = _same(model, None, call)
    assert gc.eos_token_id == [2, 3, 9]
    model.generation_config.temperature = 0.3
    model.generation_config.do_sample = True
    gc, _ = _same(model, None, call)
    assert gc.temperature == 0.3 and gc.do_sample


def test_a_caller_generation_config_is_read_by_value(model):
    user = GenerationConfig(max_new_tokens=5, eos_token_id=[2])
    call = _call()
    _same(model, user, call)
    user.max_new_tokens = 6
    gc, _ = _same(model, user, call)
    assert gc.max_new_tokens == 6


def test_returned_config_is_the_callers_own(model):
    call = _call(max_new_tokens=8)
    prepare_generation_config(model, None, call)
    gc, _ = prepare_generation_config(model, None, call)
    gc.max_new_tokens = 99
    gc.eos_token_id.append(50)
    again, _ = _same(model, None, call)
    assert again.max_new_tokens == 8 and again.eos_token_id == [2, 3]


def test_generation_options_on_the_model_config_still_raise(model):
    call = _call(max_new_tokens=8)
    _same(model, None, call)
    model.config.temperature = 0.5  # transformers refuses generation options set on model.config
    with pytest.raises(ValueError):
        model._prepare_generation_config(None, **call)
    with pytest.raises(ValueError):
        prepare_generation_config(model, None, call)


def test_object_arguments_pass_through(model):
    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    for _ in range(2):
        s = Streamer()
        call = _call(max_new_tokens=8, streamer=s)
        _, kw = _same(model, None, call)
        assert kw["streamer"] is s


def test_option_values_of_different_types_are_different_keys(model):
    _same(model, None, _call(max_new_tokens=8, do_sample=False, temperature=1))
    gc, _ = _same(model, None, _call(max_new_tokens=8, do_sample=False, temperature=1.5))
    assert gc.temperature == 1.5


def test_calls_from_several_threads_share_the_memo(model):
    """More distinct calls than the memo keeps, from 8 threads at once: every result equals transformers' own
    and no thread fails while another one evicts an entry."""
    import sys
    import threading

    from hf_accel.integrations import generation_config as gcm

    want = {n: model._prepare_generation_config(None, **_call(max_new_tokens=n))[0].max_new_tokens
            for n in range(1, 3 * gcm.MAX_ENTRIES)}
    errors = []

    def worker(seed):
        try:
            for i in range(300):
                n = 1 + (seed * 7 + i) % (3 * gcm.MAX_ENTRIES - 1)
                gc, kw = prepare_generation_config(model, None, _call(max_new_tokens=n))
                assert gc.max_new_tokens == want[n] and "input_ids" in kw
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert len(model.__dict__["_hf_accel_generation_configs"]) <= gcm.MAX_ENTRIES
