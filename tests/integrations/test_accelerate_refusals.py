"""The public API's exports, and what accelerate_model / revert_model refuse.

Objects that are not transformers models, unsupported model types (the error lists the supported ones), unknown
or positional options, reverting a model never accelerated; and a failed accelerate_model changes nothing: a
refused draft model leaves both models as they were, and an error raised after patching began is undone (LoRA
unmerged bit for bit, attention and generate restored, the draft reverted).
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft_lora_models import _lora_layers, _lora_model
from transformers import GPT2Config, GPT2LMHeadModel

import hf_accel
from hf_accel import SUPPORTED_MODEL_TYPES, accelerate_model, is_accelerated, revert_model


def test_public_api_exports():
    for name in ("accelerate_model", "revert_model", "is_accelerated", "SUPPORTED_MODEL_TYPES"):
        assert hasattr(hf_accel, name)


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj", [object(), torch.nn.Linear(4, 4), "llama", None, {"model_type": "llama"}],
    ids=["object", "nn.Module", "str", "None", "dict"],
)
def test_non_hf_object_raises_type_error(obj):
    with pytest.raises(TypeError, match="PreTrainedModel"):
        accelerate_model(obj)
    with pytest.raises(TypeError):
        revert_model(obj)
    assert not is_accelerated(obj)


def _assert_lists_supported(message: str):
    assert set(SUPPORTED_MODEL_TYPES) >= {"llama", "mistral", "qwen2", "qwen3"}
    for name in SUPPORTED_MODEL_TYPES:
        assert name in message, f"{name!r} missing from: {message}"


def test_unsupported_model_type_gpt2():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)).eval()
    impl = model.config._attn_implementation
    with pytest.raises(ValueError, match="gpt2") as err:
        accelerate_model(model)
    _assert_lists_supported(str(err.value))
    assert model.config._attn_implementation == impl
    assert not is_accelerated(model)


def test_unsupported_model_type_name_on_a_llama_class(tiny):
    model = tiny.model("llama")
    model.config.model_type = "phi"
    with pytest.raises(ValueError, match="phi") as err:
        accelerate_model(model)
    _assert_lists_supported(str(err.value))
    assert model.config._attn_implementation == "sdpa"


def test_unknown_or_positional_option_raises_type_error(tiny):
    model = tiny.model("llama")
    with pytest.raises(TypeError):
        accelerate_model(model, not_an_option=True)
    with pytest.raises(TypeError):
        accelerate_model(model, True)  # options are keyword-only
    assert not is_accelerated(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("flag", ["paged_cache", "fast_decode", "cuda_graphs", "merge_lora"])
@pytest.mark.parametrize("value", ["no", 0, None, 1.0])
def test_flags_must_be_bools(flag, value, tiny):
    """A flag given as a string ("no" reads as True), a number or None: TypeError naming it, nothing changed."""
    model = tiny.model("llama")
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        accelerate_model(model, **{flag: value})
    assert not is_accelerated(model)
    assert model.config._attn_implementation == "sdpa"


def test_numpy_bool_flags_are_taken(tiny):
    import numpy as np

    model = accelerate_model(tiny.model("llama"), fast_decode=np.bool_(False))
    assert is_accelerated(model)
    assert "_hf_accel_engine" in model.__dict__ and model._hf_accel_engine is None  # fast_decode off


def test_revert_of_a_model_never_accelerated(tiny):
    with pytest.raises(ValueError, match="not accelerated"):
        revert_model(tiny.model("llama"))


# --- a failed accelerate_model changes nothing ------------------------------------------------------


def _state(tiny, model, ids, mask) -> dict:
    """What a failed accelerate_model must leave as it was: acceleration, attention implementation, the
    instance's attributes (generate, hf-accel state), every parameter bit for bit, LoRA merge flags, logits."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        "accelerated": is_accelerated(model),
        "attn": hf_model.config._attn_implementation,
        "attributes": set(vars(hf_model)),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "merged": [layer.merged for layer in _lora_layers(model)] if hf_model is not model else None,
        "logits": tiny.logits(model, ids, mask),
    }


def _assert_unchanged(before: dict, after: dict) -> None:
    for key in ("accelerated", "attn", "merged"):
        assert after[key] == before[key], key
    assert after["attributes"] == before["attributes"], after["attributes"] ^ before["attributes"]
    assert after["params"].keys() == before["params"].keys()
    for name, p in after["params"].items():
        assert torch.equal(p, before["params"][name]), name
    assert torch.equal(after["logits"], before["logits"])


DRAFT_FAULTS = {  # how the draft is broken, what the error names
    "float64": (lambda draft: draft.to(torch.float64), "draft model.*dtype torch.float64"),
    "training": (lambda draft: draft.train(), "draft model.*training mode"),
    "accelerated-without-fast-decode": (lambda draft: accelerate_model(draft, paged_cache=False),
                                        "draft model.*without fast_decode"),
}


