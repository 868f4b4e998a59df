"""accelerate_model / revert_model on tiny random llama, qwen2, mistral, qwen3 models and the real SmolLM2.

The accelerated attention must give the same greedy tokens as stock transformers (float32), and
revert_model must give back the exact logits. On CPU the attention function runs the PyTorch
reference of the kernel; the ``triton`` variants route that call through the Triton kernel
(interpreter), so the kernel itself runs inside ``generate``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

import hf_accel
import hf_accel.integrations.attention as hf_attn
from hf_accel import SUPPORTED_MODEL_TYPES, accelerate_model, is_accelerated, revert_model
from hf_accel.integrations.patch import original_attention

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


def test_accelerate_twice_is_harmless(tiny):
    model = tiny.model("qwen2", seed=6)
    ids, mask = tiny.batch(seed=7)
    before = tiny.logits(model, ids, mask)
    stock = tiny.greedy(model, ids, mask)
    accelerate_model(model)
    once = tiny.logits(model, ids, mask)
    assert accelerate_model(model) is model
    assert model.config._attn_implementation == hf_attn.ATTN_NAME
    assert torch.equal(tiny.logits(model, ids, mask), once)
    assert torch.equal(tiny.greedy(model, ids, mask), stock)
    revert_model(model)  # one revert undoes both calls
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(tiny.logits(model, ids, mask), before)
    with pytest.raises(ValueError, match="not accelerated"):
        revert_model(model)


def test_accelerate_again_after_revert(tiny):
    model = tiny.model("llama", seed=8)
    ids, mask = tiny.batch(seed=9)
    stock = tiny.greedy(model, ids, mask)
    for _ in range(2):
        accelerate_model(model)
        assert torch.equal(tiny.greedy(model, ids, mask), stock)
        revert_model(model)
        assert model.config._attn_implementation == "sdpa"


def test_revert_leaves_no_hf_accel_attributes(tiny):
    # what generate calls remembered (prepared configs, cache and speculative stats) goes with the revert
    model = tiny.model("llama", seed=8)
    ids, mask = tiny.batch(seed=9)
    before = set(model.__dict__)
    for spec in (None, "prompt_lookup"):
        accelerate_model(model, **({"speculative": spec} if spec else {}))
        tiny.greedy(model, ids, mask)
        assert any(k.startswith("_hf_accel") for k in model.__dict__)
        revert_model(model)
        assert set(model.__dict__) == before, set(model.__dict__) ^ before


def test_revert_restores_eager_implementation(tiny):
    model = tiny.model("mistral", seed=9)
    model.set_attn_implementation("eager")
    ids, mask = tiny.batch(seed=10)
    before = tiny.logits(model, ids, mask)
    accelerate_model(model)
    revert_model(model)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(tiny.logits(model, ids, mask), before)


def test_patch_is_per_instance(tiny, tmp_path, attention_spy):
    first = tiny.model("llama", seed=10)
    first.save_pretrained(tmp_path / "tiny")
    accelerate_model(first)
    second = LlamaForCausalLM.from_pretrained(tmp_path / "tiny").eval()  # loaded after the patch
    third = tiny.model("llama", seed=11)  # built from its own config after the patch
    for other in (second, third):
        assert other.config._attn_implementation == "sdpa"
        assert not is_accelerated(other)
    assert first.config._attn_implementation == hf_attn.ATTN_NAME

    spy = attention_spy()
    ids, mask = tiny.batch()
    tiny.logits(second, ids, mask)
    tiny.logits(third, ids, mask)
    assert spy.kernel_calls == 0 and spy.fallbacks == []
    tiny.logits(first, ids, mask)
    assert spy.kernel_calls == first.config.num_hidden_layers
    # No class was patched: an un-accelerated twin computes what a model loaded afresh computes.
    fresh = LlamaForCausalLM.from_pretrained(tmp_path / "tiny").eval()
    assert torch.equal(tiny.logits(second, ids, mask), tiny.logits(fresh, ids, mask))


@pytest.mark.xfail(
    strict=True,
    reason="accelerate_model switches the config object, so another model built from the same config "
    "instance switches too (transformers shares the config between such models)",
)
def test_patch_does_not_leak_through_a_shared_config(tiny):
    config = tiny.config("llama")
    first = tiny.model("llama", config=config)
    second = tiny.model("llama", config=config)
    accelerate_model(first)
    assert second.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("last", ["first", "second"])
def test_models_sharing_a_config_get_its_attention_back_when_the_last_is_reverted(tiny, last):
    """Two accelerated models on one config object: reverting one leaves the other accelerated (the config keeps
    hf-accel's attention), reverting both restores what the config had before, in either order (before, the
    second accelerate_model recorded hf-accel's own attention as the original and restored that)."""
    config = tiny.config("llama")
    first = tiny.model("llama", config=config)
    second = tiny.model("llama", config=config)
    accelerate_model(first)
    accelerate_model(second)
    assert original_attention(second) == "sdpa"
    models = [first, second] if last == "second" else [second, first]
    revert_model(models[0])
    assert config._attn_implementation == hf_attn.ATTN_NAME and is_accelerated(models[1])
    revert_model(models[1])
    assert config._attn_implementation == "sdpa"
    assert not is_accelerated(first) and not is_accelerated(second)
    accelerate_model(first)  # and the next acceleration records the original again
    revert_model(first)
    assert config._attn_implementation == "sdpa"


def test_draft_built_on_the_target_config_is_reverted_to_the_original_attention(tiny):
    """A draft model made from the target's own config object, accelerated by the target's speculative engine:
    reverting the target (which reverts the draft it accelerated) leaves the config as it was."""
    from hf_accel import SpeculativeConfig

    config = tiny.config("llama")
    target = tiny.model("llama", config=config)
    draft = tiny.model("llama", config=config)
    accelerate_model(target, speculative=SpeculativeConfig("draft_model", draft_model=draft))
    revert_model(target)
    assert not is_accelerated(target) and not is_accelerated(draft)
    assert config._attn_implementation == "sdpa"


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


def test_revert_of_a_model_never_accelerated(tiny):
    with pytest.raises(ValueError, match="not accelerated"):
        revert_model(tiny.model("llama"))


# --- peft -----------------------------------------------------------------------------------------


def _lora_model(tiny, seed):
    from peft import LoraConfig, get_peft_model

    base = tiny.model("llama", seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        lora_dropout=0.0)
    peft_model = get_peft_model(base, config)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # peft initialises B to zero; make the adapter matter
                p.normal_(0.0, 0.2)
    return peft_model.eval()


def _lora_layers(peft_model):
    from peft.tuners.lora import LoraLayer

    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    assert layers
    return layers


def test_peft_lora_is_merged_and_matches(tiny, attention_spy):
    peft_model = _lora_model(tiny, seed=12)
    ids, mask = tiny.batch(seed=13)
    with peft_model.disable_adapter():
        no_adapter = tiny.logits(peft_model, ids, mask)
    before = tiny.logits(peft_model, ids, mask)
    valid = mask.bool()
    assert (before[valid] - no_adapter[valid]).abs().max() > 1e-2  # the adapter changes the output
    stock = tiny.greedy(peft_model, ids, mask)

    spy = attention_spy()
    assert accelerate_model(peft_model) is peft_model
    assert is_accelerated(peft_model)
    assert all(layer.merged for layer in _lora_layers(peft_model))
    assert peft_model.get_base_model().config._attn_implementation == hf_attn.ATTN_NAME
    assert torch.equal(tiny.greedy(peft_model, ids, mask), stock)
    assert spy.kernel_calls > 0 and spy.fallbacks == []
    torch.testing.assert_close(tiny.logits(peft_model, ids, mask)[valid], before[valid], atol=1e-4, rtol=1e-4)

    revert_model(peft_model)
    assert not is_accelerated(peft_model)
    assert not any(layer.merged for layer in _lora_layers(peft_model))
    assert peft_model.get_base_model().config._attn_implementation == "sdpa"
    torch.testing.assert_close(tiny.logits(peft_model, ids, mask), before, atol=1e-5, rtol=1e-5)


def test_peft_revert_restores_base_weights_exactly(tiny):
    peft_model = _lora_model(tiny, seed=14)
    base_weights = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "base_layer" in n}
    assert base_weights
    accelerate_model(peft_model)
    revert_model(peft_model)
    for name, p in peft_model.named_parameters():
        if name in base_weights:
            assert torch.equal(p, base_weights[name]), name


