"""Speculative ``generate`` through the fused step's Triton kernels (Triton's interpreter on CPU tensors).

Greedy equals stock with the fused step verifying q_len = k + 1 tokens per row; under match gating with every
draft length below k_max and with the one-launch lookup writing the class counts at batch 1 (or the fill +
scatter-add doing it); verify passes of more than 16 / 32 token rows through fused_linear's whole-K path (and
kept on cuBLAS where the whole-K path does not fit).
"""

from __future__ import annotations

import copy

import pytest
import torch
from speculative_helpers import LAYERS, greedy, repetitive_batch

from hf_accel import SpeculativeConfig, accelerate_model, speculative_stats
from hf_accel.kernels.commit_tokens import INFO_CLASS_COUNTS, NUM_CLASSES
from hf_accel.kernels.ngram_lookup import ngram_lookup_ref
from hf_accel.speculative.draft_length import _GatedChooser


def _fused_matches_stock(tiny, config: SpeculativeConfig, max_new_tokens: int, rows: int | None = None):
    """Greedy ``generate`` of a tiny llama with ``config`` on the fused step's Triton kernels (interpreter) over
    ``repetitive_batch`` (its first ``rows`` rows) must equal stock greedy (no EOS); returns the accelerated copy."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny)
    ids, mask = ids[:rows], mask[:rows]
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=max_new_tokens, eos_token_id=None)
    ours = accelerate_model(copy.deepcopy(model), speculative=config)
    ours._hf_accel_engine.fused = True
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=max_new_tokens, eos_token_id=None)
    assert torch.equal(out, stock)
    return ours


@pytest.mark.interpreter
def test_fused_triton_step_greedy_identical(tiny):
    """The fused step's Triton kernels (interpreter) verifying q_len = k + 1 tokens per row."""
    ours = _fused_matches_stock(tiny, SpeculativeConfig("early_exit", num_draft_tokens=2, adaptive=False), 10)
    assert ours._hf_accel_engine.steps and all(s.fused for s in ours._hf_accel_engine.steps.values())
    assert speculative_stats(ours)["verify_steps"] > 0


@pytest.mark.interpreter
def test_match_gated_fused_triton_step_with_every_draft_length(tiny, monkeypatch):
    """The one-launch lookup and commit kernels (interpreter) under match gating: k cycles through every
    candidate below k_max (the drafts are column slices of the state's k_max-wide lookup), plain rounds
    between; greedy equals stock and the state ends holding the lookup of the final tokens."""
    picks = []

    def choose(self, counts, max_remaining=None, burst=True):
        matched = [k for k in picks if k >= 0]
        picks.append((1, 2, 4, 0)[len(matched) % 4] if any(counts[1:]) else -1)
        return max(picks[-1], 0), 1

    monkeypatch.setattr(_GatedChooser, "choose", choose)
    ours = _fused_matches_stock(tiny, SpeculativeConfig("prompt_lookup", num_draft_tokens=4, match_gated=True), 12)
    assert {1, 2, 4} <= set(picks) and speculative_stats(ours)["match_gated"], picks
    (engine,) = ours.__dict__["_hf_accel_spec_engines"].values()
    (st,) = engine.states.values()
    drafts, valid, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 4, with_ngram=True)
    assert torch.equal(st.drafts, drafts) and torch.equal(st.valid, valid) and torch.equal(st.ngram, ngram)


def _batch1_fused_lookup_matches_stock(tiny, num_draft_tokens: int, max_new_tokens: int, lengths=(14, 9, 6),
                                       holder: dict | None = None):
    """Greedy prompt lookup on the first row of ``repetitive_batch`` with the fused step's Triton kernels
    (interpreter) must equal stock greedy (no EOS); returns the accelerated copy (also put in ``holder["model"]``
    before it generates)."""
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=lengths)
    ids, mask = ids[:1], mask[:1]
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=max_new_tokens, eos_token_id=None)
    config = SpeculativeConfig("prompt_lookup", num_draft_tokens=num_draft_tokens)
    ours = accelerate_model(copy.deepcopy(model), speculative=config)
    ours._hf_accel_engine.fused = True
    if holder is not None:
        holder["model"] = ours
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=max_new_tokens, eos_token_id=None)
    assert torch.equal(out, stock)
    return ours


