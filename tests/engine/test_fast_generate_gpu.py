"""The fast decode path on a GPU (fused step, CUDA graphs) is token-identical to stock transformers in
float32 on tiny random models, greedy with a left-padded batch and an EOS in the middle. Skipped without CUDA."""

import pytest
import torch

import hf_accel
from hf_accel.integrations.generate import CACHE_KWARG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tiny(kind, intermediate_size=256):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    cfg = cls[0](hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=intermediate_size, vocab_size=256, pad_token_id=0, eos_token_id=7)
    torch.manual_seed(0)
    return cls[1](cfg).cuda().eval()


def _accelerated_gives_stocks_tokens(model, ids, mask, max_new_tokens):
    """Stock greedy tokens of ``model``, then ``accelerate_model(model)``'s, twice (the second call replays the
    captured graphs): they must be identical."""
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    hf_accel.accelerate_model(model)
    for _ in range(2):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
        assert torch.equal(ref, out)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fast_path_matches_stock_fp32(kind):
    model = _tiny(kind)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(8, 256, (3, 11), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :1] = 0
    ids[mask == 0] = 0
    _accelerated_gives_stocks_tokens(model, ids, mask, 40)
    steps = list(model._hf_accel_engine.steps.values())
    assert steps and all(s.fused and s.use_graph for s in steps)