@pytest.mark.parametrize("leave", ["unload", "merge_and_unload", "tuner_unload"])
def test_peft_unload_after_accelerating_gives_what_peft_gives(leave, tiny, hf_log):
    """peft's unload() keeps the base weights as they are: hf-accel's merge is undone first (logged), so the
    base model comes back exactly (merge_and_unload: LoRA merged by peft itself), not accelerated."""
    stock = _lora_model(tiny, seed=16)
    ours = copy.deepcopy(stock)
    ids, mask = tiny.batch(seed=17)
    want = getattr(stock.base_model if leave == "tuner_unload" else stock, leave.replace("tuner_", ""))()
    accelerate_model(ours)
    got = getattr(ours.base_model if leave == "tuner_unload" else ours, leave.replace("tuner_", ""))()
    assert not is_accelerated(got)
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        if leave.endswith("unload") and leave != "merge_and_unload":
            assert torch.equal(a, b), name  # the base weights bit for bit
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    assert torch.equal(tiny.greedy(got, ids, mask), tiny.greedy(want, ids, mask))
    assert [r for r in hf_log.records if "on a PeftModel whose LoRA adapters hf-accel merged" in r.getMessage()]


@pytest.mark.parametrize("how", ["train", "eval_with_autograd"])
def test_peft_training_after_accelerating_trains_the_adapters(how, tiny, hf_log):
    """Merged adapters get no gradient: train() (or a forward with autograd while LoRA parameters require grad)
    reverts hf-accel first, logged, and the LoRA gradients equal stock peft's."""
    stock = _lora_model(tiny, seed=18)
    ours = copy.deepcopy(stock)
    ids, mask = tiny.batch(seed=19)
    accelerate_model(ours)
    grads = []
    for m in (stock, ours):
        if how == "train":
            m.train()
        m(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if "lora_" in n})
    assert grads[0] and all(g is not None for g in grads[1].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)
    assert not is_accelerated(ours)
    assert [r for r in hf_log.records if "on a PeftModel whose LoRA adapters hf-accel merged" in r.getMessage()]
    ours.eval()
    accelerate_model(ours)  # and back to inference
    assert is_accelerated(ours) and torch.equal(tiny.greedy(ours, ids, mask), tiny.greedy(stock.eval(), ids, mask))


