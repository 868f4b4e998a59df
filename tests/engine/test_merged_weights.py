"""Merged Q/K/V and gate/up projections (the fused step's) and the built steps follow the model's weights: replacing
a Parameter, buffer or module, or the storage behind a Parameter (``param.data = t``), drops the steps and merged
matrices, which the next call builds again from the current weights; edits in place keep them."""

from __future__ import annotations

import copy

import pytest
import torch
from fast_generate_helpers import _accelerated, _generate

from hf_accel import accelerate_model
from hf_accel.engine.merged_weights import merge_projections
from hf_accel.engine.weight_snapshot import snapshot_intact, weight_snapshot


def _merge(engine):
    """What the fused step does on CUDA when it is first built (the CPU path reads the modules directly)."""
    engine.merged = merge_projections(engine.model)
    engine.snapshot = weight_snapshot(engine.model)
    assert engine.merged and snapshot_intact(engine.snapshot)


def test_load_state_dict_drops_the_merged_matrices_first(tiny):
    """load_state_dict gives the projections their own storage back before it loads: in place it fills them, and
    with assign=True the old merged matrices are freed at once (they stayed in memory beside the new weights until
    the next generate). The next fused step merges the current weights again."""
    import gc
    import weakref

    model = tiny.model("llama", seed=70)
    other = tiny.model("llama", seed=71)
    ids, mask = tiny.batch(seed=72)
    want = tiny.greedy(copy.deepcopy(other), ids, mask)
    accelerate_model(model)
    engine = model._hf_accel_engine
    _merge(engine)
    model.load_state_dict(other.state_dict())
    assert engine.merged is None and engine.snapshot is None and engine._model_reason() is None
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, other.model.layers[0].self_attn.q_proj.weight)
    _merge(engine)
    old = weakref.ref(engine.merged[0].qkv_weight)
    model.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    gc.collect()
    assert engine.merged is None and old() is None
    assert engine._model_reason() is None and not engine.steps
    assert torch.equal(tiny.greedy(model, ids, mask), want)


def test_a_new_parameter_on_one_projection_is_noticed(tiny):
    model = accelerate_model(tiny.model("llama", seed=73))
    engine = model._hf_accel_engine
    _merge(engine)
    proj = model.model.layers[1].mlp.up_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().clone() * 2)
    engine._model_reason()
    assert engine.merged is None
    assert proj.weight.untyped_storage().data_ptr() != model.model.layers[1].mlp.gate_proj.weight.untyped_storage(
    ).data_ptr()


def _set_data(module, name, value):
    getattr(module, name).data = value


def _new_parameter(module, name, value):
    setattr(module, name, torch.nn.Parameter(value))


@pytest.mark.interpreter
@pytest.mark.parametrize("how", [_set_data, _new_parameter], ids=["data", "parameter"])
@pytest.mark.parametrize("where", ["mlp.up_proj", "self_attn.o_proj", "post_attention_layernorm"])
def test_fused_steps_follow_replaced_weights(tiny, decode_steps, how, where):
    """After a generate on the fused step (merged projections; on a GPU, graphs holding the weights' addresses), a
    weight given new storage, merged (up_proj) or not (o_proj, a norm), is what the next generate uses, as in stock.
    ``param.data = t`` used to be missed: the merged matrices and steps kept the old weights."""
    model = tiny.model("llama", seed=74)
    ids, mask = tiny.batch(seed=75)
    ours = _accelerated(model, fused=True)
    _generate(ours, ids, mask, tiny.PAD, max_new_tokens=3)
    engine = ours._hf_accel_engine
    assert engine.steps and engine.merged and decode_steps
    for m in (model, ours):
        module = m.model.layers[1].get_submodule(where)
        how(module, "weight", torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(76)))
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=3)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=3), stock)
    assert engine.steps and engine.merged  # built again, from the new weights


def test_state_dict_gives_the_merged_projections_their_own_storage(tiny, tmp_path):
    """Savers that refuse or drop tensors sharing storage get an ordinary state dict: ``state_dict()`` unmerges the
    projections first (the next fused step merges them again). safetensors' ``save_model`` raised on the merged
    model, and accelerate's ``save_model`` wrote a checkpoint without the k/v/up projections."""
    from safetensors.torch import load_model, save_model

    model = tiny.model("llama", seed=77)
    ids, mask = tiny.batch(seed=78)
    stock = tiny.greedy(copy.deepcopy(model), ids, mask)
    accelerate_model(model)
    engine = model._hf_accel_engine
    _merge(engine)
    layer = model.model.layers[0]
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == engine.merged[0].qkv_weight.data_ptr()
    state = model.state_dict()
    assert engine.merged is None and engine.snapshot is None and not engine.steps
    storages = [t.untyped_storage().data_ptr() for t in state.values()]
    assert len(set(storages)) == len(storages)  # no two entries share storage
    save_model(model, str(tmp_path / "model.safetensors"))
    fresh = tiny.model("llama", seed=79)
    assert not load_model(fresh, str(tmp_path / "model.safetensors"))[0]  # nothing missing
    assert torch.equal(tiny.greedy(fresh, ids, mask), stock)
    assert torch.equal(tiny.greedy(model, ids, mask), stock)


