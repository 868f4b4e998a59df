"""convert_to_gqa / expand_kv_heads / permute_kv_heads on tiny random models of every family."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from hf_accel.conversion import (
    convert_to_gqa,
    expand_kv_heads,
    kv_cache_bytes_per_token,
    kv_head_choices,
    permute_kv_heads,
)
from hf_accel.conversion.heads import attention_modules

from gqa_tiny_models import VOCAB, build, logits, tokens, write_gguf

TIGHT = dict(rtol=1e-9, atol=1e-9)


def _make_groups_identical(model, new_kv: int) -> None:
    """Copy the first head of every group of K/V heads (weights and biases) over the others."""
    n = model.config.num_key_value_heads
    r = n // new_kv
    with torch.no_grad():
        for m in attention_modules(model):
            for proj in (m.k_proj, m.v_proj):
                w = proj.weight.view(n, -1, proj.in_features)
                b = None if proj.bias is None else proj.bias.view(n, -1)
                for g in range(new_kv):
                    w[g * r + 1 : (g + 1) * r] = w[g * r]
                    if b is not None:
                        b[g * r + 1 : (g + 1) * r] = b[g * r]


def _methods(model_type):
    return ["mean", "norm", "activation"] + ([] if model_type == "qwen3" else ["pca"])


@pytest.mark.parametrize("new_kv", [1, 2, 4])
def test_identical_heads_within_groups_convert_losslessly(model_type, new_kv):
    base = build(model_type, num_heads=8, num_kv_heads=8)
    _make_groups_identical(base, new_kv)
    ids, cal = tokens(), torch.randint(0, 97, (256,))
    ref = logits(base, ids)
    for method in _methods(model_type):
        model = convert_to_gqa(copy.deepcopy(base), new_kv, method=method, calibration_text=cal, context_length=64)
        torch.testing.assert_close(logits(model, ids), ref, rtol=1e-7, atol=1e-7, msg=f"method={method}")
    # and a random (not identical) MHA model really changes under pooling: the check above can fail
    other = build(model_type, num_heads=8, num_kv_heads=8)
    diff = (logits(convert_to_gqa(copy.deepcopy(other), new_kv), ids) - logits(other, ids)).abs().max()
    assert diff > 1e-3


def test_mean_pooling_shapes_biases_config(model_type):
    model = build(model_type, num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True) \
        if model_type == "llama" else build(model_type, num_heads=8, num_kv_heads=4, head_dim=8)
    before = copy.deepcopy(model)
    convert_to_gqa(model, 2)
    assert model.config.num_key_value_heads == 2
    for old, new in zip(attention_modules(before), attention_modules(model)):
        assert new.num_key_value_groups == 4
        for name in ("k_proj", "v_proj"):
            o, p = getattr(old, name), getattr(new, name)
            assert p.weight.shape == (2 * 8, 64) and p.out_features == 16
            want = o.weight.view(2, 2, 8, 64).mean(1).reshape(16, 64)
            torch.testing.assert_close(p.weight, want, **TIGHT)
            assert (o.bias is None) == (p.bias is None)
            if o.bias is not None:
                assert p.bias.shape == (16,)
                torch.testing.assert_close(p.bias, o.bias.view(2, 2, 8).mean(1).reshape(16), **TIGHT)
        for name in ("q_proj", "o_proj"):  # untouched
            assert torch.equal(getattr(old, name).weight, getattr(new, name).weight)
    if model_type in ("qwen2",) or model_type == "llama":
        assert attention_modules(model)[0].k_proj.bias is not None
    out = model.generate(tokens(1, 8), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)


def test_kv_cache_bytes_match_the_real_cache():
    model = build("llama", num_heads=8, num_kv_heads=8, dtype=torch.float32)
    convert_to_gqa(model, 2)
    with torch.no_grad():
        out = model(input_ids=tokens(1, 10), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    per_token = sum((layer.keys.numel() + layer.values.numel()) * 4 for layer in cache.layers) / 10
    assert kv_cache_bytes_per_token(model.config, torch.float32) == per_token
    assert cache.layers[0].keys.shape[1] == 2
    assert kv_cache_bytes_per_token(model.config, torch.bfloat16) == per_token / 2


@settings(max_examples=25, deadline=None)
@given(st.integers(-4, 20))
def test_bad_counts_raise_with_valid_choices(n):
    model = build("llama", num_heads=12, num_kv_heads=6, layers=1)
    if n in (1, 2, 3, 6):
        return
    with pytest.raises(ValueError, match=r"valid choices .*\[1, 2, 3, 6\]"):
        convert_to_gqa(model, n)
    assert model.config.num_key_value_heads == 6  # nothing changed


@pytest.mark.parametrize("bad", [2.0, "2", None, True, torch.tensor(2.0), torch.tensor([2])])
def test_non_int_counts_raise(bad):
    with pytest.raises(ValueError, match="valid choices"):
        convert_to_gqa(build("llama", layers=1), bad)


@pytest.mark.parametrize("count", [np.int64(2), np.int32(2), torch.tensor(2)], ids=["np.int64", "np.int32", "tensor"])
def test_numpy_and_tensor_integer_counts_are_taken_as_ints(count, tmp_path):
    """An integer count from numpy or a 0-d tensor works as the int it holds; the config gets a plain int, which
    save_pretrained writes as JSON (before: refused, "must be an int")."""
    model = build("llama", layers=1, dtype=torch.float32)
    want = convert_to_gqa(copy.deepcopy(model), 2)
    got = convert_to_gqa(model, count)
    assert type(got.config.num_key_value_heads) is int and got.config.num_key_value_heads == 2
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    got.save_pretrained(tmp_path)


def test_bad_arguments_raise():
    model = build("llama", layers=1)
    with pytest.raises(ValueError, match="unknown method"):
        convert_to_gqa(model, 2, method="median")
    with pytest.raises(ValueError, match="unknown grouping"):
        convert_to_gqa(model, 2, grouping="random")
    for bad in (0, -1, 2.5):  # 0 raised range()'s "arg 3 must not be zero"
        with pytest.raises(ValueError, match=rf"batch_size \(calibration windows per forward pass\) must be an int >= 1; got {bad}"):
            convert_to_gqa(model, 2, method="activation", calibration_text=torch.arange(90), batch_size=bad)
    with pytest.raises(ValueError, match="calibration_tokens must be an int >= 1; got 0"):
        convert_to_gqa(model, 2, method="activation", calibration_text=torch.arange(90), calibration_tokens=0)
    with pytest.raises(ValueError, match="needs calibration_text"):
        convert_to_gqa(model, 2, method="activation")
    with pytest.raises(ValueError, match="needs calibration_text"):
        convert_to_gqa(model, 2, grouping="similarity")
    with pytest.raises(ValueError, match="tokenizer"):
        convert_to_gqa(model, 2, method="activation", calibration_text="some text")
    with pytest.raises(ValueError, match="at least context_length"):
        convert_to_gqa(model, 2, method="activation", calibration_text=torch.arange(10), context_length=64)
    with pytest.raises(ValueError, match="qwen3"):
        convert_to_gqa(build("qwen3", layers=1), 2, method="pca", calibration_text=torch.arange(90))
    vocab = model.get_input_embeddings().num_embeddings
    for bad in (torch.arange(vocab - 5, vocab + 95), torch.arange(-1, 99)):  # ids the embedding has no row for
        with pytest.raises(ValueError, match=rf"calibration token ids must lie in \[0, {vocab}\)"):
            convert_to_gqa(model, 2, method="activation", calibration_text=bad, context_length=64)
    assert model.config.num_key_value_heads == 8  # refused before anything changed
    max_pos = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"context_length={max_pos + 1} is more than the model's {max_pos} "
                                         r"positions \(max_position_embeddings\)"):
        convert_to_gqa(model, 2, method="activation", calibration_text=torch.arange(2 * max_pos + 2) % vocab,
                       context_length=max_pos + 1)
    assert model.config.num_key_value_heads == 8
    # lengths that are not ints >= 2 (64.0 failed inside a slice; 1 and True built 1-token windows), and fewer
    # calibration tokens than one window (was reported as too little calibration text)
    for bad, message in ((64.0, "context_length must be an int; got 64.0"), (True, "context_length must be an int"),
                         (1, "context_length must be an int >= 2; got 1")):
        with pytest.raises(ValueError, match=message):
            convert_to_gqa(model, 2, method="activation", calibration_text=torch.arange(90), context_length=bad)
    with pytest.raises(ValueError, match="calibration_tokens=40 is less than context_length=64: not one calibration "
                                         "window"):
        convert_to_gqa(model, 2, method="activation", calibration_text=torch.arange(90), context_length=64,
                       calibration_tokens=40)
    assert model.config.num_key_value_heads == 8
    assert kv_head_choices(model) == [1, 2, 4, 8]


def test_unsupported_models_raise():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50))
    for fn in (lambda: convert_to_gqa(gpt2, 1), lambda: expand_kv_heads(gpt2)):
        with pytest.raises(ValueError, match="model_type 'gpt2'.*llama"):
            fn()
    with pytest.raises(TypeError, match="PreTrainedModel"):
        convert_to_gqa(torch.nn.Linear(2, 2), 1)


def test_expand_then_pool_back_is_exact(model_type):
    base = build(model_type, num_heads=8, num_kv_heads=2)
    ids = tokens()
    ref = logits(base, ids)
    model = expand_kv_heads(copy.deepcopy(base))
    assert model.config.num_key_value_heads == 8
    assert attention_modules(model)[0].num_key_value_groups == 1
    torch.testing.assert_close(logits(model, ids), ref, **TIGHT)
    convert_to_gqa(model, 2)
    for a, b in zip(attention_modules(base), attention_modules(model)):
        for name in ("k_proj", "v_proj"):
            torch.testing.assert_close(getattr(b, name).weight, getattr(a, name).weight, **TIGHT)
    torch.testing.assert_close(logits(model, ids), ref, **TIGHT)
    with pytest.raises(ValueError, match=r"valid choices: \[2, 4, 8\]"):
        expand_kv_heads(model, 3)
    for bad in (True, 4.0, torch.tensor([4])):
        with pytest.raises(ValueError, match=r"valid choices: \[2, 4, 8\]"):
            expand_kv_heads(model, bad)


@pytest.mark.parametrize("count", [np.int64(4), torch.tensor(4)], ids=["numpy", "tensor"])
def test_expand_takes_the_integer_types_convert_takes(count):
    """A numpy or 0-d tensor integer is a count, as in :func:`convert_to_gqa` (it was refused with a message that
    listed the very value among the valid choices)."""
    base = build("llama", num_heads=8, num_kv_heads=2)
    ids = tokens()
    model = expand_kv_heads(copy.deepcopy(base), count)
    assert model.config.num_key_value_heads == 4 and type(model.config.num_key_value_heads) is int
    torch.testing.assert_close(logits(model, ids), logits(base, ids), **TIGHT)


def _shuffle(n: int, layers: int, size: int) -> list[torch.Tensor]:
    """Random per-layer orders that do not keep the adjacent groups of ``size`` heads (1 < size < n)."""
    orders = []
    for _ in range(layers):
        while True:
            order = torch.randperm(n)
            groups = {frozenset(order[i : i + size].tolist()) for i in range(0, n, size)}
            if groups != {frozenset(range(i, i + size)) for i in range(0, n, size)}:
                break
        orders.append(order)
    return orders


def test_permutation_alone_is_exact(model_type):
    model = build(model_type, num_heads=8, num_kv_heads=4)
    ids = tokens()
    ref = logits(model, ids)
    q_before = attention_modules(model)[0].q_proj.weight.clone()
    orders = _shuffle(4, 2, size=2)
    permute_kv_heads(model, orders)
    q_after = attention_modules(model)[0].q_proj.weight
    assert not torch.equal(q_before, q_after)  # query heads really moved with their KV head
    torch.testing.assert_close(q_after.view(4, 2, 8, -1), q_before.view(4, 2, 8, -1)[orders[0]])
    torch.testing.assert_close(logits(model, ids), ref, **TIGHT)
    with pytest.raises(ValueError, match="permutation"):
        permute_kv_heads(model, [torch.tensor([0, 0, 1, 2])] * 2)
    # a bad order of a later layer leaves the earlier layers as they were; non-int entries are refused (0.5 was
    # truncated to 0 and accepted)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"orders\[1\] must be a permutation of range\(4\) \(ints\); "
                                         r"got \[0, 0, 1, 2\]"):
        permute_kv_heads(model, [[3, 2, 1, 0], [0, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"orders\[0\] must be a permutation .*got \[0.5, 1, 2, 3\]"):
        permute_kv_heads(model, [[0.5, 1, 2, 3], [0, 1, 2, 3]])
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("method", ["mean", "activation"])
def test_similarity_grouping_finds_shuffled_groups(method):
    base = build("qwen2", num_heads=8, num_kv_heads=2)
    ids, cal = tokens(), torch.randint(0, 97, (512,))
    ref = logits(base, ids)
    shuffled = permute_kv_heads(expand_kv_heads(copy.deepcopy(base)), _shuffle(8, 2, size=4))
    torch.testing.assert_close(logits(shuffled, ids), ref, **TIGHT)
    found = convert_to_gqa(copy.deepcopy(shuffled), 2, method=method, grouping="similarity",
                           calibration_text=cal, context_length=64)
    torch.testing.assert_close(logits(found, ids), ref, rtol=1e-7, atol=1e-7)
    adjacent = convert_to_gqa(copy.deepcopy(shuffled), 2, method=method, calibration_text=cal, context_length=64)
    assert (logits(adjacent, ids) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_save_pretrained_roundtrip_with_stock_transformers(tmp_path, model_type):
    model = build(model_type, num_heads=8, num_kv_heads=4, dtype=torch.float32)
    convert_to_gqa(model, 1)
    ids = tokens()
    ref = logits(model, ids)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config.num_key_value_heads == 1
    assert attention_modules(loaded)[0].k_proj.weight.shape == (8, 64)
    torch.testing.assert_close(logits(loaded, ids), ref, rtol=0, atol=0)


@pytest.mark.parametrize("new_kv", [2, 1], ids=["same-count", "pooled"])
def test_gguf_model_saves_after_conversion(tmp_path, hf_log, new_kv):
    """A model read with transformers' plain ``gguf_file=`` loader keeps its GGUF quantizer object, which
    save_pretrained refuses; every conversion, also one to the model's own KV head count (nothing to pool),
    drops it, so the converted model saves and stock transformers loads the same function back."""
    path = write_gguf(tmp_path / "tiny.gguf", num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert getattr(model, "hf_quantizer", None) is not None  # the case under test
    ids = tokens()
    before = logits(model, ids)
    assert convert_to_gqa(model, new_kv) is model
    ref = logits(model, ids)
    if new_kv == 2:
        torch.testing.assert_close(ref, before, rtol=0, atol=0)
        assert any("already has 2 KV heads" in r.getMessage() for r in hf_log.records)
    model.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert loaded.config.num_key_value_heads == new_kv
    assert getattr(loaded.config, "quantization_config", None) is None
    torch.testing.assert_close(logits(loaded, ids), ref, rtol=0, atol=0)


def test_gguf_model_from_our_loader_saves_without_conversion(tmp_path):
    """``load_model`` reads a GGUF file dequantized (``GgufConfig(dequantize=True)``): plain weights, no
    quantizer object left, so the model saves as it is and stock transformers loads the same function."""
    from hf_accel.models.loading import load_model

    model, _ = load_model(write_gguf(tmp_path / "tiny.gguf", num_heads=4, num_kv_heads=2), tokenizer=False)
    assert getattr(model, "hf_quantizer", None) is None
    ids = tokens()
    ref = logits(model, ids)
    model.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert getattr(loaded.config, "quantization_config", None) is None
    torch.testing.assert_close(logits(loaded, ids), ref, rtol=0, atol=0)


def test_accelerated_model_must_be_reverted_first():
    from hf_accel import accelerate_model, revert_model

    model = accelerate_model(build("llama", layers=1, dtype=torch.float32))
    with pytest.raises(ValueError, match="revert_model"):
        convert_to_gqa(model, 2)
    revert_model(model)
    convert_to_gqa(model, 2)
    accelerate_model(model)
    out = model.generate(tokens(1, 8), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11)


# --- the pooling weights against their closed forms, on heads that differ ---------------------------------------


def _per_head_loop_norms(module, num_heads, num_kv_heads, d):
    """Per KV head: the summed squared norms of the q_proj rows and of the o_proj columns of the query heads that
    read it, head by head in Python (the module's docstring: ``norm``)."""
    rep = num_heads // num_kv_heads
    q, o = module.q_proj.weight.double(), module.o_proj.weight.double()
    sk, sv = torch.zeros(num_kv_heads, dtype=torch.float64), torch.zeros(num_kv_heads, dtype=torch.float64)
    for i in range(num_heads):
        sk[i // rep] += (q[i * d:(i + 1) * d] ** 2).sum()
        sv[i // rep] += (o[:, i * d:(i + 1) * d] ** 2).sum()
    return sk, sv


def test_norm_weights_equal_their_closed_form_on_differing_heads():
    from hf_accel.conversion.pooling import norm_weights

    num_heads, num_kv, new_kv, d = 8, 4, 2, 8
    module = attention_modules(build("llama", num_heads=num_heads, num_kv_heads=num_kv, head_dim=d))[0]
    a_k, a_v = norm_weights(module, num_kv, new_kv, d)
    sk, sv = _per_head_loop_norms(module, num_heads, num_kv, d)
    r = num_kv // new_kv
    for a, s in ((a_k, sk), (a_v, sv)):
        want = s.view(new_kv, r) / s.view(new_kv, r).sum(1, keepdim=True)
        assert not torch.allclose(want, torch.full_like(want, 1 / r), atol=1e-3)  # the heads' weights differ
        torch.testing.assert_close(a.double(), want[:, :, None, None] * torch.eye(d, dtype=torch.float64))


def test_activation_weights_equal_their_closed_form_on_sampled_inputs():
    """K: per RoPE frequency pair, the share of the query energy E[q_p^2 + q_{p+d/2}^2] of the query heads reading
    each KV head, measured on explicit input samples; V: (sum_j G_j)^-1 G_j with G_j = sum_i O_i^T O_i."""
    from hf_accel.conversion.pooling import activation_weights

    num_heads, num_kv, new_kv, d = 8, 4, 2, 8
    module = attention_modules(build("qwen2", num_heads=num_heads, num_kv_heads=num_kv, head_dim=d))[0]
    hidden, rep, r = module.q_proj.in_features, num_heads // num_kv, num_kv // new_kv
    x = torch.randn(4000, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1.5 + 0.2
    aug = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    moment = aug.T @ aug / len(x)
    a_k, a_v = activation_weights(module, num_heads, num_kv, new_kv, d, moment, ridge=0.0)

    q = module.q_proj(x).detach().view(len(x), num_heads, d)  # qwen2: q_proj has a bias
    energy = (q ** 2).mean(0)  # [heads, d]
    pair = energy[:, : d // 2] + energy[:, d // 2:]
    per_kv = torch.stack([pair[j * rep:(j + 1) * rep].sum(0) for j in range(num_kv)]).view(new_kv, r, d // 2)
    w = per_kv / per_kv.sum(1, keepdim=True)
    want_k = torch.diag_embed(torch.cat([w, w], dim=-1))
    torch.testing.assert_close(a_k.double(), want_k, rtol=1e-9, atol=1e-9)

    o = module.o_proj.weight.detach().double()
    grams = torch.zeros(num_kv, d, d, dtype=torch.float64)
    for i in range(num_heads):
        block = o[:, i * d:(i + 1) * d]
        grams[i // rep] += block.T @ block
    grams = grams.view(new_kv, r, d, d)
    want_v = torch.stack([torch.stack([torch.linalg.solve(grams[g].sum(0), grams[g, j]) for j in range(r)])
                          for g in range(new_kv)])
    assert (want_v - torch.eye(d, dtype=torch.float64) / r).abs().max() > 1e-2  # not the mean
    torch.testing.assert_close(a_v.double(), want_v, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("how", ["pool", "pool-similarity", "expand"])
def test_a_layer_that_fails_leaves_every_layer_as_before(how, monkeypatch):
    """The surgery of the last layer raises (as PCA's eigensolver did on a NaN weight): the layers done before it
    are put back, so the model is whole (same Parameters, shapes, head counts, logits) and can be converted
    again."""
    from hf_accel.conversion import gqa

    model = build("llama", num_heads=8, num_kv_heads=4, head_dim=8, layers=3, attention_bias=True)
    ids = tokens(1, 12)
    want = logits(model, ids)
    params = {name: p for name, p in model.named_parameters()}
    calls = []
    name = "expand_module_kv" if how == "expand" else "pool_module_kv"
    original = getattr(gqa, name)

    def fail_last(module, *args):
        calls.append(module)
        if len(calls) == model.config.num_hidden_layers:
            raise RuntimeError("linalg.eigh: failed to converge (simulated)")
        return original(module, *args)

    monkeypatch.setattr(gqa, name, fail_last)
    with pytest.raises(RuntimeError, match="simulated"):
        if how == "expand":
            expand_kv_heads(model, 8)
        else:
            grouping = "similarity" if how == "pool-similarity" else "adjacent"
            kw = dict(calibration_text=tokens(1, 64), calibration_tokens=64, context_length=32) \
                if grouping == "similarity" else {}
            convert_to_gqa(model, 2, grouping=grouping, **kw)
    assert model.config.num_key_value_heads == 4
    assert {name: p for name, p in model.named_parameters()} == params  # the same Parameter objects
    for module in attention_modules(model):
        assert module.k_proj.weight.shape == (32, 64) and module.k_proj.out_features == 32
        assert module.num_key_value_groups == 2
    torch.testing.assert_close(logits(model, ids), want, rtol=0, atol=0)
    monkeypatch.setattr(gqa, name, original)
    convert_to_gqa(model, 2)  # and the model still converts
    assert all(m.k_proj.weight.shape == (16, 64) for m in attention_modules(model))


def test_pca_with_fewer_calibration_tokens_than_the_hidden_size_is_refused():
    """PCA inverts each layer's input second moment ([hidden + 1] square, rank <= tokens): from 2 tokens it gave
    v_proj weights ~3000x the source's, with no word; now a ValueError names the minimum. One token more than the
    hidden size converts, with weights of the source's size."""
    model = build("llama", num_heads=4, num_kv_heads=4, head_dim=8, layers=1, dtype=torch.float32)  # hidden 32
    cal = torch.arange(200) % VOCAB
    with pytest.raises(ValueError, match=r"method='pca' .* needs more calibration tokens than hidden_size=32; got "
                                         r"32 \(calibration_tokens=32, whole windows of context_length=16\)"):
        convert_to_gqa(copy.deepcopy(model), 2, method="pca", calibration_text=cal, context_length=16,
                       calibration_tokens=32)
    done = convert_to_gqa(copy.deepcopy(model), 2, method="pca", calibration_text=cal, context_length=11,
                          calibration_tokens=33)
    source = model.model.layers[0].self_attn.v_proj.weight.abs().max()
    assert done.model.layers[0].self_attn.v_proj.weight.abs().max() < 10 * source