def test_peft_without_merge_is_refused(tiny):
    peft_model = _lora_model(tiny, seed=15)
    with pytest.raises(ValueError, match="merge_lora"):
        accelerate_model(peft_model, merge_lora=False)
    assert not is_accelerated(peft_model)
    assert not any(layer.merged for layer in _lora_layers(peft_model))


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


def test_public_api_exports():
    for name in ("accelerate_model", "revert_model", "is_accelerated", "SUPPORTED_MODEL_TYPES"):
        assert hasattr(hf_accel, name)


@pytest.mark.parametrize("speculative", [None, "prompt_lookup", "draft"])
def test_accelerated_model_deep_copies_and_pickles(tiny, speculative):
    """copy.deepcopy and torch.save/torch.load of an accelerated model that has generated (pools, steps and a
    call lock built) give an accelerated model of its own: its engine points at the copy, its tokens are
    stock's, and revert_model on it restores stock generate. The original keeps working."""
    import io

    model = tiny.model("llama", seed=30)
    ids, mask = tiny.batch(seed=31)
    stock = tiny.greedy(model, ids, mask)
    spec = tiny.model("llama", seed=32, num_hidden_layers=1) if speculative == "draft" else speculative
    accelerate_model(model, speculative=spec)
    assert torch.equal(tiny.greedy(model, ids, mask), stock)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert is_accelerated(copied) and copied.model is not model.model
        assert copied._hf_accel_engine.model is copied and copied._hf_accel_engine is not model._hf_accel_engine
        assert copied._hf_accel_engine.cache is None and not copied._hf_accel_engine.steps
        assert torch.equal(tiny.greedy(copied, ids, mask), stock)
        revert_model(copied)
        assert not is_accelerated(copied) and "generate" not in copied.__dict__
        assert torch.equal(tiny.greedy(copied, ids, mask), stock)
    assert torch.equal(tiny.greedy(model, ids, mask), stock)
    revert_model(model)