def test_a_pickled_merged_model_unmerges_for_state_dict_and_revert(tiny):
    """``torch.save`` keeps the merged projections' shared storage and the loaded copy's engine starts unmerged:
    its ``state_dict()`` and ``revert_model`` still give every projection its own storage (accelerate's save_model
    wrote such a copy's checkpoint without its k/v/up weights)."""
    import io

    from hf_accel import revert_model
    from hf_accel.engine.merged_weights import projections_share_storage

    model = tiny.model("llama", seed=80)
    accelerate_model(model)
    _merge(model._hf_accel_engine)
    for finish in ("state_dict", "revert"):
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded._hf_accel_engine.merged is None and projections_share_storage(loaded)
        if finish == "state_dict":
            state = loaded.state_dict()
            storages = [t.untyped_storage().data_ptr() for t in state.values()]
            assert len(set(storages)) == len(storages)
        else:
            revert_model(loaded)
        assert not projections_share_storage(loaded)


def test_state_dict_of_the_base_model_and_while_generate_holds_the_merge(tiny):
    """``model.model.state_dict()`` unmerges too; a state dict built while the engine stays merged (from inside a
    running generate of the same thread, or when another thread's generate merges again meanwhile) gets copies of
    the shared projection entries, while the tied or other entries stay as stock gives them."""
    model = tiny.model("llama", seed=81)
    accelerate_model(model)
    engine = model._hf_accel_engine
    _merge(engine)
    state = model.model.state_dict()
    assert engine.merged is None and len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state)
    _merge(engine)
    with engine.call_lock:  # what a streamer's callback inside generate sees: the merge stays
        state = model.state_dict()
    assert engine.merged is not None
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state)
    layer = model.model.layers[0].self_attn
    assert torch.equal(state["model.layers.0.self_attn.k_proj.weight"], layer.k_proj.weight)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["module", "fused"])
def test_steps_use_each_layers_attention_scaling_and_follow_its_changes(tiny, fused):
    """The decode step took layer 0's ``self_attn.scaling`` for every layer (the prefill used each layer's own, so
    only the later tokens differed), and numbers the steps read when built (an attention's scaling, a norm's
    epsilon: a CUDA graph holds them) were not in the snapshot, so a change after a generate was not seen."""
    model = tiny.model("llama", seed=80)
    ids, mask = tiny.batch(seed=81)
    plain = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6)
    model.model.layers[1].self_attn.scaling *= 4
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6)
    assert not torch.equal(stock, plain)  # the scaling matters to these tokens
    ours = _accelerated(model, fused=fused)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=6), stock)
    engine = ours._hf_accel_engine
    assert engine.snapshot is not None and snapshot_intact(engine.snapshot)
    for edit in ("scaling", "eps"):
        for m in (model, ours):
            if edit == "scaling":
                m.model.layers[0].self_attn.scaling *= 3
            else:
                m.model.layers[1].post_attention_layernorm.variance_epsilon = 0.5
        assert not snapshot_intact(engine.snapshot)
        stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6)
        assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=6), stock)
        assert snapshot_intact(engine.snapshot)  # steps built again from the current numbers


@pytest.mark.interpreter
@pytest.mark.parametrize("edit", ["inv_freq_in_place", "act_fn"])
def test_fused_steps_follow_rotary_frequencies_and_activation(tiny, edit):
    """The fused step computes its rotary cos/sin table once from ``inv_freq`` (an edit in place keeps the buffer's
    address, so the snapshot of addresses missed it) and its kernels compute SiLU whatever ``act_fn`` a layer has:
    both gave the old tokens. Now an in-place ``inv_freq`` edit rebuilds the steps, and a non-SiLU ``act_fn`` takes
    the module step."""
    model = tiny.model("llama", seed=86)
    ids, mask = tiny.batch(seed=87)
    ours = _accelerated(model, fused=True)
    plain = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=6), plain)
    for m in (model, ours):
        if edit == "inv_freq_in_place":
            with torch.no_grad():
                m.model.rotary_emb.inv_freq.mul_(3.0)
        else:
            m.model.layers[1].mlp.act_fn = torch.nn.GELU()
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6)
    assert not torch.equal(stock, plain)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=6), stock)
    fused = [s.fused for s in ours._hf_accel_engine.steps.values()]
    assert fused and all(fused) == (edit == "inv_freq_in_place")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "peft-lora"])
def test_a_second_call_keeps_the_steps_and_snapshot(kind, tiny):
    """Nothing a generate call does itself (transformers' or peft's forward, the cache, the engine) looks like a
    change to the weight snapshot: the second call finds it intact and keeps the built steps (a snapshot that saw
    a change at every call would rebuild, on CUDA recapture, every step at every call)."""
    model = tiny.model("llama" if kind == "peft-lora" else kind, seed=7)
    if kind == "peft-lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).eval()
    ids, mask = tiny.batch(seed=8)
    accelerate_model(model)
    engine = (model.get_base_model() if kind == "peft-lora" else model)._hf_accel_engine
    first = tiny.greedy(model, ids, mask, max_new_tokens=3)
    steps, snapshot = dict(engine.steps), engine.snapshot
    assert steps and snapshot is not None and snapshot_intact(snapshot)
    assert torch.equal(tiny.greedy(model, ids, mask, max_new_tokens=3), first)
    assert engine.snapshot is snapshot and all(engine.steps.get(key) is step for key, step in steps.items())
