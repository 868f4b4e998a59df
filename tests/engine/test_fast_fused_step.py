"""generate's fast decode path as the fused Triton step (``engine.fused = True``, Triton interpreter on CPU):
token-identical to stock transformers in float32.

Greedy with in-graph argmax and with a host processor; the prefill padded to a bucketed length (the buckets, and
a half-step bucket); batch-1 steps through gemv; the embedding and rotary-row gathers; split-K and the in-kernel
attention merge; the small-batch fused_linear options (RoPE epilogue, preload and attention overlap, whole K, the
LM head); a matmul input narrower than 16; the model stays trainable and castable after a fused generate; a change
of the fused flag rebuilds the steps.
"""

from __future__ import annotations

import pytest
import torch
from fast_generate_helpers import MODEL_TYPES, _accelerated, _case, _generate


FUSED = [(t, "max_new_tokens") for t in MODEL_TYPES] + [("qwen3", "min_new_tokens")]


@pytest.mark.interpreter
@pytest.mark.parametrize(("model_type", "case"), FUSED)
def test_greedy_identical_to_stock_fused_step(model_type, case, tiny, decode_steps, monkeypatch):
    """The fused Triton step (interpreter): in-graph greedy, and the host loop with a processor; the
    prompt is prefilled padded to a bucketed length (16 here)."""
    from hf_accel.engine.fast_generate import FastEngine

    bucketed = []
    original = FastEngine._prefill_bucketed
    monkeypatch.setattr(FastEngine, "_prefill_bucketed",
                        lambda self, *a: bucketed.append(a[-1]) or original(self, *a))
    model, ids, mask, kwargs, stock = _case(tiny, model_type, case)
    kwargs["max_new_tokens"] = 7  # the interpreter is slow
    stock = _generate(model, ids, mask, tiny.PAD, **kwargs)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, **kwargs)
    assert torch.equal(out, stock), f"{model_type} {case}\nstock:\n{stock}\nours:\n{out}"
    assert len(decode_steps) == 6 and all(decode_steps)
    assert all(step.fused for step in ours._hf_accel_engine.steps.values())
    # Decode steps (<= 16 rows) ran the fused norm/linear/SwiGLU kernels, not RMSNorm + F.linear.
    assert all(step.small_linear for step in ours._hf_accel_engine.steps.values())
    assert bucketed == [ids.shape[1]] and ids.shape[1] not in (16, 32)  # padded: 11 -> 16


def test_prefill_buckets():
    """Prompts are padded to a power of two >= 16 or 1.5 times one (at most 1.5x their length)."""
    from hf_accel.engine import fast_generate as fg

    got = {n: fg.prefill_bucket(n) for n in (1, 16, 17, 24, 25, 33, 48, 49, 200, 257, 324, 384, 385, 1500)}
    assert got == {1: 16, 16: 16, 17: 24, 24: 24, 25: 32, 33: 48, 48: 48, 49: 64, 200: 256, 257: 384, 324: 384,
                   384: 384, 385: 512, 1500: 1536}
    for n in range(1, 3000):
        assert n <= fg.prefill_bucket(n) <= max(16, 1.5 * n)


@pytest.mark.interpreter
@pytest.mark.parametrize("half_steps", [True, False], ids=["bucket-24", "bucket-32"])
def test_fused_prefill_in_a_half_step_bucket_identical_to_stock(tiny, monkeypatch, half_steps):
    """A 20-token prompt (batch of 2, left padded) prefilled padded to 24 tokens (32 without the 1.5x
    buckets) through the fused step: the padding rows' K/V land in slots the decode steps overwrite."""
    from hf_accel.engine import fast_generate as fg

    monkeypatch.setattr(fg, "PREFILL_HALF_STEPS", half_steps)
    lengths = []
    original = fg.FastEngine._prefill_bucketed
    monkeypatch.setattr(fg.FastEngine, "_prefill_bucketed",
                        lambda self, *a: lengths.append(fg.prefill_bucket(a[-1])) or original(self, *a))
    model = tiny.model("llama")
    ids, mask = tiny.batch(seed=3, lengths=(20, 13))
    kwargs = {"max_new_tokens": 5, "eos_token_id": None}
    stock = _generate(model, ids, mask, tiny.PAD, **kwargs)
    out = _generate(_accelerated(model, fused=True), ids, mask, tiny.PAD, **kwargs)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert lengths == [24 if half_steps else 32]