@pytest.mark.parametrize("generate_first", [False, True])
def test_revert_of_a_copy_reverts_its_copied_draft(tiny, generate_first):
    """A deep copy of a model whose draft model hf-accel accelerated carries an accelerated copy of the draft;
    revert_model on the copy reverts that copy too (whether or not the copy generated), and leaves the original
    pair as it was. A draft the user accelerated stays accelerated."""
    model = tiny.model("llama", seed=40)
    ids, mask = tiny.batch(seed=41)
    stock = tiny.greedy(model, ids, mask)
    draft = tiny.model("llama", seed=42, num_hidden_layers=1)
    accelerate_model(model, speculative=draft)
    assert torch.equal(tiny.greedy(model, ids, mask), stock) and is_accelerated(draft)
    copied = copy.deepcopy(model)
    copied_draft = copied.generate.keywords["speculative"].draft_model
    assert copied_draft is not draft and is_accelerated(copied_draft)
    if generate_first:
        assert torch.equal(tiny.greedy(copied, ids, mask), stock)
    revert_model(copied)
    assert not is_accelerated(copied) and not is_accelerated(copied_draft)
    assert is_accelerated(model) and is_accelerated(draft)
    assert torch.equal(tiny.greedy(model, ids, mask), stock)
    revert_model(model)
    assert not is_accelerated(draft)

    user_draft = accelerate_model(tiny.model("llama", seed=43, num_hidden_layers=1))
    accelerate_model(model, speculative=user_draft)
    assert torch.equal(tiny.greedy(model, ids, mask), stock)
    copied = copy.deepcopy(model)
    copied_draft = copied.generate.keywords["speculative"].draft_model
    revert_model(copied)
    assert is_accelerated(copied_draft) and is_accelerated(user_draft)
    revert_model(model)
    assert is_accelerated(user_draft)


def _peft_pair(tiny, seed):
    stock = _lora_model(tiny, seed=seed)
    return stock, accelerate_model(copy.deepcopy(stock))


def _reverted_logged(hf_log, what):
    return [r for r in hf_log.records if what in r.getMessage() and "reverted hf-accel first" in r.getMessage()]


@pytest.mark.parametrize("change", ["load_state_dict", "set_peft_model_state_dict", "lora_in_place", "lora_data",
                                    "scale_layer", "base_in_place", "base_data", "set_adapter"])
