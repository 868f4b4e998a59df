"""Merged Q/K/V and gate/up projections (the fused step's) follow the model's Parameters: replacing one drops
the merged matrices, which the next fused step builds again from the current weights."""

from __future__ import annotations

import copy

import torch

from hf_accel import accelerate_model
from hf_accel.engine.merged_weights import merge_projections, projection_parameters, views_intact


def _merge(engine):
    """What the fused step does on CUDA when it is first built (the CPU path reads the modules directly)."""
    engine.merged = merge_projections(engine.model)
    engine._merged_params = projection_parameters(engine.model)
    assert engine.merged and views_intact(engine._merged_params)


def test_replaced_parameters_drop_the_merged_matrices(tiny):
    model = tiny.model("llama", seed=70)
    other = tiny.model("llama", seed=71)
    ids, mask = tiny.batch(seed=72)
    want = tiny.greedy(copy.deepcopy(other), ids, mask)
    accelerate_model(model)
    engine = model._hf_accel_engine
    _merge(engine)
    qkv = engine.merged[0].qkv_weight
    # an in-place load keeps the merged matrices (they are the modules' storage) and fills them
    model.load_state_dict(other.state_dict())
    assert engine._model_reason() is None and engine.merged is not None
    assert torch.equal(qkv[: model.model.layers[0].self_attn.q_proj.weight.shape[0]],
                       other.model.layers[0].self_attn.q_proj.weight)
    # assign=True replaces the Parameters: the merged matrices would be stale
    model.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    assert not views_intact(engine._merged_params)
    assert engine._model_reason() is None and engine.merged is None and not engine.steps
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