# --- the fused step's kernels and switches ---------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("gemv_rope,head_norm,single_pass",
                         [(False, True, False), (True, True, False), (False, False, False), (True, True, True)],
                         ids=["rope-kernel", "rope-in-gemv", "lm-head-norm-kernel", "single-pass-norm"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_batch1_fused_step_runs_gemv(model_type, gemv_rope, head_norm, single_pass, tiny, monkeypatch):
    """Batch-1 decode steps of the fused step run every matmul, the LM head included, through gemv
    (interpreter), and greedy output stays token-identical to stock in float32 (with the final norm fused
    into the LM head or not; with the single-pass norm, GEMV_SINGLE_PASS)."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "GEMV_ROPE", gemv_rope)
    monkeypatch.setattr(step_switches, "GEMV_LM_HEAD_NORM", head_norm)
    monkeypatch.setattr(step_switches, "GEMV_SINGLE_PASS", single_pass)
    calls, passes = [], []
    original, original_rope = decode_step.gemv, decode_step.gemv_rope

    def spy(*a, **k):
        passes.append(k.get("single_pass"))
        calls.append(k.get("swiglu", False))
        return original(*a, **k)

    def spy_rope(*a, **k):
        passes.append(k.get("single_pass"))
        calls.append("rope")
        return original_rope(*a, **k)

    monkeypatch.setattr(decode_step, "gemv", spy)
    monkeypatch.setattr(decode_step, "gemv_rope", spy_rope)
    model = tiny.model(model_type)
    ids, mask = tiny.batch(seed=1)
    ids, mask = ids[:1], mask[:1]
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=6, eos_token_id=None)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    layers = model.config.num_hidden_layers
    # 5 decode steps; Q/K/V with RoPE + cache write in the GEMV's epilogue
    assert len(calls) == 5 * (4 * layers + 1) and calls.count(True) == 5 * layers
    assert calls.count("rope") == (5 * layers if gemv_rope else 0)
    assert set(passes) == {single_pass}


def _fused_five_tokens_match_stock(tiny, seed: int, *model_args, **model_kwargs):
    """A tiny model and its fused-step accelerated copy; 5 greedy tokens of ``tiny.batch(seed)`` (float32,
    no EOS) must be identical. Returns ``(model, accelerated)``."""
    model = tiny.model(*model_args, **model_kwargs)
    ids, mask = tiny.batch(seed=seed)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=5, eos_token_id=None)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    return model, ours


@pytest.mark.interpreter
@pytest.mark.parametrize("gather_by_index", [True, False], ids=["index", "embedding"])
def test_fused_step_gathers_embeddings_and_rotary_rows(gather_by_index, tiny, monkeypatch):
    """The fused step's token-embedding and rotary-row gathers (by indexing, or through the embedding
    function) give greedy output token-identical to stock (float32, batch 3); a subclass of nn.Embedding
    (which may scale its rows) is called as the module even with gathering by index."""
    from hf_accel.engine import step_switches

    monkeypatch.setattr(step_switches, "GATHER_BY_INDEX", gather_by_index)
    _fused_five_tokens_match_stock(tiny, 2, "llama")

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = tiny.model("llama")
    old = model.model.embed_tokens
    scaled = Scaled(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx)
    scaled.weight = old.weight  # tied to the LM head as before
    model.model.embed_tokens = scaled
    ids, mask = tiny.batch(seed=3)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None)
    out = _generate(_accelerated(model, fused=True), ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"


@pytest.mark.interpreter
def test_fused_step_split_k_and_in_kernel_merge(tiny, monkeypatch):
    """Batch-3 fused decode steps with fused_linear split into 2 K shares per output tile and 3 KV splits
    merged inside the attention kernel (both through the step's arrival counters, reused by every layer
    and step): greedy output token-identical to stock in float32, counters back at zero."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_WHOLE_K", False)  # split-K is a K-loop option
    seen = {"split": 0, "merge": 0}
    linear, attention = decode_step.fused_linear, decode_step.paged_attention

    def split_linear(x, w, **kw):
        seen["split"] += 1
        return linear(x, w, **{**kw, "split_k": 2, "block_k": 16})

    def merging_attention(*a, **kw):
        seen["merge"] += kw.get("merge_counters") is not None and kw.get("num_splits") == 3
        return attention(*a, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", split_linear)
    monkeypatch.setattr(decode_step, "paged_attention", merging_attention)
    monkeypatch.setattr(decode_step, "default_num_splits", lambda *a: 3)
    monkeypatch.setattr(step_switches, "FUSED_MERGE", True)  # off by default (measured slower on the H200)
    model, ours = _fused_five_tokens_match_stock(tiny, 1, "llama")
    layers = model.config.num_hidden_layers
    assert seen["split"] == 4 * 4 * layers and seen["merge"] == 4 * layers  # 4 decode steps
    for step in ours._hf_accel_engine.steps.values():
        assert step.num_splits == 3
        assert int(step.merge_counters.abs().sum()) == 0 and int(step.linear_counters.abs().sum()) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("fused_rope", [True, False], ids=["rope-in-fused-linear", "rope-kernel"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_small_batch_fused_step_rope_epilogue(model_type, fused_rope, tiny, monkeypatch):
    """Batch-3 fused decode steps (fused_linear, 3 token rows) with head_dim 32 take RoPE + the cache write
    in the Q/K/V fused_linear's epilogue (FUSED_LINEAR_ROPE; head_dim 16 models cannot), greedy output
    token-identical to stock in float32, with the switch on or off."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_ROPE", fused_rope)
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 16)  # the prefill's rows (more than 16) stay on cuBLAS
    calls = {"fused_rope": 0, "rope_kernel": 0}
    original, original_kernel = decode_step.fused_linear_rope, decode_step.rope_and_cache

    def spy(*a, **k):
        calls["fused_rope"] += 1
        return original(*a, **k)

    def spy_kernel(*a, **k):
        calls["rope_kernel"] += 1
        return original_kernel(*a, **k)

    monkeypatch.setattr(decode_step, "fused_linear_rope", spy)
    monkeypatch.setattr(decode_step, "rope_and_cache", spy_kernel)
    model, ours = _fused_five_tokens_match_stock(tiny, 2, model_type, head_dim=32)
    layers = model.config.num_hidden_layers
    # 4 decode steps of 3 rows (the prefill has more rows than fused_linear takes: the RoPE kernel)
    assert calls["fused_rope"] == (4 * layers if fused_rope else 0)
    assert calls["rope_kernel"] == (layers if fused_rope else 5 * layers)


@pytest.mark.interpreter
def test_small_batch_fused_step_preload_and_attention_overlap(tiny, monkeypatch):
    """Batch-3 fused decode steps with FUSED_LINEAR_PRELOAD (first weight tile before the PDL wait) and
    MULTI_ROW_ATTENTION_OVERLAP (attention preloading its cached K/V, triggering the merge): the options reach
    every 3-row kernel, and greedy output stays token-identical to stock in float32."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_WHOLE_K", False)  # the preload is a K-loop option
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_PRELOAD", True)
    monkeypatch.setattr(step_switches, "MULTI_ROW_ATTENTION_OVERLAP", True)
    seen = {"preload": 0, "rope_preload": 0, "preload_kv": 0, "trigger": 0}
    linear, rope_linear = decode_step.fused_linear, decode_step.fused_linear_rope
    attention = decode_step.paged_attention

    def spy_linear(x, w, **kw):
        seen["preload"] += kw.get("preload") is True
        return linear(x, w, **{**kw, "block_k": 16})  # several K tiles: a loop after the preloaded one

    def spy_rope(*a, **kw):
        seen["rope_preload"] += kw.get("preload") is True
        return rope_linear(*a, **{**kw, "block_k": 16})

    def spy_attention(q, *a, **kw):
        if q.shape[2] == 1:  # [batch, heads, q_len, head_dim]: the decode steps, not the prefill
            seen["preload_kv"] += kw.get("preload_kv") is True
            seen["trigger"] += kw.get("trigger") is True
        return attention(q, *a, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", spy_linear)
    monkeypatch.setattr(decode_step, "fused_linear_rope", spy_rope)
    monkeypatch.setattr(decode_step, "paged_attention", spy_attention)
    model, ours = _fused_five_tokens_match_stock(tiny, 2, "llama", head_dim=32)
    layers = model.config.num_hidden_layers
    assert seen["rope_preload"] == 4 * layers  # 4 decode steps
    assert seen["preload"] == 3 * 4 * layers  # o, gate/up, down
    assert seen["preload_kv"] == seen["trigger"] == 4 * layers


@pytest.mark.interpreter
def test_small_batch_fused_step_whole_k(tiny, monkeypatch):
    """Batch-3 fused decode steps with FUSED_LINEAR_WHOLE_K (no K loop in the 3-row matmuls): it reaches every
    3-row matmul, and greedy output stays token-identical to stock in float32."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_WHOLE_K", True)
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 16)  # the prefill's rows (more than 16) stay on cuBLAS
    seen = {"whole_k": 0, "rope_whole_k": 0}
    linear, rope_linear = decode_step.fused_linear, decode_step.fused_linear_rope

    def spy_linear(x, w, **kw):
        seen["whole_k"] += kw.get("whole_k") is True
        return linear(x, w, **kw)

    def spy_rope(*a, **kw):
        seen["rope_whole_k"] += kw.get("whole_k") is True
        return rope_linear(*a, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", spy_linear)
    monkeypatch.setattr(decode_step, "fused_linear_rope", spy_rope)
    model, ours = _fused_five_tokens_match_stock(tiny, 2, "llama", head_dim=32)
    layers = model.config.num_hidden_layers
    assert seen["rope_whole_k"] == 4 * layers  # 4 decode steps
    assert seen["whole_k"] == 3 * 4 * layers  # o, gate/up, down


@pytest.mark.interpreter
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_small_batch_fused_step_lm_head(model_type, tiny, monkeypatch):
    """Batch-3 fused decode steps with FUSED_LINEAR_LM_HEAD (final residual add + RMSNorm + LM head in one
    fused_linear launch, float32 logits): it reaches every 3-row step, and greedy output stays token-identical
    to stock in float32."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "FUSED_LINEAR_LM_HEAD", True)
    monkeypatch.setattr(step_switches, "FUSED_LINEAR_MAX_ROWS", 16)  # the prefill's rows (more than 16) stay on cuBLAS
    heads = []
    linear = decode_step.fused_linear

    def spy_linear(x, w, **kw):
        if w.shape[0] == vocab:
            heads.append((x.shape[0], kw.get("out_dtype"), kw.get("norm_weight") is not None))
        return linear(x, w, **kw)

    monkeypatch.setattr(decode_step, "fused_linear", spy_linear)
    vocab = tiny.model(model_type).config.vocab_size
    _fused_five_tokens_match_stock(tiny, 2, model_type, head_dim=32)
    assert heads == [(3, torch.float32, True)] * 4  # 4 decode steps of 3 rows


@pytest.mark.interpreter
def test_fused_step_with_a_matmul_input_narrower_than_16_gives_stock_tokens(tiny, decode_steps):
    """An intermediate size of 8 (down_proj's input): the fused step's batched matmuls took fused_linear's whole-K
    path, whose first column chunk is 16 wide and unmasked (wrong tokens, or heap corruption for a hidden size
    of 8); they take the K loop there."""
    model = tiny.model("llama", intermediate_size=8)
    ids, mask = tiny.batch(seed=5)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=4)
    ours = _accelerated(model, fused=True)
    out = _generate(ours, ids, mask, tiny.PAD, max_new_tokens=4)
    assert torch.equal(out, stock), f"stock:\n{stock}\nours:\n{out}"
    assert decode_steps and all(decode_steps)
    assert all(step.small_linear for step in ours._hf_accel_engine.steps.values())


# --- the model after a fused generate -----------------------------------------------------------------------


@pytest.mark.interpreter
def test_after_fused_generate_model_stays_trainable_and_castable(tiny):
    """A fused generate merges q/k/v and gate/up into shared matrices inside inference mode. The parameters
    must stay ordinary trainable tensors (requires_grad kept, backward and load_state_dict work, also after
    revert_model; load_state_dict unmerges them first), and a cast after the call rebuilds the engine instead of
    using the old merged weights."""
    from hf_accel import revert_model

    base = tiny.model("llama", head_dim=32)
    ids, mask = tiny.batch(seed=5)
    stock = _generate(base, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None)
    model = _accelerated(base, fused=True)
    params = list(model.parameters())  # what an optimizer made before the first call holds
    assert torch.equal(_generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None), stock)
    fast = model._hf_accel_engine
    assert fast.merged, "the fused step merged the projections"
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.requires_grad and not q.is_inference()
    other = tiny.model("llama", seed=9, head_dim=32)
    model.load_state_dict(other.state_dict())  # unmerges first, then copies into the projections' own storage
    assert not fast.merged and not fast.steps
    assert torch.equal(q, other.model.layers[0].self_attn.q_proj.weight)
    model.load_state_dict(base.state_dict())
    assert torch.equal(_generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None), stock)
    assert fast.merged, "merged again from the loaded weights"
    # a cast: the merged matrices are stale now; the next call must not use them
    model.double()
    assert "float64" in fast._model_reason() and not fast.merged and not fast.steps
    model.float()
    assert torch.equal(_generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None), stock)
    revert_model(model)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.requires_grad for p in model.parameters())
    assert all(a is b for a, b in zip(params, model.parameters()))  # the same Parameter objects throughout


