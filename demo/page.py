"""The Gradio page: its layout (:func:`build_app`) and the Generate handler (:func:`run_comparison`).

The handler checks the request, loads the model and prepares the accelerated copy when needed, runs the
two panes (both at once or one after the other) and streams their text, stats, the KV-cache plot and,
at the end, the comparison summary. Every error ends as a one-line message next to the Generate button.
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import logging
import time

import torch

from features import Feature, available_features, enabled_features, uses_paged_cache
from measurements import kv_plot_rows, stats_html, summary_text
from model_runs import DEFAULT_MODEL_LABEL, DeviceInfo, ModelStore, PaneRun
from request import (DECODING, MAX_NEW_TOKENS, RUN_MODES, cap_to_context, first_line, generate_kwargs,
                     validate_request)

log = logging.getLogger("hf_accel.demo")

STOCK, ACCEL = "stock", "accel"
PANE_TITLES = {STOCK: "stock HF generate", ACCEL: "hf-accel"}
POLL_S = 0.2


CSS = """
.pane-stats { display: flex; flex-wrap: wrap; gap: 0.4em 1.2em; align-items: baseline; padding: 0.4em 0.2em; }
.pane-stats .state { font-weight: 600; }
.pane-stats .state-done { color: #15803d; }
.pane-stats .state-error { color: #b91c1c; }
.pane-stats .state-running, .pane-stats .state-loading { color: #b45309; }
.pane-stats .tps { font-size: 1.3em; }
.pane-note { width: 100%; color: #b91c1c; }
.status-msg { padding: 0.5em 0.8em; border-radius: 6px; }
.status-info { background: #eff6ff; color: #1e3a8a; }
.status-ok { background: #f0fdf4; color: #14532d; }
.status-error { background: #fef2f2; color: #991b1b; font-weight: 600; }
#device-info { font-size: 1.05em; }
"""


def _header_md(device: DeviceInfo) -> str:
    how = ("On CPU the hf-accel pane runs the PyTorch reference of its kernels: the page shows that the "
           "outputs match and what the features change, not the GPU speed-up (the Triton kernels need a GPU)."
           if device.device == "cpu" else "The hf-accel pane runs hf-accel's Triton kernels.")
    return (
        "# hf-accel: stock transformers vs hf-accel, side by side\n"
        "One prompt, two model instances with the same weights: the left one exactly as transformers loads "
        "it, the right one after `hf_accel.accelerate_model(model)`. Both call the unchanged "
        "`model.generate()`.\n\n"
        f"**Device: {device.label}** ({device.dtype}). {how}"
    )


def _kv_caption(feats: list[Feature]) -> str:
    keys = {f.key for f in feats}
    text = ("K/V bytes each run's cache holds as the sequence grows (the cache class is named under each pane). "
            "Stock transformers grows one DynamicCache tensor per layer by concatenation")
    if "paged" in keys:
        text += ("; hf-accel's paged cache counts the blocks it has allocated (whole blocks, possibly reserved "
                 "ahead for the rest of the answer), and its pool is shown under the pane")
    else:
        text += "; both panes use it today, so the lines coincide"
    if "gqa" in keys:
        text += ". GQA conversion lowers the hf-accel line (fewer KV heads)"
    return text + "."


def status_html(message: str, kind: str = "info", run: int = 0) -> str:
    """The message line next to the Generate button (kind: info / error / ok).

    ``data-run`` numbers the Generate clicks, so a browser test can tell this run's message from the last.
    """
    if not message:
        return f'<div class="status-msg" data-kind="none" data-run="{run}"></div>'
    return (f'<div class="status-msg status-{kind}" data-kind="{kind}" data-run="{run}">'
            f"{html.escape(message)}</div>")


def build_app(store: ModelStore, *, default_model: str | None = None, default_max_new_tokens: int = 32):
    """The Gradio Blocks of the demo (not launched)."""
    import gradio as gr
    device = store.device
    feats = available_features()
    runs_started = itertools.count(1)

    with gr.Blocks(title="hf-accel demo") as app:
        gr.Markdown(_header_md(device), elem_id="device-info")
        with gr.Row():
            model_box = gr.Textbox(value=default_model or "", label="Model",
                                   placeholder=f"empty = {DEFAULT_MODEL_LABEL}; or a local HF model directory / .gguf file",
                                   elem_id="model-path", scale=3)
            run_mode = gr.Radio(choices=[(v, k) for k, v in RUN_MODES.items()], value="concurrent",
                                label="How the two panes run", elem_id="run-mode", scale=2)
        prompt = gr.Textbox(label="Prompt", lines=2, placeholder="Ask something…", elem_id="prompt")
        with gr.Row():
            run_btn = gr.Button("Generate", variant="primary", elem_id="run-btn", scale=1)
            status = gr.HTML(status_html(""), elem_id="status", scale=4)
        with gr.Accordion("Generation settings and features", open=True):
            with gr.Row():
                max_new = gr.Slider(1, MAX_NEW_TOKENS, value=default_max_new_tokens, step=1, label="Max new tokens",
                                    elem_id="max-new-tokens")
                decoding = gr.Radio(list(DECODING), value="Greedy", label="Decoding", elem_id="decoding")
                temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature (sampling)")
                top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p (sampling)")
            feature_inputs = []
            with gr.Row():
                for f in feats:
                    with gr.Column(min_width=220):
                        box = gr.Checkbox(value=f.default, label=f.label, info=f.info, elem_id=f"feature-{f.key}")
                        # no precision=0: Gradio would round 1.5 to 2 before parse_int could refuse it
                        setting = (gr.Number(value=f.setting_default, label=f.setting_label,
                                             elem_id=f"feature-{f.key}-setting")
                                   if f.setting_label else gr.State(None))
                    feature_inputs += [box, setting]
        with gr.Row(equal_height=True):
            panes = {}
            for key in (STOCK, ACCEL):
                with gr.Column():
                    title = gr.Markdown(f"### {PANE_TITLES[key]}", elem_id=f"{key}-title")
                    text = gr.Textbox(label="answer", lines=8, max_lines=16, interactive=False,
                                      elem_id=f"{key}-text", autoscroll=True)
                    stats = gr.HTML(stats_html("waiting"), elem_id=f"{key}-stats")
                    panes[key] = (title, text, stats)
        summary = gr.HTML("", elem_id="summary")
        # Starts empty (None): an empty DataFrame as first value breaks later updates of the plot.
        plot = gr.LinePlot(None, x="sequence length (tokens)", y="KV cache (MiB)", color="run",
                           color_map={PANE_TITLES[STOCK]: "#2563eb", PANE_TITLES[ACCEL]: "#ea580c"},
                           title="KV-cache memory over the generation",
                           elem_id="kv-plot", height=280)
        gr.Markdown(_kv_caption(feats), elem_id="kv-caption")

        outputs = [status, panes[STOCK][1], panes[STOCK][2], panes[ACCEL][0], panes[ACCEL][1],
                   panes[ACCEL][2], summary, plot]

        def handler(model_path, prompt_text, n_new, dec, temp, tp, mode, *feature_values):
            run_id = next(runs_started)
            try:
                yield from run_comparison(store, feats, model_path, prompt_text, n_new, dec, temp, tp, mode,
                                          feature_values, run_id)
            except Exception as e:  # last guard: a message on the page, the app stays up
                log.warning("the demo handler failed", exc_info=True)
                msg = f"Something went wrong: {type(e).__name__}: {first_line(e)}"
                yield (status_html(msg, "error", run_id),) + tuple(gr.skip() for _ in range(len(outputs) - 1))

        inputs = [model_box, prompt, max_new, decoding, temperature, top_p, run_mode, *feature_inputs]
        # One comparison at a time, whether started by the button or by Enter in the prompt.
        run_btn.click(handler, inputs, outputs, concurrency_limit=1, concurrency_id="generate")
        prompt.submit(handler, inputs, outputs, concurrency_limit=1, concurrency_id="generate")
    return app


def accel_title(enabled: dict, feats: list[Feature]) -> str:
    names = [f.label + (f" = {enabled[f.key]}" if f.setting_label else "") for f in feats if f.key in enabled]
    return f"### {PANE_TITLES[ACCEL]}" + (f" — {', '.join(names)}" if names else " — no feature enabled (same as stock)")


def run_comparison(store: ModelStore, feats, model_path, prompt_text, n_new, dec, temp, tp, mode,
                   feature_values, run_id: int = 0):
    """The Generate handler: yields (status, stock text, stock stats, accel title, accel text,
    accel stats, summary, plot) tuples. Every error ends as a message in ``status``."""
    import gradio as gr
    import pandas as pd

    skip = gr.skip()

    def st(message, kind="info"):
        return status_html(message, kind, run_id)

    def out(status=skip, s_text=skip, s_stats=skip, a_title=skip, a_text=skip, a_stats=skip, summ=skip, plot=skip):
        return (status, s_text, s_stats, a_title, a_text, a_stats, summ, plot)

    try:
        prompt, settings = validate_request(prompt_text, n_new, dec, temp, tp, mode)
        enabled = enabled_features(feats, feature_values)
    except ValueError as e:
        yield out(st(str(e), "error"))
        return
    reset_panes = False
    try:
        if not store.is_loaded(model_path):
            reset_panes = True
            name = store.normalise_path(model_path) or DEFAULT_MODEL_LABEL
            wait = " (about 20 s on CPU)" if store.device.device == "cpu" else ""
            yield out(st(f"Loading model {name}{wait}…"), "", stats_html("loading"), skip, "",
                      stats_html("loading"), "", None)
            store.load(model_path)
        stock_model, tokenizer = store.stock, store.tokenizer
        if enabled:
            yield out(st("Preparing the hf-accel model…"))
        accel_model = store.accelerated(enabled, feats)
    except ValueError as e:  # the panes keep the last run, unless they were cleared for loading
        waiting = stats_html("waiting") if reset_panes else skip
        yield out(st(str(e), "error"), skip, waiting, skip, skip, waiting)
        return
    except Exception as e:  # never a stack trace on the page
        log.warning("preparing the models failed", exc_info=True)
        yield out(st(f"Something went wrong: {type(e).__name__}: {first_line(e)}", "error"))
        return

    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(store.device.device)
    config = stock_model.config.get_text_config()
    try:
        n_new, cap_note = cap_to_context(settings.max_new_tokens, int(inputs["input_ids"].shape[-1]),
                                         getattr(config, "max_position_embeddings", None))
    except ValueError as e:
        yield out(st(str(e), "error"))
        return
    settings = dataclasses.replace(settings, max_new_tokens=n_new)
    kw = generate_kwargs(settings, tokenizer.pad_token_id)
    if any(r.started and not r.done.is_set() for r in store.last_runs):
        # comparisons run one at a time (concurrency_limit=1), so the request of these is gone: its page was
        # closed or its event cancelled, which stops the handler but not the generation threads
        yield out(st("Stopping the previous generation (its page was closed or it was cancelled)…"))
        for r in store.last_runs:
            r.stop()
        for r in store.last_runs:
            r.wait()
    runs = {STOCK: PaneRun(stock_model, inputs, kw),
            ACCEL: PaneRun(accel_model, inputs, kw, paged=uses_paged_cache(enabled, feats))}
    store.last_runs = list(runs.values())
    how = "both at once" if settings.run_mode == "concurrent" else "stock first, then hf-accel"
    title = accel_title(enabled, feats)

    def snapshot(status_msg, kind="info", summ=""):
        series = {PANE_TITLES[k]: r.kv_points for k, r in runs.items()}
        rows = kv_plot_rows(series)
        plot = pd.DataFrame(rows) if any(r["KV cache (MiB)"] == r["KV cache (MiB)"] for r in rows) else None
        return out(st(status_msg, kind), runs[STOCK].text(tokenizer), runs[STOCK].stats_html(), title,
                   runs[ACCEL].text(tokenizer), runs[ACCEL].stats_html(), summ, plot)

    order = [STOCK, ACCEL]
    if settings.run_mode == "concurrent":
        for k in order:
            runs[k].start()
    else:
        runs[STOCK].start()
    running_msg = f"Generating ({how}, {settings.max_new_tokens} new tokens max{'; ' + cap_note if cap_note else ''})…"
    try:
        while not all(r.done.is_set() for r in runs.values()):
            if not runs[ACCEL].started and runs[STOCK].done.is_set():
                runs[ACCEL].start()
            yield snapshot(running_msg)
            time.sleep(POLL_S)
    except GeneratorExit:  # the handler was closed (cancelled, page gone): its generations stop too
        for r in runs.values():
            r.stop()
        raise
    s, a = runs[STOCK], runs[ACCEL]
    errors = [f"{PANE_TITLES[k]}: {r.error}" for k, r in runs.items() if r.error]
    if errors:
        yield snapshot("; ".join(errors), "error")
        return
    identical = None
    if not settings.do_sample:
        identical = torch.equal(s.stats.sequences.cpu(), a.stats.sequences.cpu())
    summ = summary_text(s.stats, a.stats, greedy=not settings.do_sample, identical=identical,
                        run_mode=settings.run_mode, device=store.device,
                        output_may_differ=any(f.changes_output and f.key in enabled for f in feats))
    yield snapshot(f"Done{' (' + cap_note + ')' if cap_note else ''}.", "ok",
                   f'<div class="summary">{html.escape(summ)}</div>')
