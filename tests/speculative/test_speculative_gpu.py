"""Speculative decoding on CUDA: the verify round captured in CUDA graphs with the fused Triton step."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_accel import SpeculativeConfig, accelerate_model, speculative_stats

pytestmark = pytest.mark.gpu
LAYERS = 4


def _truncated(model, layers):
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:layers])
    draft.config.num_hidden_layers = layers
    return draft


def _batch(tiny):
    ids, mask = tiny.batch(seed=0, lengths=(14, 9, 6))
    w = ids.shape[1]
    for row, n in enumerate((14, 9, 6)):
        ids[row, w - n // 2:] = ids[row, w - n: w - n + n // 2]
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("method", ["prompt_lookup", "early_exit", "draft_model"])
def test_greedy_identical_to_the_plain_fast_path(method, adaptive, tiny):
    model = tiny.model("llama", num_hidden_layers=LAYERS).cuda()
    ids, mask = _batch(tiny)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tiny.PAD, eos_token_id=None)
    plain_model = accelerate_model(copy.deepcopy(model))
    with torch.no_grad():
        plain = plain_model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    draft = _truncated(model, LAYERS) if method == "draft_model" else None
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(
        method, draft_model=draft, num_draft_tokens=3, adaptive=adaptive))
    for rows in (1, 3):
        with torch.no_grad():
            out = ours.generate(input_ids=ids[:rows], attention_mask=mask[:rows], **kwargs)
            out2 = ours.generate(input_ids=ids[:rows], attention_mask=mask[:rows], **kwargs)  # graphs replayed
        assert torch.equal(out, plain[:rows]) and torch.equal(out2, out)
        assert speculative_stats(ours)["verify_steps"] + speculative_stats(ours)["backed_off_steps"] > 0
    engines = ours._hf_accel_spec_engines
    assert any(e.graphs for e in engines.values()), "no verify round was captured in a CUDA graph"


def test_sampling_in_graphs_draws_valid_tokens(tiny):
    model = tiny.model("llama", num_hidden_layers=LAYERS).cuda()
    ids, mask = _batch(tiny)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("early_exit", exit_layer=3,
                                                                               adaptive=False))
    seen = []
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=20,
                                pad_token_id=tiny.PAD, eos_token_id=None)
        new = out[:, ids.shape[1]:]
        assert new.shape == (3, 16) and ((new >= 0) & (new < model.config.vocab_size)).all()
        seen.append(new)
    assert not torch.equal(seen[0], seen[1])  # the graph's random draws change between replays


@pytest.mark.parametrize("burst", [1, 3])
def test_match_gated_rounds_in_graphs(burst, tiny, monkeypatch):
    """Match-gated prompt lookup with every draft length the chooser can pick, plain rounds between (in bursts
    of ``burst`` replays per host sync): greedy equals the plain fast path, and the state holds the in-graph
    lookup of the final tokens."""
    from hf_accel.kernels.ngram_lookup import ngram_lookup_ref
    from hf_accel.speculative.draft_length import _GatedChooser

    picks = []

    def choose(self, counts, max_remaining=None, burst=True):  # cycles 3, 0, 1, 2 over rounds a row matched
        matched = [k for k in picks if k >= 0]
        picks.append((3, 0, 1, 2)[len(matched) % 4] if any(counts[1:]) else -1)
        return (picks[-1], 1) if picks[-1] > 0 else (0, burst)

    monkeypatch.setattr(_GatedChooser, "choose", choose)
    model = tiny.model("llama", num_hidden_layers=LAYERS).cuda()
    ids, mask = _batch(tiny)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tiny.PAD, eos_token_id=None)
    with torch.no_grad():
        plain = accelerate_model(copy.deepcopy(model)).generate(input_ids=ids, attention_mask=mask, **kwargs)
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=3,
                                                                               match_gated=True))
    for _ in range(2):
        with torch.no_grad():
            out = ours.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert torch.equal(out, plain)
        stats = speculative_stats(ours)
        assert stats["match_gated"] and stats["verify_steps"] > 0 and stats["backed_off_steps"] > 0, stats
    assert {1, 2, 3} <= set(picks)
    (engine,) = ours._hf_accel_spec_engines.values()
    assert engine.graphs
    (st,) = engine.states.values()
    drafts, valid, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 3, with_ngram=True)
    assert torch.equal(st.drafts, drafts) and torch.equal(st.valid, valid) and torch.equal(st.ngram, ngram)


@pytest.mark.parametrize("method", ["prompt_lookup", "early_exit"])
def test_eos_ids_changing_between_calls_in_graphs(method, tiny):
    # the speculative state keeps the EOS ids it wrote while they stay the same (graphs replay it): calls with
    # other ids, fewer and none must each stop where the plain fast path stops with the same ids
    model = tiny.model("llama", num_hidden_layers=LAYERS).cuda()
    ids, mask = _batch(tiny)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tiny.PAD)
    plain_model = accelerate_model(copy.deepcopy(model))
    with torch.no_grad():
        free = plain_model.generate(input_ids=ids, attention_mask=mask, eos_token_id=None, **kwargs)[:, ids.shape[1]:]
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(method, num_draft_tokens=3))
    for eos in ([int(free[0, 5])], [int(free[1, 3]), int(free[2, 7])], [int(free[1, 3])], None, [int(free[0, 5])]):
        with torch.no_grad():
            plain = plain_model.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kwargs)
            out = ours.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kwargs)
        assert torch.equal(out, plain), eos


@pytest.mark.parametrize("method", ["prompt_lookup", "early_exit"])
def test_multi_turn_at_batch_1_in_graphs_equals_the_plain_fast_path(method, tiny):
    """Three turns passing the returned cache back, decoded speculatively (verify rounds in CUDA graphs on the
    fused step, the prefix copied into the pools): the tokens of the plain fast path's turns."""
    from hf_accel.engine.call_options import output_cache
    from hf_accel.integrations.generate import CACHE_KWARG

    model = tiny.model("llama", num_hidden_layers=LAYERS).cuda()
    ids, mask = _batch(tiny)
    ids, mask = ids[:1], mask[:1]
    plain_model = accelerate_model(copy.deepcopy(model))
    ours = accelerate_model(copy.deepcopy(model), speculative=SpeculativeConfig(
        method, num_draft_tokens=3, **({"exit_layer": 3} if method == "early_exit" else {})))

    def turns(m):
        x, a, cache, outs = ids, mask, None, []
        for t in range(3):
            kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tiny.PAD, eos_token_id=None,
                      return_dict_in_generate=True)
            if cache is not None:
                kw[CACHE_KWARG] = cache
            with torch.no_grad():
                out = m.generate(input_ids=x, attention_mask=a, **kw)
            cache = output_cache(out)
            outs.append(out.sequences)
            x = torch.cat([out.sequences, x[:, -5:]], 1)  # the new turn repeats recent text: drafts get accepted
            a = torch.cat([a, torch.ones(1, x.shape[1] - a.shape[1], dtype=a.dtype, device=a.device)], 1)
        return outs, cache

    want, _ = turns(plain_model)
    got, cache = turns(ours)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert speculative_stats(ours) is not None and cache.get_seq_length() == got[-1].shape[1] - 1