@pytest.mark.interpreter
def test_fused_flag_change_rebuilds_steps(tiny, monkeypatch):
    """Switching the engine between its PyTorch and Triton step after a call takes effect at the next call."""
    from hf_accel.engine import decode_step

    calls = []
    original = decode_step.paged_attention
    monkeypatch.setattr(decode_step, "paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _accelerated(tiny.model("llama"))
    ids, mask = tiny.batch(seed=6)
    first = _generate(model, ids, mask, tiny.PAD, max_new_tokens=3, eos_token_id=None)
    assert not calls  # CPU default: the modules step with the PyTorch reference
    model._hf_accel_engine.fused = True
    again = _generate(model, ids, mask, tiny.PAD, max_new_tokens=3, eos_token_id=None)
    assert calls and torch.equal(again, first)


@pytest.mark.interpreter
@pytest.mark.parametrize("mix", ["embedding", "norms", "final_norm", "gelu"])
def test_a_model_the_fused_step_does_not_take_runs_the_module_step_and_says_why(mix, tiny, decode_steps, hf_log):
    """A float32 model with its embedding, its norms or only its final norm in bfloat16 (stock runs it): the fused
    step raised (a dtype mismatch in its kernels or matmuls). A model the fused step does not take at all (gelu MLP)
    silently ran the module step. Now both run the module step, with stock's tokens and the reason logged once."""
    overrides = {"hidden_act": "gelu"} if mix == "gelu" else {}
    model = tiny.model("llama", seed=12, **overrides)
    if mix == "embedding":
        model.model.embed_tokens.to(torch.bfloat16)
    elif mix == "norms":
        for name, module in model.named_modules():
            if name.endswith("norm"):
                module.to(torch.bfloat16)
    elif mix == "final_norm":
        model.model.norm.to(torch.bfloat16)
    ids, mask = tiny.batch(seed=13)
    stock = _generate(model, ids, mask, tiny.PAD, max_new_tokens=4)
    ours = _accelerated(model, fused=True)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=4), stock)
    assert decode_steps and not any(decode_steps)
    reason = "hidden_act 'gelu'" if mix == "gelu" else "weights in several dtypes (torch.bfloat16, torch.float32)"
    logged = [r.getMessage() for r in hf_log.records if "fused decode step does not take" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0], logged