@pytest.mark.parametrize("target_kind", ["plain", "lora"])
@pytest.mark.parametrize("fault", list(DRAFT_FAULTS))
def test_refused_draft_changes_neither_model(tiny, fault, target_kind):
    """A draft model accelerate_model refuses (a dtype the kernels do not take, training mode, accelerated by
    the caller without the fast decode step) raises an error naming the fault and leaves both models as they
    were: the target (a LoRA one too) not accelerated, unmerged, same attention, attributes, weights, logits
    and greedy tokens; the draft not accelerated by the call (one the caller had accelerated stays so)."""
    target = tiny.model("llama", seed=20) if target_kind == "plain" else _lora_model(tiny, seed=20)
    draft = tiny.model("llama", seed=21, num_hidden_layers=1)
    break_draft, message = DRAFT_FAULTS[fault]
    break_draft(draft)
    ids, mask = tiny.batch(seed=22)
    target_before, draft_before = _state(tiny, target, ids, mask), _state(tiny, draft, ids, mask)
    stock = tiny.greedy(target, ids, mask)
    with pytest.raises(ValueError, match=message):
        accelerate_model(target, speculative=draft)
    assert not is_accelerated(target)
    assert is_accelerated(draft) == (fault == "accelerated-without-fast-decode")
    _assert_unchanged(target_before, _state(tiny, target, ids, mask))
    _assert_unchanged(draft_before, _state(tiny, draft, ids, mask))
    assert torch.equal(tiny.greedy(target, ids, mask), stock)


@pytest.mark.parametrize("fault", ["target-engine", "draft-step"])
def test_failure_after_patching_began_is_undone(tiny, monkeypatch, fault):
    """An error raised after accelerate_model began to change the models (injected here: building the
    target's decode engine fails after the LoRA merge and the attention switch; or the draft's decode step
    is refused after the draft was accelerated) propagates after everything is undone: LoRA unmerged with
    the base weights bit for bit, attention and generate restored, the draft reverted."""
    from hf_accel.engine.fast_generate import FastEngine

    target = _lora_model(tiny, seed=23)
    draft = tiny.model("llama", seed=24, num_hidden_layers=1)
    if fault == "target-engine":
        original_init = FastEngine.__init__

        def init(self, model, *args, **kwargs):
            if model is target.get_base_model():
                raise RuntimeError("injected: out of memory")
            original_init(self, model, *args, **kwargs)

        monkeypatch.setattr(FastEngine, "__init__", init)
        error, message = RuntimeError, "injected"
    else:
        original_reason = FastEngine._model_reason

        def reason(self):
            return "injected" if self.model is draft and is_accelerated(draft) else original_reason(self)

        monkeypatch.setattr(FastEngine, "_model_reason", reason)
        error, message = ValueError, "draft model.*injected"
    ids, mask = tiny.batch(seed=25)
    target_before, draft_before = _state(tiny, target, ids, mask), _state(tiny, draft, ids, mask)
    with pytest.raises(error, match=message):
        accelerate_model(target, speculative=draft)
    assert not is_accelerated(target) and not is_accelerated(draft)
    _assert_unchanged(target_before, _state(tiny, target, ids, mask))
    _assert_unchanged(draft_before, _state(tiny, draft, ids, mask))


# --- models without generate() -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls_name", ["LlamaModel", "LlamaForSequenceClassification"])
def test_model_without_generate_gets_the_attention_only(tiny, hf_log, attention_spy, cls_name):
    """A base model or a classification head has no ``generate``: accelerate_model switches its attention to
    hf-accel's (outputs as stock's), says that the cache and decode paths apply to generate only, and refuses
    speculative decoding by name. It used to raise a bare AttributeError ('... has no attribute generate')."""
    import transformers

    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    model = cls(tiny.config("llama", pad_token_id=tiny.PAD)).eval()
    ids, mask = tiny.batch(seed=8)

    def outputs(m):
        with torch.no_grad():
            out = m(input_ids=ids, attention_mask=mask)
        return out.last_hidden_state if cls_name == "LlamaModel" else out.logits

    stock = outputs(model)
    with pytest.raises(ValueError, match=f"speculative decoding needs a model with generate.*{cls_name}"):
        accelerate_model(model, speculative="prompt_lookup")
    assert not is_accelerated(model) and model.config._attn_implementation == "sdpa"
    assert accelerate_model(model) is model and is_accelerated(model)
    assert "generate" not in model.__dict__
    assert any("has no generate() (not a *ForCausalLM)" in r.getMessage() for r in hf_log.records)
    spy = attention_spy()
    torch.testing.assert_close(outputs(model), stock, rtol=1e-5, atol=1e-5)
    assert spy.kernel_calls + len(spy.fallbacks) == model.config.num_hidden_layers
    revert_model(model)
    assert not is_accelerated(model) and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("edit", ["removed", "reordered"])
