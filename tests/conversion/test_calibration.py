"""Calibration statistics, the balanced grouping search, and the LoRA recovery fine-tune."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel.conversion import convert_to_gqa, recover_with_lora
from hf_accel.conversion.calibration import (
    balanced_groups,
    calibration_windows,
    collect_input_moments,
    head_distances,
    partition_cost,
)
from hf_accel.conversion.heads import attention_modules

from gqa_tiny_models import build, tokens


def _random_distances(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    points = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return torch.cdist(points, points) ** 2


def _brute_force_best(dist: torch.Tensor, size: int) -> float:
    n = dist.shape[0]
    best = float("inf")
    for perm in itertools.permutations(range(n)):
        groups = [list(perm[i : i + size]) for i in range(0, n, size)]
        best = min(best, partition_cost(dist, groups))
    return best


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([(6, 2), (6, 3)]), st.integers(0, 10_000))
def test_exhaustive_grouping_is_optimal(shape, seed):
    n, groups = shape
    dist = _random_distances(n, seed)
    found = balanced_groups(dist, groups)
    assert sorted(h for g in found for h in g) == list(range(n))
    assert all(len(g) == n // groups for g in found)
    assert partition_cost(dist, found) == pytest.approx(_brute_force_best(dist, n // groups), rel=1e-9, abs=1e-12)


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 10_000))
def test_local_search_grouping_is_valid_and_no_worse_than_adjacent(seed):
    dist = _random_distances(16, seed)  # 2.6M partitions: local search path
    found = balanced_groups(dist, 4)
    assert sorted(h for g in found for h in g) == list(range(16))
    adjacent = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    assert partition_cost(dist, found) <= partition_cost(dist, adjacent) + 1e-12


def test_planted_clusters_are_recovered_by_local_search():
    g = torch.Generator().manual_seed(1)
    labels = torch.randperm(16, generator=g) % 4  # 4 planted groups of 4, shuffled
    points = torch.eye(4)[labels] * 10 + 0.01 * torch.randn(16, 4, generator=g)
    found = balanced_groups(torch.cdist(points, points) ** 2, 4)
    assert {frozenset(grp) for grp in found} == {frozenset(torch.nonzero(labels == k).flatten().tolist())
                                                  for k in range(4)}


def test_input_moments_match_the_hidden_states():
    model = build("qwen2", num_heads=4, num_kv_heads=2, layers=2)
    ids = torch.randint(0, 97, (3, 16))
    moments = collect_input_moments(model, ids, batch_size=2)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    for layer_idx, (layer, moment) in enumerate(zip(model.model.layers, moments)):
        x = layer.input_layernorm(hidden[layer_idx])
        x = torch.cat([x.reshape(-1, x.shape[-1]), torch.ones(48, 1, dtype=x.dtype)], dim=1)
        torch.testing.assert_close(moment, x.T @ x / 48, rtol=1e-9, atol=1e-12)


def test_head_distances_are_zero_for_equal_heads_and_positive_otherwise():
    model = build("llama", num_heads=4, num_kv_heads=4, layers=1)
    module = attention_modules(model)[0]
    with torch.no_grad():
        for proj in (module.k_proj, module.v_proj):
            proj.weight.view(4, 8, -1)[1] = proj.weight.view(4, 8, -1)[0]
    moment = collect_input_moments(model, tokens(2, 16))[0]
    dist = head_distances(module, 4, moment)
    assert dist[0, 1] < 1e-12 and dist[1, 0] < 1e-12
    off = dist + torch.eye(4)
    off[0, 1] = off[1, 0] = 1.0
    assert (off > 1e-3).all()
    torch.testing.assert_close(dist, dist.T)


def test_calibration_windows():
    ids = torch.arange(100)
    assert calibration_windows(ids, 30, 1000).shape == (3, 30)
    assert calibration_windows(ids[None], 30, 70).shape == (2, 30)
    for shape in ((2, 50), (1, 1, 100)):  # several rows are not read as one text across their boundary
        with pytest.raises(ValueError, match=re.escape(f"calibration token ids must be one text, [n] or [1, n]; "
                                                       f"got shape {shape}")):
            calibration_windows(ids.reshape(shape), 30, 1000)
    with pytest.raises(ValueError, match="at least context_length"):
        calibration_windows(ids, 200, 1000)


def test_lora_recovery_lowers_the_loss_and_returns_a_plain_model():
    model = build("llama", num_heads=4, num_kv_heads=4, layers=2, dtype=torch.float32)
    convert_to_gqa(model, 1)
    pattern = torch.randint(0, 97, (40,))
    train = pattern.repeat(20)
    cls = type(model)
    merged, stats = recover_with_lora(model, train, steps=30, seq_len=32, batch_size=4, lr=1e-2, rank=4)
    assert type(merged) is cls
    assert all(type(getattr(m, p)) is torch.nn.Linear for m in attention_modules(merged)
               for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert stats.last_loss < 0.7 * stats.first_loss
    assert stats.steps == 30 and len(stats.losses) == 30 and stats.trainable_parameters > 0
    assert merged.config.num_key_value_heads == 1
    with pytest.raises(ValueError, match="more than seq_len"):
        recover_with_lora(build("llama", layers=1, dtype=torch.float32), torch.arange(10), seq_len=32)


@pytest.mark.parametrize("ids, settings, message", [
    ([1, 2, 3] * 50, {}, "train_ids must be a torch tensor of token ids; got list"),
    (torch.ones(150), {}, "train_ids must hold integer token ids; got a torch.float32 tensor"),
    (torch.full((150,), 999), {}, r"train_ids must lie in \[0, 97\) \(the model's vocabulary\); got 999 .. 999"),
    (torch.ones(2, 150, dtype=torch.long), {}, r"train_ids must be one text, \[n\] or \[1, n\]; got shape \(2, 150\)"),
    (torch.ones(150, dtype=torch.long), {"steps": 2.5}, "steps must be an int; got 2.5"),
    (torch.ones(150, dtype=torch.long), {"seq_len": 1}, "seq_len must be an int >= 2; got 1"),  # 0 targets: nan losses
    (torch.ones(400, dtype=torch.long), {"seq_len": 300},
     r"seq_len must be an int <= 256 \(the model's max_position_embeddings\); got 300"),
    (torch.ones(150, dtype=torch.long), {"lr": 0}, "lr must be a number > 0; got 0"),
])
def test_lora_recovery_refuses_bad_inputs_before_training(ids, settings, message):
    """Bad ids or settings raise ValueError naming them (were errors from inside torch, or nan losses / windows
    past the model's positions without complaint), and the model is left as it was."""
    model = build("llama", num_heads=4, num_kv_heads=4, layers=1, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        recover_with_lora(model, ids, steps=settings.pop("steps", 2), seq_len=settings.pop("seq_len", 16), **settings)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not hasattr(model, "peft_config")