@pytest.mark.interpreter
def test_bias_added_to_projections_after_a_fused_generate(tiny):
    """Q/K/V and o_proj without a bias get one (``linear.bias = nn.Parameter(...)``) after a generate on the fused
    step: the merged Q/K/V matrix and the built steps had no bias, and the weight snapshot skipped entries that were
    None, so the tokens stayed those without it. The snapshot keeps None entries now: stock's tokens."""
    model = tiny.model("llama", seed=3)
    ids, mask = tiny.batch(seed=4)
    ours = _accelerated(model, fused=True)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None),
                       _generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None))
    for m in (model, ours):
        torch.manual_seed(5)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(m.model.layers[0].self_attn, name)
            linear.bias = torch.nn.Parameter(torch.randn(linear.out_features) * 2)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None),
                       _generate(model, ids, mask, tiny.PAD, max_new_tokens=4, eos_token_id=None))


class _ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 1.5


def _qk_eps(model, which):
    for layer in model.model.layers:
        getattr(layer.self_attn, which).variance_epsilon = 5.0


def _k_norm_layernorm(model):
    attn = model.model.layers[0].self_attn
    norm = torch.nn.LayerNorm(attn.head_dim)
    with torch.no_grad():
        norm.weight.copy_(attn.k_norm.weight)
        norm.bias.fill_(0.3)
    attn.k_norm = norm


