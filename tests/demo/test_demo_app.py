"""Fast tests of the demo's pure functions, its model store and its launcher (no browser, no SmolLM2).

Models here are tiny random llama configs built in memory; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
APP_PATH = REPO / "demo" / "app.py"


def _load_app():
    name = "hf_accel_demo_app_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, APP_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


app = _load_app()
# demo/app.py re-exports the names used here as app.<name>; a name a test patches is patched in the module
# that uses it: demo/features.py, which app.py imports by its own name (it puts demo/ on sys.path).
demo_features = importlib.import_module("features")


# ---------------------------------------------------------------------------------------------- tiny model


class _TinyTokenizer:
    """Enough of a tokenizer for generate + decode: ids are bytes % vocab."""

    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def __call__(self, text, return_tensors="pt", add_special_tokens=False):
        ids = torch.tensor([[3 + (b % 60) for b in text.encode()]], dtype=torch.long)
        return _Batch(input_ids=ids, attention_mask=torch.ones_like(ids))

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{int(i)}" for i in ids)


class _Batch(dict):
    def to(self, device):
        return _Batch({k: v.to(device) for k, v in self.items()})


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # always generate max_new_tokens
    return model


@pytest.fixture(scope="module")
def tiny():
    return _tiny_llama(), _TinyTokenizer()


def _loader_for(tiny_pair, fail: Exception | None = None):
    calls = []

    def loader(path, dtype, device):
        calls.append(path)
        if fail is not None:
            raise fail
        model, tok = tiny_pair
        return model, tok

    loader.calls = calls
    return loader


CPU = app.DeviceInfo("cpu", "float32", "CPU (2 cores) — PyTorch reference attention path")


# ---------------------------------------------------------------------------------------------- device


def test_pick_device_cpu_says_reference_path():
    d = app.pick_device(None, cuda_available=False, cpu_count=2)
    assert (d.device, d.dtype) == ("cpu", "float32")
    assert d.label == "CPU (2 cores) — PyTorch reference attention path"


def test_pick_device_gpu_says_triton():
    d = app.pick_device(None, cuda_available=True, gpu_name="NVIDIA H200")
    assert (d.device, d.dtype) == ("cuda", "bfloat16")
    assert d.label == "GPU (NVIDIA H200) — Triton kernels"


@pytest.mark.parametrize("requested", ["cuda", "cuda:1"])
def test_pick_device_cuda_without_gpu_is_an_error(requested):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        app.pick_device(requested, cuda_available=False)


def test_pick_device_unknown():
    with pytest.raises(ValueError, match="unknown device"):
        app.pick_device("tpu", cuda_available=False)


# ---------------------------------------------------------------------------------------------- form


@pytest.mark.parametrize("prompt", ["", "   \n\t", None])
def test_empty_prompt_message(prompt):
    with pytest.raises(ValueError) as e:
        app.validate_request(prompt, 32, "Greedy", 0.7, 0.9, "concurrent")
    assert str(e.value) == app.EMPTY_PROMPT_MESSAGE


def test_validate_request_ok_and_stripped():
    text, s = app.validate_request("  hi  ", 32.0, "Sampling", 0.7, 0.9, "sequential")
    assert text == "hi"
    assert s == app.GenSettings(32, True, 0.7, 0.9, "sequential")


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "between 1 and 1024"),
    (dict(max_new_tokens=1025), "between 1 and 1024"),
    (dict(max_new_tokens=2.5), "whole number"),
    (dict(max_new_tokens="x"), "whole number"),
    (dict(max_new_tokens=float("inf")), "whole number"),  # was an OverflowError
    (dict(max_new_tokens=float("nan")), "whole number"),
    (dict(prompt="caf\udce9"), "not valid Unicode text"),  # was a TypeError from the tokenizer
    (dict(decoding="Beam"), "Decoding must be"),
    (dict(decoding="Sampling", temperature=0), "Temperature must be > 0"),
    (dict(decoding="Sampling", temperature=float("inf")), "Temperature must be > 0 and finite"),  # was accepted
    (dict(decoding="Sampling", temperature=float("nan")), "Temperature must be > 0 and finite"),
    (dict(decoding="Sampling", top_p=0), "Top-p"),
    (dict(decoding="Sampling", top_p=1.5), "Top-p"),
    (dict(run_mode="parallel"), "run mode"),
])
def test_validate_request_errors(kwargs, match):
    args = dict(prompt="hi", max_new_tokens=32, decoding="Greedy", temperature=0.7, top_p=0.9, run_mode="concurrent")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        app.validate_request(args["prompt"], args["max_new_tokens"], args["decoding"], args["temperature"], args["top_p"],
                             args["run_mode"])


def test_greedy_ignores_sampling_knobs():
    _, s = app.validate_request("hi", 8, "Greedy", 0, 0, "concurrent")  # temperature 0 is fine for greedy
    kw = app.generate_kwargs(s, pad_token_id=5)
    assert kw["do_sample"] is False and kw["max_new_tokens"] == 8 and kw["pad_token_id"] == 5
    assert kw["temperature"] is None and kw["top_p"] is None


def test_sampling_kwargs():
    _, s = app.validate_request("hi", 8, "Sampling", 0.5, 0.8, "concurrent")
    kw = app.generate_kwargs(s, pad_token_id=0)
    assert kw["do_sample"] is True and kw["temperature"] == 0.5 and kw["top_p"] == 0.8


# ---------------------------------------------------------------------------------------------- KV memory


def test_kv_cache_bytes_dynamic_cache():
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.zeros(1, 2, 5, 8)  # fp32: 320 bytes each for K and V
    for layer in range(3):
        cache.update(k, k.clone(), layer)
    assert app.kv_cache_bytes(cache) == 3 * 2 * 320
    usage = app.kv_usage(cache)
    assert usage == app.KVUsage(5, 3 * 2 * 320, None, "DynamicCache")


def test_kv_cache_bytes_counts_shared_tensors_once_and_legacy_tuples():
    k = torch.zeros(1, 2, 4, 8, dtype=torch.float16)  # 128 bytes
    assert app.kv_cache_bytes(((k, k), (k, torch.zeros_like(k)))) == 2 * 128
    assert app.kv_cache_bytes(None) is None
    assert app.kv_cache_bytes(object()) is None


def test_kv_usage_prefers_memory_stats():
    class Paged:
        def get_seq_length(self):
            return 40

        def memory_stats(self):
            return {"bytes_allocated": 3 * 1024, "bytes_reserved": 8 * 1024, "blocks_allocated": 3}

    assert app.kv_usage(Paged()) == app.KVUsage(40, 3 * 1024, 8 * 1024, "Paged")


def test_cache_of_prefers_cache_key():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    marker = object()
    assert app.cache_of(CausalLMOutputWithPast(logits=torch.zeros(1), past_key_values=marker)) is marker
    assert app.cache_of({"cache": marker}) is marker
    assert app.cache_of(None) is None
    assert app.cache_of(torch.zeros(1)) is None


def test_kv_plot_rows_keep_every_series():
    rows = app.kv_plot_rows({"stock HF generate": [app.KVUsage(10, 2**20, None, "DynamicCache"),
                                                   app.KVUsage(11, 2**21, None, "DynamicCache")],
                             "hf-accel": []})
    assert rows[:2] == [
        {"sequence length (tokens)": 10, "KV cache (MiB)": 1.0, "run": "stock HF generate"},
        {"sequence length (tokens)": 11, "KV cache (MiB)": 2.0, "run": "stock HF generate"},
    ]
    (placeholder,) = rows[2:]
    assert placeholder["run"] == "hf-accel" and placeholder["sequence length (tokens)"] == 10
    assert placeholder["KV cache (MiB)"] != placeholder["KV cache (MiB)"]  # NaN: not drawn


# ---------------------------------------------------------------------------------------------- HTML


def test_stats_html_numbers_are_readable():
    h = app.stats_html("done", tokens=32, seconds=2.0, tok_s=16.04, ttft_s=0.081,
                       kv=app.KVUsage(69, 3 * 2**20, 4 * 2**20, "PagedCache"))
    assert 'data-state="done"' in h
    assert '<b class="tps">16.0</b>' in h and '<b class="ttft">81 ms</b>' in h and '<b class="ntok">32</b>' in h
    assert "3.00 MiB" in h and "pool 4.00 MiB reserved" in h


def test_stats_html_waiting_and_nan():
    h = app.stats_html("running", tok_s=float("nan"))
    assert '<b class="tps">–</b>' in h and 'data-state="running"' in h


def test_html_is_escaped():
    assert "<script>" not in app.status_html("<script>x</script>", "error", run=3)
    assert 'data-run="3"' in app.status_html("<b>", "error", run=3)
    assert "<img" not in app.stats_html("error", note="<img src=x>")
    assert 'data-kind="none"' in app.status_html("")


def _stats(tps):
    return SimpleNamespace(tokens_per_s=tps)


def test_summary_sequential_gives_ratio():
    text = app.summary_text(_stats(20.0), _stats(30.0), greedy=True, identical=True, run_mode="sequential",
                            device=CPU, output_may_differ=False)
    assert "hf-accel / stock speed: 1.50×" in text and "greedy tokens identical: yes" in text
    assert "one after the other" in text


def test_summary_concurrent_is_not_a_speed_comparison():
    text = app.summary_text(_stats(20.0), _stats(30.0), greedy=True, identical=False, run_mode="concurrent",
                            device=CPU, output_may_differ=False)
    assert "speed:" not in text and "not a speed comparison" in text
    assert "greedy tokens identical: NO" in text and "sharing the CPU cores" in text


def test_summary_gqa_and_sampling():
    text = app.summary_text(_stats(1), _stats(1), greedy=True, identical=False, run_mode="sequential",
                            device=CPU, output_may_differ=True)
    assert "expected: GQA conversion changed the weights" in text
    text = app.summary_text(_stats(1), _stats(1), greedy=False, identical=None, run_mode="sequential",
                            device=CPU, output_may_differ=False)
    assert "independent draws" in text


# ---------------------------------------------------------------------------------------------- features


def test_features_shown_only_when_available(monkeypatch):
    keys = [f.key for f in app.available_features()]
    assert "attention" in keys
    monkeypatch.setattr(demo_features, "_import_convert_to_gqa", lambda: None)
    assert "gqa" not in [f.key for f in app.available_features()]
    monkeypatch.setattr(demo_features, "_accelerate_accepts", lambda option: False)
    assert "paged" not in [f.key for f in app.available_features()]
    assert "attention" in [f.key for f in app.available_features()]


def test_enabled_features_from_flat_values():
    feats = [app.Feature("a", "A", ""), app.Feature("b", "B", "", setting_label="n"), app.Feature("c", "C", "")]
    assert app.enabled_features(feats, [True, None, False, 4, True, None]) == {"a": None, "c": None}
    assert app.enabled_features(feats, [False, None, True, 4, False, None]) == {"b": 4}
    with pytest.raises(ValueError, match="internal error"):
        app.enabled_features(feats, [True])


def test_build_accelerated_attention_on_and_off():
    import hf_accel

    feats = [f for f in app.available_features() if f.key in ("attention", "paged")]
    off = app.build_accelerated(_tiny_llama(), {}, feats)
    assert not hf_accel.is_accelerated(off)
    on = app.build_accelerated(_tiny_llama(), {"attention": None}, feats)
    assert hf_accel.is_accelerated(on)


def test_build_accelerated_requires_and_bad_settings():
    if "paged" not in [f.key for f in app.available_features()]:
        pytest.skip("this hf-accel has no paged cache option")
    feats = app.available_features()
    with pytest.raises(ValueError, match="Paged KV cache needs hf-accel attention"):
        app.build_accelerated(_tiny_llama(), {"paged": 16}, feats)
    for bad in (0, demo_features.MAX_BLOCK_SIZE + 1, 5000):  # the paged feature's own message, not the attention's
        message = rf"^Paged KV cache: KV block size must be between 1 and 1024 \(got {bad}\)"
        with pytest.raises(ValueError, match=message):
            app.build_accelerated(_tiny_llama(), {"attention": None, "paged": bad}, feats)


def test_build_accelerated_order_and_options(monkeypatch):
    seen = []
    feats = [
        app.Feature("opt", "Opt", "", options=lambda on, s: {"flag": on, "size": s}, setting_label="s",
                    setting_default=7),
        app.Feature("w", "W", "", transform=lambda m, s: seen.append(("transform", s)) or m),
        app.Feature("attention", "Attention", ""),
    ]
    monkeypatch.setattr(demo_features.hf_accel, "accelerate_model",
                        lambda m, **kw: seen.append(("accelerate", kw)) or m)
    app.build_accelerated("model", {"w": 3, "attention": None}, feats)
    assert seen == [("transform", 3), ("accelerate", {"flag": False, "size": 7})]


def test_feature_errors_become_messages():
    def boom(m, s):
        raise RuntimeError("kaboom\nsecond line")

    feats = [app.Feature("x", "Explode", "", transform=boom)]
    with pytest.raises(ValueError) as e:
        app.build_accelerated("model", {"x": None}, feats)
    assert str(e.value) == "Explode: RuntimeError: kaboom"


def test_gqa_feature_calls_convert(monkeypatch):
    calls = []
    monkeypatch.setattr(demo_features, "_import_convert_to_gqa", lambda: lambda m, n: calls.append(n) or None)
    gqa = next(f for f in app.FEATURES if f.key == "gqa")
    assert gqa.available()
    assert app.build_accelerated("model", {"gqa": 1.0}, [gqa]) == "model"
    assert calls == [1]
    with pytest.raises(ValueError, match="whole number"):
        app.build_accelerated("model", {"gqa": 1.5}, [gqa])


# ---------------------------------------------------------------------------------------------- store and a run


def test_store_load_errors_are_messages_and_keep_the_model(tiny):
    from hf_accel.models import ModelNotFoundError

    store = app.ModelStore(CPU, loader=_loader_for(tiny))
    store.load("")
    assert store.is_loaded(None) and store.is_loaded("  ")
    good = store.stock
    store._loader = _loader_for(tiny, fail=ModelNotFoundError("'/x' is not a transformers model directory"))
    with pytest.raises(ValueError, match="Could not load the model: '/x' is not a transformers model"):
        store.load("/x")
    store._loader = _loader_for(tiny, fail=OSError("disk on fire\nmore"))
    with pytest.raises(ValueError, match=r"Could not load the model '/y': OSError: disk on fire$"):
        store.load("/y")
    assert store.stock is good and store.is_loaded("")


def test_store_refuses_unsupported_model_type(tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=1,
                                          eos_token_id=2)).eval()
    store = app.ModelStore(CPU, loader=lambda p, dtype, device: (gpt2, tiny[1]))
    with pytest.raises(ValueError, match="does not support model type 'gpt2'"):
        store.load("/gpt2")
    assert store.stock is None


def test_store_caches_accelerated_copy(tiny):
    import hf_accel

    store = app.ModelStore(CPU, loader=_loader_for(tiny))
    store.load(None)
    feats = [f for f in app.available_features() if f.key == "attention"]
    a1 = store.accelerated({"attention": None}, feats)
    assert a1 is not store.stock and hf_accel.is_accelerated(a1) and not hf_accel.is_accelerated(store.stock)
    assert store.accelerated({"attention": None}, feats) is a1
    a2 = store.accelerated({}, feats)
    assert a2 is not a1 and not hf_accel.is_accelerated(a2)


def test_pane_run_records_tokens_timing_and_kv(tiny):
    model, tok = tiny
    inputs = tok("hello there")
    run = app.PaneRun(model, inputs, dict(max_new_tokens=5, do_sample=False, pad_token_id=0))
    assert 'data-state="waiting"' in run.stats_html()
    run.start()
    assert run.done.wait(60)
    assert run.error is None
    assert len(run.token_ids) == 5 and run.stats.new_tokens == 5
    prompt_len = inputs["input_ids"].shape[1]
    # one point after the prefill, then one per new token, at the sequence length of that moment
    assert [u.tokens for u in run.kv_points] == list(range(prompt_len, prompt_len + 6))
    # stock DynamicCache: 2 layers x K and V x [1, 2 heads, tokens, 8] fp32; the last token's K/V is never
    # computed (no forward after it), so the cache ends at prompt + 4 tokens
    per_token = 2 * 2 * 2 * 8 * 4
    assert [u.bytes_used for u in run.kv_points] == [per_token * (prompt_len + k) for k in (0, 1, 2, 3, 4, 4)]
    h = run.stats_html()
    assert 'data-state="done"' in h and '<b class="ntok">5</b>' in h
    assert run.text(tok).count("t") == 5
    assert not model._forward_hooks  # the hook is removed after the run


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "hooked"])
def test_pane_run_on_accelerated_model_samples_every_token(paged, hf_log):
    """The accelerated pane with hf-accel's paged cache reads that cache through hf_accel.cache_in_use, with no
    forward hook, so generate takes the fast decode path (a hook turned it off: the pane ran transformers' loop).
    Its K/V curve is one step: the whole answer's blocks, reserved after the prefill."""
    import hf_accel

    model = hf_accel.accelerate_model(_tiny_llama())
    inputs = _TinyTokenizer()("hello there")
    run = app.PaneRun(model, inputs, dict(max_new_tokens=6, do_sample=False, pad_token_id=0), paged=paged)
    run.start()
    assert run.done.wait(60) and run.error is None
    p = inputs["input_ids"].shape[1]
    assert [u.tokens for u in run.kv_points] == list(range(p, p + 7))  # hf-accel's own decode loop included
    assert all(u.bytes_used > 0 for u in run.kv_points)
    assert {u.cache_type for u in run.kv_points} == {"PagedCache"}
    assert all(u.bytes_reserved >= u.bytes_used for u in run.kv_points)
    fast = [r for r in hf_log.records if "generate runs the fast decode path" in r.getMessage()]
    hooked = [r for r in hf_log.records if "forward hooks" in r.getMessage()]
    assert bool(fast) == paged and bool(hooked) == (not paged)
    if paged:
        assert len({u.bytes_used for u in run.kv_points}) == 1  # reserved up front
    assert not model._forward_hooks


def test_pane_run_error_is_a_message():
    class Broken:
        def register_forward_hook(self, *a, **k):
            return SimpleNamespace(remove=lambda: None)

        def generate(self, **kw):
            raise RuntimeError("out of memory\nTraceback stuff")

    run = app.PaneRun(Broken(), {"input_ids": torch.zeros(1, 3, dtype=torch.long)}, {})
    run.start()
    assert run.done.wait(10)
    assert run.error == "generation failed: RuntimeError: out of memory"
    assert 'data-state="error"' in run.stats_html()


def _drain(gen):
    return list(gen)


def test_run_comparison_end_to_end_with_tiny_model(tiny, hf_log):
    pytest.importorskip("gradio")
    store = app.ModelStore(CPU, loader=_loader_for(tiny))
    feats = [f for f in app.available_features() if f.key == "attention"]
    outs = _drain(app.run_comparison(store, feats, "", "hello", 4, "Greedy", 0.7, 0.9, "sequential",
                                     [True, None], run_id=7))
    status, s_text, s_stats, a_title, a_text, a_stats, summary, plot = outs[-1]
    assert 'data-kind="ok"' in status and 'data-run="7"' in status
    assert 'data-state="done"' in s_stats and 'data-state="done"' in a_stats
    assert s_text == a_text and s_text.count("t") == 4
    assert "greedy tokens identical: yes" in summary and "hf-accel / stock speed" in summary
    assert "hf-accel attention" in a_title
    paged = demo_features._accelerate_accepts("paged_cache")
    accel_cache = "PagedCache" if paged else "DynamicCache"  # paged by default
    assert set(plot["run"]) == {"stock HF generate", "hf-accel"} and plot["KV cache (MiB)"].notna().all()
    assert "(DynamicCache)" in s_stats and f"({accel_cache}" in a_stats
    # the right pane runs hf-accel's fast decode path (no forward hook of the demo's turns it off)
    assert any("generate runs the fast decode path" in r.getMessage() for r in hf_log.records) == paged
    assert not any("forward hooks" in r.getMessage() for r in hf_log.records)


def test_run_comparison_keeps_the_cap_note_in_the_final_status(tiny):
    """Asked for more new tokens than the context holds: the note saying so stays in the status once the run is
    done (it used to show only while generating)."""
    pytest.importorskip("gradio")
    store = app.ModelStore(CPU, loader=_loader_for(tiny))
    feats = [f for f in app.available_features() if f.key == "attention"]
    outs = _drain(app.run_comparison(store, feats, "", "hello", 1000, "Greedy", 0.7, 0.9, "sequential",
                                     [True, None], run_id=8))
    status = outs[-1][0]
    assert 'data-kind="ok"' in status and "Done" in status and "capped to" in status


def test_run_comparison_bad_input_yields_messages(tiny):
    pytest.importorskip("gradio")
    from hf_accel.models import ModelNotFoundError

    store = app.ModelStore(CPU, loader=_loader_for(tiny, fail=ModelNotFoundError("model path '/nope' does not exist")))
    feats = [f for f in app.available_features() if f.key == "attention"]
    outs = _drain(app.run_comparison(store, feats, "", "   ", 4, "Greedy", 0.7, 0.9, "concurrent", [True, None], 1))
    assert len(outs) == 1 and app.EMPTY_PROMPT_MESSAGE in outs[0][0] and 'data-kind="error"' in outs[0][0]
    outs = _drain(app.run_comparison(store, feats, "/nope", "hi", 4, "Greedy", 0.7, 0.9, "concurrent",
                                     [True, None], 2))
    assert "Loading model /nope" in outs[0][0]
    assert "does not exist" in outs[-1][0] and 'data-kind="error"' in outs[-1][0]
    assert 'data-state="waiting"' in outs[-1][2]


# ---------------------------------------------------------------------------------------------- launcher


def test_launcher_finds_the_app_and_forwards_options():
    from hf_accel import demo_launch

    assert demo_launch.find_demo_app() == APP_PATH
    p = argparse.ArgumentParser()
    demo_launch.add_arguments(p)
    args = p.parse_args(["--port", "9999", "--model", "/m", "--device", "cpu", "--max-new-tokens", "8",
                         "--no-preload"])
    q = argparse.ArgumentParser()
    app.add_arguments(q)
    assert vars(q.parse_args(demo_launch.to_argv(args))) == vars(args)
    assert vars(q.parse_args([])) == vars(p.parse_args([]))  # same defaults


def test_launcher_missing_app_is_one_line(monkeypatch, capsys, tmp_path):
    from hf_accel import demo_launch

    monkeypatch.setenv(demo_launch.DEMO_APP_ENV, str(tmp_path / "nope.py"))
    p = argparse.ArgumentParser()
    demo_launch.add_arguments(p)
    assert demo_launch.run(p.parse_args([])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "demo/app.py not found" in err


def test_a_lone_copy_of_app_py_says_in_one_line_that_it_needs_the_demo_folder(tmp_path):
    """``HF_ACCEL_DEMO_APP`` may name a copy of app.py: one without the demo's other modules next to it stops with
    one line naming them, not a traceback."""
    import shutil
    import subprocess

    lone = tmp_path / "app.py"
    shutil.copy(APP_PATH, lone)
    run = subprocess.run([sys.executable, str(lone), "--help"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 1
    assert run.stderr.strip().count("\n") == 0 and "needs the other modules of the demo/ folder" in run.stderr
    assert "Traceback" not in run.stderr


def test_app_main_rejects_bad_options(capsys):
    assert app.main(["--device", "cuda:7"] if not torch.cuda.is_available() else ["--max-new-tokens", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("n", [0, 1025, 100000])
def test_app_main_rejects_max_new_tokens_outside_the_slider(n, capsys):
    """The launcher's --max-new-tokens is the slider's default: one the slider (and the request check) would
    refuse on every Generate is refused at launch, in one line, before the model is touched."""
    pytest.importorskip("gradio")
    assert app.main(["--max-new-tokens", str(n), "--no-preload"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--max-new-tokens must be between 1 and {app.MAX_NEW_TOKENS} (got {n})" in err


def test_slider_and_request_check_share_the_limit():
    gr = pytest.importorskip("gradio")

    demo = app.build_app(app.ModelStore(app.pick_device("cpu")), default_max_new_tokens=app.MAX_NEW_TOKENS)
    sliders = [b for b in demo.blocks.values() if isinstance(b, gr.Slider) and b.elem_id == "max-new-tokens"]
    assert len(sliders) == 1 and sliders[0].maximum == app.MAX_NEW_TOKENS and sliders[0].value == app.MAX_NEW_TOKENS
    assert app.validate_request("hi", app.MAX_NEW_TOKENS, "Greedy", 0.7, 0.9, "sequential")[1].max_new_tokens == \
        app.MAX_NEW_TOKENS


def test_app_main_names_a_host_or_port_it_cannot_listen_on(capsys):
    """Checked before the app is built, in the launcher's terms (Gradio's message named its port search)."""
    import socket

    pytest.importorskip("gradio")  # main refuses earlier without it
    pytest.importorskip("pandas")

    assert app.main(["--host", "999.1.1.1", "--no-preload"]) == 2
    assert "--host '999.1.1.1' is not an IPv4 address of this machine" in capsys.readouterr().err
    assert app.main(["--host", "::1", "--no-preload"]) == 2
    assert "IPv6 addresses are not supported" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert app.main(["--host", "127.0.0.1", "--port", str(port), "--no-preload"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert app.listen_problem("127.0.0.1", 0) is None


def test_app_main_refuses_a_model_path_that_names_no_model(tmp_path, capsys):
    """A missing path, a folder without config.json, an empty string: exit 2 before the server starts (it
    started and printed its address, then failed to preload)."""
    pytest.importorskip("gradio")
    pytest.importorskip("pandas")
    cases = [(str(tmp_path / "missing"), "does not exist"), (str(tmp_path), "is not a transformers model directory"),
             ("", "--model is empty")]
    for model, message in cases:
        assert app.main(["--model", model, "--no-preload"]) == 2
        err = capsys.readouterr().err
        assert message in err and "http://" not in err
    assert app.model_problem(None) is None


def test_app_main_refuses_a_model_it_cannot_run(tmp_path, capsys):
    """A folder of an unsupported model type, or one with a config but no weights: exit 2 before the server starts."""
    from transformers import GPT2Config, LlamaConfig

    pytest.importorskip("gradio")
    pytest.importorskip("pandas")
    gpt2, empty = tmp_path / "gpt2", tmp_path / "no-weights"
    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(gpt2)
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(empty)
    for path, message in ((gpt2, "does not support model_type 'gpt2'"), (empty, "the folder has no weights")):
        assert app.main(["--model", str(path), "--no-preload"]) == 2
        assert message in capsys.readouterr().err


class _StopAfter3(app.PaneRun):
    def put(self, value):
        super().put(value)
        if len(self.token_ids) == 3:
            self.stop()


@pytest.mark.parametrize("accelerated", [False, True])
def test_pane_run_stop_ends_the_generation_at_the_next_token(accelerated):
    """stop() ends the call at its next token, with no error, and the model's next call is whole (hf-accel's fast
    path included: its cache is released)."""
    import hf_accel

    model = _tiny_llama()
    want = model.generate(**_TinyTokenizer()("hello there"), max_new_tokens=40, do_sample=False, pad_token_id=0)
    if accelerated:
        hf_accel.accelerate_model(model)
    inputs = _TinyTokenizer()("hello there")
    run = _StopAfter3(model, inputs, dict(max_new_tokens=40, do_sample=False, pad_token_id=0), paged=accelerated)
    run.start()
    assert run.done.wait(60) and run.stopped and run.error is None and len(run.token_ids) == 3
    again = app.PaneRun(model, inputs, dict(max_new_tokens=40, do_sample=False, pad_token_id=0), paged=accelerated)
    again.start()
    assert again.done.wait(60) and not again.stopped and again.error is None
    assert torch.equal(again.stats.sequences.cpu(), want)
    if accelerated:
        assert hf_accel.cache_in_use(model) is None


class _SlowRun(app.PaneRun):
    def put(self, value):
        import time

        time.sleep(0.01)
        super().put(value)


def test_a_closed_comparison_stops_its_generations(tiny, monkeypatch):
    """Gradio closes the handler of a cancelled request (or a closed page): its generation threads ran on to the end
    (up to 1024 tokens) and the next request waited for them; now they stop."""
    pytest.importorskip("gradio")
    page = sys.modules["page"]
    monkeypatch.setattr(page, "PaneRun", _SlowRun)
    store = app.ModelStore(CPU, loader=_loader_for(tiny))
    feats = [f for f in app.available_features() if f.key == "attention"]
    gen = app.run_comparison(store, feats, "", "hello", 100, "Greedy", 0.7, 0.9, "concurrent", [True, None], 3)
    for status, *_ in gen:
        if "Generating" in status:
            break
    gen.close()
    for r in store.last_runs:
        assert r.done.wait(30)
    assert all(r.stopped for r in store.last_runs) and all(len(r.token_ids) < 100 for r in store.last_runs)


def test_the_next_request_stops_a_gone_requests_runs_and_does_not_wait_for_one_never_started(tiny):
    """A request whose handler is gone (runs are one at a time) left runs behind: one running, stopped now
    (it was waited for to its end), and, in sequential mode, the hf-accel one never started, which the next request
    waited for forever."""
    import threading

    pytest.importorskip("gradio")
    running = SimpleNamespace(started=True, done=threading.Event(), stopped_by=[])
    running.stop = lambda: (running.stopped_by.append(1), running.done.set())
    running.wait = running.done.wait
    never = app.PaneRun(tiny[0], tiny[1]("hi"), {})  # not started: its done event is never set
    store = app.ModelStore(CPU, loader=_loader_for(tiny))
    store.last_runs = [running, never]
    feats = [f for f in app.available_features() if f.key == "attention"]
    outs = []
    worker = threading.Thread(target=lambda: outs.extend(app.run_comparison(
        store, feats, "", "hello", 4, "Greedy", 0.7, 0.9, "sequential", [True, None], 4)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the request waited for a run that never started"
    assert running.stopped_by and any("Stopping the previous generation" in o[0] for o in outs)
    assert 'data-kind="ok"' in outs[-1][0]


def test_store_default_names_the_embedded_model(tiny, tmp_path, monkeypatch):
    """"default" in the Model box is the embedded model, as for `hf-accel generate`: it reloaded the same weights
    (15 s for SmolLM2 on a CPU) when the box changed between empty and "default"; a folder named default is a path."""
    monkeypatch.chdir(tmp_path)
    store = app.ModelStore(CPU, loader=_loader_for(tiny))
    store.load("")
    assert store.is_loaded("default") and store.is_loaded(" default ")
    store.load("default")
    assert store._loader.calls == [None]
    (tmp_path / "default").mkdir()
    assert not store.is_loaded("default") and app.ModelStore.normalise_path("default") == "default"