def test_peft_weights_changed_while_merged_give_what_stock_gives(change, tiny, hf_log):
    """The merged weights go stale when the adapters or the merged base weights change: hf-accel reverts first
    (load_state_dict: before anything loads) or at the next call (logged), and a base-weight edit survives."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    stock, ours = _peft_pair(tiny, seed=20)
    other = _lora_model(tiny, seed=21)
    ids, mask = tiny.batch(seed=22)
    for m in (stock, ours):
        with torch.no_grad():
            if change == "load_state_dict":
                m.load_state_dict(other.state_dict())
            elif change == "set_peft_model_state_dict":
                set_peft_model_state_dict(m, get_peft_model_state_dict(other))
            elif change == "lora_in_place":
                for n, p in m.named_parameters():
                    if "lora_B" in n:
                        p.mul_(3)
            elif change == "lora_data":  # through .data: no in-place version bump
                for n, p in m.named_parameters():
                    if "lora_B" in n:
                        p.data.mul_(3)
            elif change == "scale_layer":
                for layer in m.modules():
                    if isinstance(layer, LoraLayer):
                        layer.scale_layer(0.0)
            elif change == "set_adapter":  # peft unmerges the merged adapter (through .data), then switches
                from peft import LoraConfig

                torch.manual_seed(5)  # the new adapter's A is drawn at random
                m.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
                for n, p in m.named_parameters():
                    if "lora_B.b" in n:
                        p.copy_(torch.linspace(-0.3, 0.3, p.numel()).view_as(p))
                m.set_adapter("b")
            elif change == "base_data":
                m.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.data.add_(0.05)
            else:
                m.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.add_(0.05)
    want = tiny.greedy(stock, ids, mask)
    assert not torch.equal(want, tiny.greedy(_lora_model(tiny, seed=20), ids, mask))  # the change matters
    assert torch.equal(tiny.greedy(ours, ids, mask), want)
    assert not is_accelerated(ours) and _reverted_logged(hf_log, "")
    for (name, a), b in zip(ours.state_dict().items(), stock.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


def test_peft_state_dict_while_merged_holds_the_unmerged_weights(tiny, hf_log):
    """state_dict() of an accelerated PeftModel (what save / torch.save write) holds the weights as without
    hf-accel (a reload applied LoRA twice). A merged base weight given other storage with the same values (as the
    fused step's merged projections do to plain projections) is no change: calls do not revert, and
    revert_model stays exact."""
    stock, ours = _peft_pair(tiny, seed=23)
    ids, mask = tiny.batch(seed=24)
    want = tiny.greedy(stock, ids, mask, max_new_tokens=4)
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=4), want)
    q_weight = ours.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    q_weight.data = q_weight.data.clone()  # same values, other storage
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=4), want)
    assert is_accelerated(ours) and not _reverted_logged(hf_log, "")
    got = ours.state_dict()
    for name, value in stock.state_dict().items():
        assert torch.equal(got[name], value), name
    reloaded = _lora_model(tiny, seed=99)
    reloaded.load_state_dict(got)
    assert torch.equal(tiny.greedy(reloaded, ids, mask, max_new_tokens=4), want)
    revert_model(ours)
    for (name, a), b in zip(ours.state_dict().items(), stock.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("call", ["set_adapter", "disable_adapter", "add_adapter", "delete_adapter", "load_adapter",
                                  "unmerge_adapter", "disable_adapter_layers"])
def test_peft_adapter_calls_revert_first_and_keep_the_base_weights_exact(call, tiny, hf_log, tmp_path):
    """peft's adapter calls unmerge a merged adapter by subtracting its delta, which leaves float rounding in the
    base weights: on an accelerated PeftModel they revert hf-accel first (logged), which copies the base weights
    back bit for bit, so the model's tokens and state dict equal stock peft's exactly."""
    from peft import LoraConfig

    def add(m, name, seed):
        torch.manual_seed(seed)  # the new adapter's A is drawn at random
        m.add_adapter(name, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if f"lora_B.{name}" in n:
                    p.copy_(torch.linspace(-0.3, 0.3, p.numel()).view_as(p))

    stock = _lora_model(tiny, seed=25)
    add(stock, "b", seed=26)
    ours = accelerate_model(copy.deepcopy(stock))
    _lora_model(tiny, seed=27).save_pretrained(tmp_path)
    ids, mask = tiny.batch(seed=28)
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=4), tiny.greedy(stock, ids, mask, max_new_tokens=4))
    assert all(layer.merged for layer in _lora_layers(ours))  # hf-accel holds the adapter merged
    outs = []
    for m in (stock, ours):
        if call == "disable_adapter":
            with m.disable_adapter():
                outs.append(tiny.greedy(m, ids, mask, max_new_tokens=4))
        else:
            if call == "add_adapter":
                add(m, "c", seed=29)
            elif call == "load_adapter":
                m.load_adapter(str(tmp_path), adapter_name="c")
            elif call == "set_adapter":
                m.set_adapter("b")
            elif call == "delete_adapter":
                m.delete_adapter("b")
            else:
                getattr(m.base_model, call)()
            outs.append(tiny.greedy(m, ids, mask, max_new_tokens=4))
    assert torch.equal(outs[1], outs[0])
    assert not is_accelerated(ours) and _reverted_logged(hf_log, f"{call}()")
    got = ours.state_dict()
    assert got.keys() == stock.state_dict().keys()
    for name, value in stock.state_dict().items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("wrap", ["lora_on_embed_tokens", "trainable_tokens"])
def test_peft_wrapped_embedding_gives_stock_tokens_on_the_fast_path(wrap, tiny, hf_log):
    """peft wraps the input embedding when LoRA or trainable tokens target it (``lora.Embedding``,
    ``TrainableTokensWrapper``, neither with ``num_embeddings``): generate takes the fast path with the wrapped
    embedding's rows and gives stock peft's tokens."""
    from peft import LoraConfig, get_peft_model

    base = tiny.model("llama", seed=30)
    if wrap == "trainable_tokens":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[3, 4, 5, 6])
    else:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    stock = get_peft_model(base, config).eval()
    torch.manual_seed(31)
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name or "trainable_tokens_delta" in name:
                p.normal_(0.0, 0.5)
    ours = accelerate_model(copy.deepcopy(stock))
    ids, mask = tiny.batch(seed=32)
    ids = ids.masked_fill((ids > 6) & (torch.arange(ids.shape[1]) % 3 == 0), 4)  # the trained tokens in the prompt
    want = tiny.greedy(stock, ids, mask)
    with stock.disable_adapter():
        assert not torch.equal(tiny.greedy(stock, ids, mask), want)  # the wrapped embedding matters
    assert torch.equal(tiny.greedy(ours, ids, mask), want)
    assert is_accelerated(ours)
    assert [r for r in hf_log.records if "generate runs the fast decode path" in r.getMessage()]


@pytest.mark.parametrize("leave", ["revert_model", "merge_and_unload", "unmerge_adapter"])
def test_peft_adapters_the_caller_merged_stay_merged_after_revert(leave, tiny, hf_log):
    """A caller's own merge_adapter() before accelerate_model: revert (and the calls that revert first) leave the
    adapters merged as found, flags and weights (peft's unmerge cleared the flags while the copied-back weights
    still held the merge: LoRA applied twice afterwards)."""
    stock = _lora_model(tiny, seed=33)
    stock.merge_adapter()
    ours = copy.deepcopy(stock)
    ids, mask = tiny.batch(seed=34)
    accelerate_model(ours)
    assert torch.equal(tiny.greedy(ours, ids, mask, max_new_tokens=4), tiny.greedy(stock, ids, mask, max_new_tokens=4))
    if leave == "revert_model":
        revert_model(ours)
    elif leave == "merge_and_unload":
        stock, ours = stock.merge_and_unload(), ours.merge_and_unload()
    else:
        stock.base_model.unmerge_adapter()
        ours.base_model.unmerge_adapter()
    assert not is_accelerated(ours)
    if leave != "merge_and_unload":
        assert [m.merged_adapters for m in _lora_layers(ours)] == [m.merged_adapters for m in _lora_layers(stock)]
    for (name, a), b in zip(ours.state_dict().items(), stock.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(tiny.logits(ours, ids, mask), tiny.logits(stock, ids, mask))


@pytest.mark.parametrize("how", ["context", "layers"])
def test_peft_with_disabled_adapters_is_refused(how, tiny):
    """Disabled adapters (peft's forward unmerges them): accelerate_model names it and changes nothing."""
    model = _lora_model(tiny, seed=35)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if how == "layers":
        model.base_model.disable_adapter_layers()
        with pytest.raises(ValueError, match="adapters are disabled"):
            accelerate_model(model)
    else:
        with model.disable_adapter():
            with pytest.raises(ValueError, match="adapters are disabled"):
                accelerate_model(model)
    assert not is_accelerated(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