def _cohere_norm(model):
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    layer = model.model.layers[0]
    norm = CohereLayerNorm(layer.input_layernorm.weight.shape[0], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(layer.input_layernorm.weight)
    layer.input_layernorm = norm


def _rope_dynamic(model):
    rotary = model.model.rotary_emb
    model.config.rope_parameters = dict(model.config.rope_parameters, rope_type="dynamic", factor=8.0)
    model.config.max_position_embeddings = 3
    rotary.rope_type, rotary.max_seq_len_cached, rotary.original_max_seq_len = "dynamic", 3, 3


def _set_class(module, cls):
    module.__class__ = cls


def _act_class(model):
    act = model.model.layers[0].mlp.act_fn
    act.__class__ = torch.nn.GELU
    act.approximate = "none"


_CHANGES = {  # name: (model type, change made to both models after the first generate)
    "qwen3-k_norm-eps": ("qwen3", lambda m: _qk_eps(m, "k_norm")),
    "qwen3-q_norm-eps": ("qwen3", lambda m: _qk_eps(m, "q_norm")),
    "qwen3-k_norm-layernorm": ("qwen3", _k_norm_layernorm),
    "qwen3-k_norm-identity": ("qwen3", lambda m: setattr(m.model.layers[0].self_attn, "k_norm", torch.nn.Identity())),
    "cohere-layernorm": ("llama", _cohere_norm),
    "rope-dynamic": ("llama", _rope_dynamic),
    "act_fn-class-in-place": ("llama", _act_class),
    "q_proj-class-in-place": ("llama", lambda m: _set_class(m.model.layers[0].self_attn.q_proj, _ScaledLinear)),
    "o_proj-class-in-place": ("llama", lambda m: _set_class(m.model.layers[0].self_attn.o_proj, _ScaledLinear)),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("change", list(_CHANGES))
def test_changes_after_a_fused_generate_give_stock_tokens(change, tiny):
    """Changes to a model between two generate calls that the built fused step used to miss (stale tokens, or a
    crash): q_norm / k_norm eps (the RoPE kernel takes one eps for both), a k_norm that is not an RMSNorm (only
    q_norm's type was checked), a norm class with RMSNorm's attributes but other math (CohereLayerNorm), the rotary
    embedding switched to dynamic NTK (rope_type was not in the snapshot), a module's ``__class__`` set in place (an
    activation, a projection with its own forward). Each is now seen: the next call gives stock's tokens."""
    model_type, apply = _CHANGES[change]
    model = tiny.model(model_type, seed=9)
    ours = _accelerated(model, fused=True)
    ids, mask = tiny.batch(seed=10)
    kwargs = dict(max_new_tokens=4, eos_token_id=None)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, **kwargs), _generate(model, ids, mask, tiny.PAD, **kwargs))
    apply(model)
    apply(ours)
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, **kwargs), _generate(model, ids, mask, tiny.PAD, **kwargs))


@pytest.mark.interpreter
def test_rotary_class_forward_patched_after_a_fused_generate(tiny, monkeypatch):
    """A patch of the rotary embedding class's forward after the first call: the fused step had kept its cos/sin
    table (the class check did not cover the rotary class); now the fast path is refused (transformers' loop runs the
    patched rotary embedding), as for a patched layer class."""
    from transformers.models.llama import modeling_llama

    model = tiny.model("llama", seed=11)
    ours = _accelerated(model, fused=True)
    ids, mask = tiny.batch(seed=12)
    kwargs = dict(max_new_tokens=4, eos_token_id=None)
    _generate(ours, ids, mask, tiny.PAD, **kwargs)
    original = modeling_llama.LlamaRotaryEmbedding.forward
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward",
                        lambda self, x, position_ids, **kw: original(self, x, position_ids * 2, **kw))
    assert torch.equal(_generate(ours, ids, mask, tiny.PAD, **kwargs), _generate(model, ids, mask, tiny.PAD, **kwargs))