def test_pruned_or_reordered_layers_keep_transformers_cache(tiny, edit, hf_log):
    """Layers removed (config.num_hidden_layers not updated) or reordered (each keeping its ``layer_idx``): stock
    generate runs them with its own cache; hf-accel's fallback used a PagedCache of the configured layers, which
    took the missing layer for a failed forward and raised "PagedCache holds a partial step"."""
    model = tiny.model("llama", seed=84, num_hidden_layers=3)
    ids, mask = tiny.batch(seed=85)
    if edit == "removed":
        del model.model.layers[1]
    else:
        layers = model.model.layers
        layers[0], layers[2] = layers[2], layers[0]
    stock = tiny.greedy(copy.deepcopy(model), ids, mask, max_new_tokens=5)
    ours = accelerate_model(model)
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=5), stock)
    reason = ("the model has 2 decoder layers and config.num_hidden_layers says 3" if edit == "removed"
              else "decoder layer 0 has self_attn.layer_idx 2")
    assert any(reason in r.getMessage() and "keeps transformers' cache" in r.getMessage() for r in hf_log.records)


@pytest.mark.parametrize("padded", [False, True])
def test_a_duplicated_layer_sharing_a_cache_layer_runs_stock(tiny, padded, hf_log):
    """A decoder layer duplicated without renumbering its ``layer_idx`` (depth up-scaling by copying layers, config
    updated): both copies write one layer of transformers' cache, which then holds more keys than the queries and
    the mask cover. Stock's SDPA reads that with its own (top-left) causal alignment, hf-accel's attention bottom-right:
    other tokens, silently (and tokens where stock raises, given a padding mask). generate now runs transformers'
    loop with the model's own attention, logged: stock's tokens, or stock's error."""
    model = tiny.model("llama", seed=89, num_hidden_layers=3)
    layers = model.model.layers
    twin = copy.deepcopy(layers[1])
    twin.self_attn.config = model.config  # (a deep copy's own config would run stock for another reason)
    model.model.layers = torch.nn.ModuleList([layers[0], layers[1], twin, layers[2]])
    model.config.num_hidden_layers = 4
    ids, mask = tiny.batch(seed=90)
    if not padded:
        ids, mask = ids[:1], mask[:1]  # (a row without padding: transformers passes SDPA no mask)
        assert bool(mask.all())
    stock_model = copy.deepcopy(model)
    ours = accelerate_model(model)
    if padded:  # stock's SDPA gets a mask narrower than that cache layer's keys and raises: so does hf-accel
        with pytest.raises(RuntimeError, match="must match the size"):
            tiny.greedy(stock_model, ids, mask, max_new_tokens=6)
        with pytest.raises(RuntimeError, match="must match the size"):
            tiny.greedy(ours, ids, mask, max_new_tokens=6)
    else:
        assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=12),
                           tiny.greedy(stock_model, ids, mask, max_new_tokens=12))
    assert any("decoder layers 1 and 2 have the same self_attn.layer_idx (1)" in r.getMessage()
               and "model's own attention ('sdpa')" in r.getMessage() for r in hf_log.records)
    assert model.config._attn_implementation == "hf_accel"


@pytest.mark.parametrize("where", ["before", "after"])
def test_layer_of_another_model_with_its_own_attention_runs_stock(tiny, where, hf_log):
    """A decoder layer taken from another (not accelerated) model keeps that model's config, whose attention is
    'sdpa': transformers builds one mask per forward in the model's format, so that layer got hf-accel's 2-D key
    mask and SDPA raised. generate now runs transformers' loop with the model's own attention for it (stock's
    tokens), logs why, and sets hf-accel's attention back afterwards."""
    model = tiny.model("llama", seed=86)
    donor = tiny.model("llama", seed=87)
    ids, mask = tiny.batch(seed=88)
    if where == "before":
        model.model.layers[1] = donor.model.layers[1]
    ours = accelerate_model(model)
    if where == "after":
        model.model.layers[1] = donor.model.layers[1]
    stock_model = copy.deepcopy(model)
    revert_model(stock_model)
    stock = tiny.greedy(stock_model, ids, mask, max_new_tokens=5)
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=5), stock)
    assert any("decoder layer 1's attention has its own config" in r.getMessage() and "'sdpa'" in r.getMessage()
               for r in hf_log.records)
    assert model.config._attn_implementation == "hf_accel" and is_accelerated(model)
    assert not any("fast decode path" in r.getMessage() for r in hf_log.records)
    model.model.layers[1].self_attn.config = model.config  # the layer now follows the model's config
    tiny.greedy(ours, ids, mask, max_new_tokens=5)
    assert any("generate runs the fast decode path" in r.getMessage() for r in hf_log.records)