@pytest.mark.parametrize("single_pass", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batch1_gemv_step_matches_stock_fp32(kind, single_pass, monkeypatch):
    """Batch-1 steps run every matmul through gemv (with GEMV_SINGLE_PASS on or off) inside CUDA graphs with
    PDL, and greedy tokens stay stock's in float32."""
    from hf_accel.engine import decode_step, step_switches

    monkeypatch.setattr(step_switches, "GEMV_SINGLE_PASS", single_pass)
    passes = []
    original = decode_step.gemv

    def spy(*a, **k):
        passes.append(k.get("single_pass"))
        return original(*a, **k)

    monkeypatch.setattr(decode_step, "gemv", spy)
    model = _tiny(kind)
    ids = torch.randint(8, 256, (1, 13), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    mask = torch.ones_like(ids)
    _accelerated_gives_stocks_tokens(model, ids, mask, 40)
    assert passes and set(passes) == {single_pass}


def test_fast_path_float32_with_inputs_too_wide_for_whole_k():
    """float32 down projections of 1536 inputs (SmolLM2's intermediate size) do not fit the whole-K path's
    shared memory (H200: 294,912 bytes asked of 232,448, an OutOfResources at the first generate before
    whole_k_fits): the step takes the K loop for them, and the tokens are stock's."""
    from hf_accel.engine import decode_step
    from hf_accel.kernels.fused_linear_tiles import whole_k_fits

    model = _tiny("llama", intermediate_size=1536)
    assert not whole_k_fits(1536, torch.float32, "cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(8, 256, (2, 9), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[mask == 0] = 0
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    hf_accel.accelerate_model(model)
    calls = []
    linear = decode_step.fused_linear
    decode_step.fused_linear = lambda x, w, **kw: calls.append((w.shape[1], kw.get("whole_k"))) or linear(x, w, **kw)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    finally:
        decode_step.fused_linear = linear
    assert torch.equal(ref, out)
    assert (1536, True) not in calls and any(k == 1536 for k, _ in calls)


@pytest.mark.parametrize("batch,prompt_len,rows", [(20, 9, (17, 32)), (32, 9, (17, 32)), (1, 50, (33, 72)),
                                                   (2, 23, (33, 72)), (48, 5, (33, 72))])
def test_fast_path_matches_stock_fp32_on_fused_linear_row_blocks(batch, prompt_len, rows):
    """Steps and prefills of 17-72 token rows run their matmuls through fused_linear in 16-row blocks of its
    whole-K path (FUSED_LINEAR_MAX_ROWS = 72): batches of 20 / 32 (steps of 32 rows, the batch bucket), a 50-token
    prompt, two left-padded prompts of 23 and a batch of 48 give stock's float32 greedy tokens, with left padding
    in the batches."""
    from hf_accel.engine import decode_step, step_switches

    assert step_switches.FUSED_LINEAR_MAX_ROWS >= rows[1]
    model = _tiny("llama")
    g = torch.Generator(device="cuda").manual_seed(batch + prompt_len)
    ids = torch.randint(8, 256, (batch, prompt_len), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[::3, :4] = 0
    ids[mask == 0] = 0
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    hf_accel.accelerate_model(model)
    rows_seen = []
    linear = decode_step.fused_linear
    decode_step.fused_linear = lambda x, w, **kw: rows_seen.append(x.shape[0]) or linear(x, w, **kw)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    finally:
        decode_step.fused_linear = linear
    assert torch.equal(ref, out)
    assert any(rows[0] <= r <= rows[1] for r in rows_seen), sorted(set(rows_seen))


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("lag", [2, 0])
def test_decoding_stops_within_the_eos_lag(lag, sampled, monkeypatch):
    """Decoding in CUDA graphs stops at most ``EOS_LAG`` steps after every row has emitted EOS (the blocking
    check every ``GPU_SYNC_EVERY`` steps that it replaced ran up to 15 surplus steps); the output is stock's.
    ``sampled``: top-k 1 sampling, which takes the host loop with logits processors instead of the greedy graph."""
    import hf_accel.engine.fast_generate as fg

    monkeypatch.setattr(fg, "EOS_LAG", lag)
    model = _tiny("llama")
    ids = torch.randint(8, 256, (1, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    mask = torch.ones_like(ids)
    kw = {"do_sample": True, "top_k": 1} if sampled else {"do_sample": False}
    model.generation_config.eos_token_id = None  # the EOS-free continuation first
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, **kw)
    new = free[0, ids.shape[1]:].tolist()
    # as EOS: the first token, from the 4th new one on (index 3), that the output has not emitted before
    at = next(i for i in range(3, 30) if new[i] not in new[:i])
    eos = new[at]
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, **kw)
    hf_accel.accelerate_model(model)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, **kw)
    assert torch.equal(ref, out)
    engine = model._hf_accel_engine
    (step,) = [s for s in engine.steps.values() if (s.graph if sampled else s.graph_greedy) is not None]
    calls = []
    name = "run" if sampled else "run_greedy"
    real = getattr(step, name)
    monkeypatch.setattr(step, name, lambda: (calls.append(1), real())[1])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, **kw)
    assert torch.equal(ref, out)
    # EOS is new token ``at`` (0-based): the prefill gives new token 0, the s-th step new token s
    if lag:
        assert at <= len(calls) <= at + lag
    elif sampled:  # checked after new tokens 15, 31, ...
        every = engine.sync_interval("cuda")
        assert every == fg.GPU_SYNC_EVERY and len(calls) == every * -(-(at + 1) // every) - 1
    else:  # checked after steps 16, 32, ...
        every = engine.sync_interval("cuda")
        assert len(calls) == every * -(-at // every)


@pytest.mark.parametrize("new_turn", [5, 100])
def test_multi_turn_on_the_fused_graph_path_matches_stock_fp32(new_turn):
    """Three turns passing the returned cache back (the fused step in CUDA graphs continues a PagedCache: the
    prefix copied into its pools, the new tokens prefilled after it: 5 tokens through the multi-row decode kernels,
    100 through the chunked prefill), with stock's tokens (its DynamicCache carried the same way)."""
    from hf_accel.engine.fast_generate import FastEngine
    from hf_accel.engine.call_options import output_cache

    model = _tiny("llama")
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(8, 256, (3, 11), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[mask == 0] = 0

    def turns(m):
        outs, cache, x, a = [], None, ids, mask
        for t in range(3):
            kw = dict(input_ids=x, attention_mask=a, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
            if cache is not None:
                kw[CACHE_KWARG] = cache
            out = m.generate(**kw)
            cache = output_cache(out)
            outs.append(out.sequences)
            more = torch.randint(8, 256, (3, new_turn), device="cuda", generator=torch.Generator(device="cuda").manual_seed(t))
            x = torch.cat([out.sequences, more], 1)
            a = torch.cat([a, torch.ones(3, x.shape[1] - a.shape[1], dtype=a.dtype, device="cuda")], 1)
        return outs, cache

    want, _ = turns(model)
    hf_accel.accelerate_model(model)
    calls = []
    original = FastEngine.generate
    FastEngine.generate = lambda self, gc, kw: calls.append(1) or original(self, gc, kw)
    try:
        got, cache = turns(model)
    finally:
        FastEngine.generate = original
    assert len(calls) == 3
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert cache.get_seq_length() == got[-1].shape[1] - 1
    steps = list(model._hf_accel_engine.steps.values())
    assert steps and all(s.fused and s.use_graph for s in steps)


@pytest.mark.parametrize("how", ["data", "assign", "scalars"])
def test_captured_graphs_follow_replaced_weights(how):
    """The captured graphs hold the weights' addresses and the numbers read at capture: a weight given new storage
    after a generate (``param.data = t``, or ``load_state_dict(..., assign=True)`` of every weight), or a new
    attention scaling / norm epsilon, is what the next generate uses, as in stock."""
    import copy

    model = _tiny("llama")
    ours = hf_accel.accelerate_model(copy.deepcopy(model))
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(8, 256, (2, 9), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[mask == 0] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours.generate(**kwargs), model.generate(**kwargs))
    assert any(s.use_graph for s in ours._hf_accel_engine.steps.values())
    new = {k: v.detach().clone() * 1.5 if v.is_floating_point() and v.dim() == 2 else v.detach().clone()
           for k, v in model.state_dict().items()}
    for m in (model, ours):
        if how == "data":
            for name, p in m.named_parameters():
                if name in new and p.dim() == 2:
                    p.data = new[name].clone()
        elif how == "assign":
            m.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
        else:  # numbers the graphs hold: every attention's scaling, a norm's epsilon
            for layer in m.model.layers:
                layer.self_attn.scaling *= 3
            m.model.layers[0].post_attention_layernorm.variance_epsilon = 0.5
    stock = model.generate(**kwargs)
    assert torch.equal(ours.generate(**kwargs), stock)


@pytest.mark.parametrize("fast_decode", [False, True], ids=["transformers-loop", "eager-module-steps"])
def test_decode_steps_do_not_read_block_ids_back_to_the_host(fast_decode, monkeypatch):
    """The paged kernel's host check of block ids (a device-to-host read) is for callers' own tables: the decode
    steps on the block manager's tables skip it, on transformers' loop (hf-accel's attention function) and in the
    fast path's eager module steps, as in its fused CUDA-graph step."""
    import hf_accel.kernels.paged_attention as pa

    model = _tiny("llama")
    calls = []
    check = pa._check_block_ids
    monkeypatch.setattr(pa, "_check_block_ids", lambda *a: calls.append(a) or check(*a))
    ids = torch.randint(8, 256, (2, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    ref = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    hf_accel.accelerate_model(model, fast_decode=fast_decode, cuda_graphs=False)
    if fast_decode:
        model._hf_accel_engine.fused = False  # the module step (eager), not the fused one
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), ref)
    assert calls == []


@pytest.mark.parametrize("release", ["state_dict", "save_pretrained"])
def test_a_hook_added_after_state_dict_of_the_merged_model_is_run(release, tmp_path):
    """state_dict() / save_pretrained of a model whose fused step merged its projections let the steps go; a forward
    hook registered after that was skipped by every later call. Now the hook runs and the tokens are stock's."""
    import copy

    model = _tiny("llama")
    stock = copy.deepcopy(model)
    ids = torch.randint(8, 256, (1, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    hf_accel.accelerate_model(model)
    model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    engine = model._hf_accel_engine
    assert engine.merged
    model.state_dict() if release == "state_dict" else model.save_pretrained(tmp_path)
    assert not engine.steps
    steer = torch.randn(128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)) * 5
    calls = []

    def hook(module, args, out):
        calls.append(1)
        return (out[0] + steer, *out[1:]) if isinstance(out, tuple) else out + steer

    for m in (model, stock):
        m.model.layers[0].register_forward_hook(hook)
    want = stock.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    stock_calls = len(calls)
    calls.clear()
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)
    assert len(calls) == stock_calls > 1


@pytest.mark.parametrize("rows", [1, 3])
def test_merged_peft_lora_takes_the_fused_graph_step_fp32(rows):
    """A PeftModel with LoRA on every projection and the LM head, merged by accelerate_model, decodes on the fused
    CUDA-graph step (gemv at 1 row, fused_linear at 3) with stock peft's float32 tokens, twice; revert gives back
    the base weights bit for bit."""
    from peft import LoraConfig, get_peft_model

    base = _tiny("llama")
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(8, 256, (rows, 11), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    _accelerated_gives_stocks_tokens(model, ids, mask, 24)
    steps = list(base._hf_accel_engine.steps.values())
    assert steps and all(s.fused and s.use_graph and s.gemv_lm_head for s in steps)
    hf_accel.revert_model(model)
    after = {n.replace(".base_layer", ""): p for n, p in base.named_parameters() if "lora_" not in n}
    assert all(torch.equal(after[n], before[n]) for n in before)


def _stock_and_ours_after_two_calls(seed):
    """A tiny llama, its accelerated copy after two equal 21-token calls (stock's float32 tokens; the second
    replays the prefill graph the first captured) and those calls' arguments."""
    import copy

    model = _tiny("llama")
    ours = hf_accel.accelerate_model(copy.deepcopy(model))
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(8, 256, (1, 21), device="cuda", generator=g)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    for _ in range(2):
        assert torch.equal(ours.generate(**kwargs), model.generate(**kwargs))
    return model, ours, kwargs


def test_weights_replaced_after_a_prefill_graph_was_captured_give_stocks_tokens():
    """After two calls (the prefill graph captured and kept), weights replaced by new Parameters (the old ones
    dropped by the model, PyTorch's cached memory emptied) are found by the next call's snapshot comparison before
    any graph replays: it runs on new steps with stock's float32 tokens."""
    import gc

    model, ours, kwargs = _stock_and_ours_after_two_calls(seed=4)
    old_steps = list(ours._hf_accel_engine.steps.values())
    for m in (model, ours):
        for layer in m.model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight = torch.nn.Parameter(proj.weight.detach() * -1.25)
    gc.collect()
    torch.cuda.empty_cache()
    stock = model.generate(**kwargs)
    assert torch.equal(ours.generate(**kwargs), stock)
    new_steps = list(ours._hf_accel_engine.steps.values())
    assert new_steps and not any(s is t for s in new_steps for t in old_steps)


def test_a_hook_added_after_a_prefill_graph_was_captured_runs_as_in_stock():
    """A forward hook added after two calls (the prefill graph captured and kept) runs as often as in stock: the
    comparison finds the hook before any kept graph replays, and the call runs transformers' loop with it, stock's
    float32 tokens."""
    model, ours, kwargs = _stock_and_ours_after_two_calls(seed=5)
    counts = {"stock": 0, "ours": 0}
    for name, m in (("stock", model), ("ours", ours)):
        m.lm_head.register_forward_hook(lambda mod, args, out, name=name: counts.__setitem__(name, counts[name] + 1))
    stock = model.generate(**kwargs)
    assert torch.equal(ours.generate(**kwargs), stock)
    assert counts["ours"] == counts["stock"] > 0