@pytest.mark.interpreter
@pytest.mark.parametrize("counts_kernel", [True, False], ids=["counts-in-lookup", "counts-scatter"])
def test_match_gated_fused_triton_step_batch1_class_counts(counts_kernel, tiny, monkeypatch):
    """Batch 1 (interpreter): the lookup kernel writes the class counts itself (LOOKUP_CLASS_COUNTS_KERNEL) or the
    fill + scatter-add do; either way greedy equals stock, rounds draft, and the state's counts are the active
    row's class after the final lookup."""
    from hf_accel.speculative import engine as spec_engine

    monkeypatch.setattr(spec_engine, "LOOKUP_CLASS_COUNTS_KERNEL", counts_kernel)
    seen, holder = [], {}

    def choose(self, counts, max_remaining=None, burst=True):
        # the counts the host read = the active row's class in the state now (rounds run eagerly on CPU)
        (engine,) = holder["model"].__dict__["_hf_accel_spec_engines"].values()
        (st,) = engine.states.values()
        _, _, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 4, with_ngram=True)
        want = [0] * NUM_CLASSES
        want[min(int(ngram[0]), NUM_CLASSES - 1)] = int(st.active[0])
        seen.append((list(counts), want))
        # draft whenever the row matched (on CPU the timed chooser would back off)
        return (4 if any(counts[1:]) and (max_remaining is None or max_remaining > 4) else 0), 1

    monkeypatch.setattr(_GatedChooser, "choose", choose)
    calls = []
    lookup = spec_engine.ngram_lookup
    monkeypatch.setattr(spec_engine, "ngram_lookup", lambda *a, **k: calls.append(1) or lookup(*a, **k))
    ours = _batch1_fused_lookup_matches_stock(tiny, num_draft_tokens=4, max_new_tokens=12, holder=holder)
    stats = speculative_stats(ours)
    assert stats["match_gated"] and stats["verify_steps"] > 0, stats
    assert bool(calls) == counts_kernel
    assert len(seen) > 2 and all(got == want for got, want in seen), seen
    (engine,) = ours.__dict__["_hf_accel_spec_engines"].values()
    (st,) = engine.states.values()
    _, _, ngram = ngram_lookup_ref(st.tokens, st.lengths, st.starts, 4, with_ngram=True)
    want = [0] * NUM_CLASSES
    want[min(int(ngram[0]), NUM_CLASSES - 1)] = int(st.active[0])
    assert st.info[INFO_CLASS_COUNTS: INFO_CLASS_COUNTS + NUM_CLASSES].tolist() == want
    assert torch.equal(st.ngram, ngram.clamp(max=NUM_CLASSES - 1))


@pytest.mark.interpreter
def test_batch_verify_passes_of_more_than_32_rows_through_fused_linear(tiny, monkeypatch):
    """Batch 3 with 15 drafts: verify passes of 48 token rows run their matmuls through fused_linear's whole-K
    path in 16-row blocks when FUSED_LINEAR_MAX_ROWS allows (interpreter), and greedy equals stock. The drafts are
    stock's own next tokens (so one verify pass accepts all 15, where the random model's lookups took 16 rounds
    under the interpreter): a verify pass whose logits differed would commit other tokens."""
    from hf_accel.engine import decode_step, step_switches
    from hf_accel.speculative import engine as spec_engine

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 128)
    rows_seen = []
    linear = decode_step.fused_linear
    monkeypatch.setattr(decode_step, "fused_linear",
                        lambda x, w, **kw: rows_seen.append(x.shape[0]) or linear(x, w, **kw))
    model = tiny.model("llama", num_hidden_layers=LAYERS)
    ids, mask = repetitive_batch(tiny, lengths=(14, 9, 6))
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=17, eos_token_id=None)

    def stock_drafts(tokens, lengths, starts, k, *args, **kwargs):  # rows laid out as stock's (left padding)
        at = lengths[:, None].cpu() + torch.arange(k)[None, :]
        drafts = stock.gather(1, at.clamp(max=stock.shape[1] - 1))
        return drafts.to(tokens.device), (at < stock.shape[1]).to(tokens.device)

    monkeypatch.setattr(spec_engine, "prompt_lookup", stock_drafts)
    config = SpeculativeConfig("prompt_lookup", num_draft_tokens=15, adaptive=False)
    ours = accelerate_model(copy.deepcopy(model), speculative=config)
    ours._hf_accel_engine.fused = True
    out = greedy(ours, ids, mask, tiny.PAD, max_new_tokens=17, eos_token_id=None)
    assert torch.equal(out, stock)
    assert 48 in rows_seen, sorted(set(rows_seen))
    assert speculative_stats(ours)["draft_lengths"] == {"15": 1}, speculative_stats(ours)


@pytest.mark.interpreter
@pytest.mark.parametrize("whole_k_fits", [True, False])
def test_verify_passes_of_more_than_16_tokens_through_fused_linear(whole_k_fits, tiny, monkeypatch):
    """With FUSED_LINEAR_MAX_ROWS at 32, a batch-1 verify pass of k + 1 = 20 tokens runs its matmuls through
    fused_linear's whole-K path in two 16-row blocks (interpreter), and greedy equals stock. A model whose matmul
    inputs do not all fit the whole-K path (whole_k_fits made to refuse inputs wider than 16 here) keeps passes of
    more than FUSED_LINEAR_K_LOOP_MAX_ROWS rows on cuBLAS."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 32)
    if not whole_k_fits:
        monkeypatch.setattr(decode_step, "whole_k_fits", lambda k, *args: k <= 16)
    monkeypatch.setattr(_GatedChooser, "choose", lambda self, counts, max_remaining=None, burst=True:
                        (19 if any(counts[1:]) and (max_remaining is None or max_remaining > 19) else 0, 1))
    rows_seen = []
    linear = decode_step.fused_linear
    monkeypatch.setattr(decode_step, "fused_linear",
                        lambda x, w, **kw: rows_seen.append(x.shape[0]) or linear(x, w, **kw))
    ours = _batch1_fused_lookup_matches_stock(tiny, num_draft_tokens=19, max_new_tokens=30, lengths=(40, 9, 6))
    assert speculative_stats(ours)["draft_lengths"].get("19"), speculative_stats(ours)
    assert (20 in rows_seen) == whole_k_fits, sorted(set(rows_seen))
    if not whole_k_fits:  # the 20-row passes ran on cuBLAS; nothing above the K-loop limit reached fused_linear
        assert all(r <= step_switches.FUSED_LINEAR_K_LOOP_MAX_ROWS for r in rows_seen), sorted(set(rows_seen))


@pytest.mark.interpreter
def test_prompt_lookup_on_a_merged_lora_model_through_the_fused_step(tiny):
    """Prompt lookup on a PeftModel (LoRA on every projection and the LM head, merged by accelerate_model): the verify
    passes run fused_linear on the LoRA layers' merged base weights; greedy equals stock peft's."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model = get_peft_model(tiny.model("llama", num_hidden_layers=LAYERS),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)).eval()
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    ids, mask = repetitive_batch(tiny)
    stock = greedy(model, ids, mask, tiny.PAD, max_new_tokens=10, eos_token_id=None)
    accelerate_model(model, speculative=SpeculativeConfig("prompt_lookup", num_draft_tokens=3, adaptive=False))
    engine = model.get_base_model()._hf_accel_engine
    engine.fused = True
    assert torch.equal(greedy(model, ids, mask, tiny.PAD, max_new_tokens=10, eos_token_id=None), stock)
    assert engine.steps and all(s.fused and s.small_linear for s in engine.steps.values())
    assert speculative_stats(model)["verify_steps"] > 0


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 3])
def test_batch1_verify_passes_take_their_own_attention_stages(tiny, rows, monkeypatch):
    """Batch-1 verify passes launch the paged attention with VERIFY_ATTENTION_STAGES, one-row steps and verify
    passes of larger batches with DECODE_ATTENTION_STAGES (set apart here: 5 / 4); greedy stays stock's."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "VERIFY_ATTENTION_STAGES", 5)
    monkeypatch.setattr(step_switches, "DECODE_ATTENTION_STAGES", 4)
    seen = set()
    original = decode_step.paged_attention

    def spy(q, *a, **k):
        seen.add((q.shape[0], q.shape[2], k.get("num_stages")))
        return original(q, *a, **k)

    monkeypatch.setattr(decode_step, "paged_attention", spy)
    _fused_matches_stock(tiny, SpeculativeConfig("early_exit", num_draft_tokens=2, adaptive=False), 8, rows)
    assert (rows, 3, 5 if rows == 1 else 4) in seen and (rows, 1, 4) in seen, seen
    assert all(stages == (5 if (b, t) == (1, 3) else 4) for b, t, stages in seen), seen
