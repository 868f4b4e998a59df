"""hf-accel demo: stock Hugging Face ``generate`` and the accelerated model side by side.

Start it with ``hf-accel demo`` or ``python demo/app.py`` (options: ``--help``). One prompt runs through
two model instances holding the same weights: the left pane is the model exactly as transformers loads
it, the right pane is a copy passed through :func:`hf_accel.accelerate_model` (plus any other feature
toggled on). Both stream their tokens with live tokens/s and time to first token, and a plot shows the
KV-cache memory of each over the generation.

The UI is built so that every hf-accel feature is one entry of :data:`FEATURES`: a toggle appears only
for features the installed package has.

Only the public API is used: ``hf_accel``, ``hf_accel.models`` and, when present, ``hf_accel.conversion``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import html
import importlib
import inspect
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import torch  # noqa: E402

import hf_accel  # noqa: E402
from hf_accel.cache.paged_cache import MAX_BLOCK_SIZE  # noqa: E402
from hf_accel.models import ModelNotFoundError, load_model  # noqa: E402

#: The most new tokens a request may ask for: the slider's end, the request check and the launcher's flag.
MAX_NEW_TOKENS = 1024

log = logging.getLogger("hf_accel.demo")

DEFAULT_MODEL_LABEL = "embedded SmolLM2-135M-Instruct"
EMPTY_PROMPT_MESSAGE = "Please enter a prompt: the prompt box is empty."
STOCK, ACCEL = "stock", "accel"
PANE_TITLES = {STOCK: "stock HF generate", ACCEL: "hf-accel"}
RUN_MODES = {
    "concurrent": "Both at once (two threads sharing the device)",
    "sequential": "One after the other (each gets the whole device)",
}
DECODING = ("Greedy", "Sampling")
POLL_S = 0.2


# --------------------------------------------------------------------------------------------------
# Device
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    device: str  # torch device string
    dtype: str  # "float32" / "bfloat16"
    label: str  # what the page says, e.g. "CPU — PyTorch reference attention path"


def pick_device(requested: str | None = None, *, cuda_available: bool | None = None,
                gpu_name: str | None = None, cpu_count: int | None = None) -> DeviceInfo:
    """The device the demo runs on: ``requested`` or CUDA when available, else CPU.

    Raises:
        ValueError: a CUDA device was requested but there is none.
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    device = requested or ("cuda" if cuda_available else "cpu")
    if device.startswith("cuda"):
        if not cuda_available:
            raise ValueError(f"device {device!r} requested but no CUDA GPU is available")
        if gpu_name is None:
            gpu_name = torch.cuda.get_device_name(torch.device(device))
        return DeviceInfo(device, "bfloat16", f"GPU ({gpu_name}) — Triton kernels")
    if device != "cpu":
        raise ValueError(f"unknown device {device!r}; use cpu or cuda[:N]")
    cores = cpu_count or os.cpu_count() or 1
    return DeviceInfo("cpu", "float32", f"CPU ({cores} cores) — PyTorch reference attention path")


# --------------------------------------------------------------------------------------------------
# Features: one entry per hf-accel feature; the UI shows a toggle for each available one
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Feature:
    """One hf-accel feature the right pane can use; the page shows a toggle for it when ``available()``.

    A feature acts in one or both of two ways on a fresh copy of the weights:

    - ``transform(model, setting) -> model`` changes the model before it is accelerated (e.g. GQA
      conversion of the weights);
    - ``options(on, setting) -> dict`` gives keyword options of :func:`hf_accel.accelerate_model`
      (called when it is toggled on *and* when off, so "off" can be passed explicitly).

    ``setting`` is the value of the feature's optional numeric setting (``setting_label``), else None.
    ``requires`` names features that must be on for this one to do anything.
    """

    key: str
    label: str
    info: str
    default: bool = True
    available: Callable[[], bool] = lambda: True
    transform: Callable[[Any, Any], Any] | None = None
    options: Callable[[bool, Any], dict] | None = None
    setting_label: str | None = None
    setting_default: int | None = None
    requires: tuple[str, ...] = ()
    changes_output: bool = False  # True when the feature changes the weights (outputs may differ)


ATTENTION = "attention"  # the feature that is accelerate_model() itself; the other options need it


def _import_convert_to_gqa():
    """``hf_accel.conversion.convert_to_gqa`` if this install has it, else None."""
    try:
        return importlib.import_module("hf_accel.conversion").convert_to_gqa
    except (ImportError, AttributeError):
        return None


def _accelerate_accepts(option: str) -> bool:
    """True if this install's ``accelerate_model`` takes the keyword option ``option``."""
    try:
        return option in inspect.signature(hf_accel.accelerate_model).parameters
    except (TypeError, ValueError):
        return False


def _transform_gqa(model, num_kv_heads):
    convert = _import_convert_to_gqa()
    if convert is None:
        raise RuntimeError("GQA conversion is not available in this hf-accel install")
    n = parse_int(num_kv_heads, "KV heads after conversion")
    out = convert(model, n)
    return model if out is None else out


def _paged_options(on: bool, block_size) -> dict:
    if not on:
        return {"paged_cache": False}
    n = parse_int(block_size, "KV block size")
    if not 1 <= n <= MAX_BLOCK_SIZE:
        raise ValueError(f"KV block size must be between 1 and {MAX_BLOCK_SIZE} (got {n})")
    return {"paged_cache": True, "block_size": n}


FEATURES: tuple[Feature, ...] = (
    Feature(
        key="gqa",
        label="GQA conversion (mean-pool K/V heads)",
        info="Pools the K/V heads of each group into one (Ainslie et al. 2023): a smaller KV cache. "
             "Changes the weights, so the answer may differ from stock.",
        default=False,
        available=lambda: _import_convert_to_gqa() is not None,
        transform=_transform_gqa,
        setting_label="KV heads after conversion",
        setting_default=1,
        changes_output=True,
    ),
    Feature(
        key=ATTENTION,
        label="hf-accel attention",
        info="accelerate_model(): Triton attention kernels on GPU, their PyTorch reference on CPU. "
             "Off: the right pane runs an unmodified copy.",
    ),
    Feature(
        key="paged",
        label="Paged KV cache",
        info="K/V kept in fixed-size blocks (PagedAttention) instead of one growing tensor per layer.",
        available=lambda: _accelerate_accepts("paged_cache"),
        options=_paged_options,
        setting_label="KV block size (tokens)",
        setting_default=16,
        requires=(ATTENTION,),
    ),
    # Later features (speculative decoding, quantization) are added here.
)


def build_accelerated(model, enabled: dict[str, Any], features=FEATURES):
    """Apply the enabled features to ``model`` (a fresh copy) and return the model for the right pane.

    Args:
        enabled: feature key -> setting, for the features toggled on.
        features: the features shown on the page, in order.

    Raises:
        ValueError: a page message (bad setting, a feature that needs another one, a failing feature).
    """
    for f in features:
        if f.key in enabled:
            missing = [r for r in f.requires if r not in enabled]
            if missing:
                names = ", ".join(next((g.label for g in features if g.key == r), r) for r in missing)
                raise ValueError(f"{f.label} needs {names} to be on")
    for f in features:
        if f.transform is not None and f.key in enabled:
            model = _run_feature(f, f.transform, model, enabled[f.key])
    if ATTENTION in enabled:
        options = {}
        for f in features:
            if f.options is not None:
                options.update(_run_feature(f, f.options, f.key in enabled, enabled.get(f.key, f.setting_default)))
        model = _run_feature(next(f for f in features if f.key == ATTENTION),
                             lambda m, _s: hf_accel.accelerate_model(m, **options), model, None)
    return model


def _run_feature(feature: Feature, fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        raise ValueError(f"{feature.label}: {first_line(e)}") from None
    except Exception as e:
        log.warning("feature %s failed", feature.key, exc_info=True)
        raise ValueError(f"{feature.label}: {type(e).__name__}: {first_line(e)}") from None


def available_features(features=FEATURES) -> list[Feature]:
    return [f for f in features if f.available()]


def parse_int(value, what: str) -> int:
    """An integer from a UI number/text value, or ValueError with a readable message."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a whole number (got {value!r})") from None
    if f != int(f):
        raise ValueError(f"{what} must be a whole number (got {value!r})")
    return int(f)


# --------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenSettings:
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    run_mode: str


def validate_request(prompt, max_new_tokens, decoding, temperature, top_p, run_mode) -> tuple[str, GenSettings]:
    """Check the form; returns (stripped prompt, settings) or raises ValueError with the page message."""
    text = (prompt or "").strip()
    if not text:
        raise ValueError(EMPTY_PROMPT_MESSAGE)
    n = parse_int(max_new_tokens, "Max new tokens")
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise ValueError(f"Max new tokens must be between 1 and {MAX_NEW_TOKENS} (got {n})")
    if decoding not in DECODING:
        raise ValueError(f"Decoding must be one of {', '.join(DECODING)} (got {decoding!r})")
    do_sample = decoding == "Sampling"
    try:
        temperature, top_p = float(temperature), float(top_p)
    except (TypeError, ValueError):
        raise ValueError("Temperature and top-p must be numbers") from None
    if do_sample and not temperature > 0:
        raise ValueError(f"Temperature must be > 0 for sampling (got {temperature})")
    if do_sample and not 0 < top_p <= 1:
        raise ValueError(f"Top-p must be in (0, 1] (got {top_p})")
    if run_mode not in RUN_MODES:
        raise ValueError(f"unknown run mode {run_mode!r}")
    return text, GenSettings(n, do_sample, temperature, top_p, run_mode)


def generate_kwargs(settings: GenSettings, pad_token_id) -> dict:
    kw = dict(max_new_tokens=settings.max_new_tokens, do_sample=settings.do_sample, pad_token_id=pad_token_id)
    if settings.do_sample:
        kw.update(temperature=settings.temperature, top_p=settings.top_p)
    else:  # keep the model's generation_config from adding sampling knobs to a greedy run
        kw.update(temperature=None, top_p=None, top_k=None)
    return kw


def kv_cache_bytes(cache) -> int | None:
    """Bytes held by the K/V tensors of a transformers cache (each tensor counted once), or None.

    Works for caches with ``layers`` of ``keys``/``values`` (DynamicCache and friends in
    transformers 5) and for legacy tuples of (key, value) per layer.
    """
    if cache is None:
        return None
    tensors = []
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    elif isinstance(cache, (list, tuple)):
        for layer in cache:
            if isinstance(layer, (list, tuple)):
                tensors += list(layer)
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total if seen or layers is not None else None


@dataclass(frozen=True)
class KVUsage:
    """KV-cache memory of one run after one forward pass."""

    tokens: int  # tokens held by the cache (PaneRun: the sequence length, prompt + generated, when sampled)
    bytes_used: int  # bytes of K/V holding those tokens (a paged cache: its allocated blocks)
    bytes_reserved: int | None  # a paged cache's whole pool, else None
    cache_type: str  # class name, e.g. DynamicCache / PagedCache


def kv_usage(cache) -> KVUsage | None:
    """How much K/V memory ``cache`` holds, or None if it cannot tell.

    A cache with ``memory_stats()`` (hf-accel's paged cache) reports its allocated blocks
    (``bytes_allocated``) and pool (``bytes_reserved``); any other cache is measured from its K/V
    tensors (:func:`kv_cache_bytes`).
    """
    if cache is None:
        return None
    try:
        tokens = int(cache.get_seq_length())
    except Exception:
        tokens = 0
    stats_fn = getattr(cache, "memory_stats", None)
    if callable(stats_fn):
        try:
            stats = stats_fn()
            return KVUsage(tokens, int(stats["bytes_allocated"]), int(stats["bytes_reserved"]), type(cache).__name__)
        except Exception:
            log.debug("memory_stats() failed; measuring tensors", exc_info=True)
    nbytes = kv_cache_bytes(cache)
    return None if nbytes is None else KVUsage(tokens, nbytes, None, type(cache).__name__)


def cache_of(output):
    """The cache object a model forward returned (``cache`` in transformers 5, ``past_key_values`` before)."""
    if output is None:
        return None
    keys = output.keys() if hasattr(output, "keys") else ()
    for name in ("cache", "past_key_values"):
        if name in keys:
            return output[name]
    return None


def fmt_ms(seconds) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f} ms"


def fmt_mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:.2f} MiB"


def stats_html(state: str, *, tokens: int = 0, seconds: float | None = None, tok_s: float | None = None,
               ttft_s: float | None = None, kv: KVUsage | None = None, note: str = "") -> str:
    """The stats line under a pane. ``state`` is waiting / loading / running / done / error.

    The numbers sit in elements with fixed classes (``tps``, ``ttft``, ``ntok``, ``kv``) and the state
    in ``data-state``, so a browser test can read them.
    """
    words = {"waiting": "waiting", "loading": "loading model…", "running": "generating…",
             "done": "finished", "error": "error"}
    tps = "–" if tok_s is None or tok_s != tok_s else f"{tok_s:.1f}"
    secs = "–" if seconds is None else f"{seconds:.2f} s"
    extra = f'<div class="pane-note">{html.escape(note)}</div>' if note else ""
    return (
        f'<div class="pane-stats" data-state="{state}">'
        f'<span class="state state-{state}">{words.get(state, state)}</span>'
        f'<span class="metric"><b class="tps">{tps}</b> tok/s</span>'
        f'<span class="metric">TTFT <b class="ttft">{fmt_ms(ttft_s)}</b></span>'
        f'<span class="metric"><b class="ntok">{tokens}</b> tokens in {secs}</span>'
        f'<span class="metric">KV cache <b class="kv">{fmt_mib(None if kv is None else kv.bytes_used)}</b>'
        f"{kv_detail(kv)}</span>"
        f"{extra}</div>"
    )


def kv_detail(kv: KVUsage | None) -> str:
    """What follows the KV number in a pane: the cache type and a paged cache's pool."""
    if kv is None:
        return ""
    text = kv.cache_type
    if kv.bytes_reserved is not None:
        text += f", blocks in use; pool {fmt_mib(kv.bytes_reserved)} reserved"
    return f' <span class="kv-detail">({html.escape(text)})</span>'


def status_html(message: str, kind: str = "info", run: int = 0) -> str:
    """The message line next to the Generate button (kind: info / error / ok).

    ``data-run`` numbers the Generate clicks, so a browser test can tell this run's message from the last.
    """
    if not message:
        return f'<div class="status-msg" data-kind="none" data-run="{run}"></div>'
    return (f'<div class="status-msg status-{kind}" data-kind="{kind}" data-run="{run}">'
            f"{html.escape(message)}</div>")


def kv_plot_rows(series: dict[str, list[KVUsage]]) -> list[dict]:
    """Rows for the KV-cache plot: one per (run, sample): sequence length and MiB in use.

    A run without samples yet gets one row with no value (NaN, not drawn): the browser's plot fixes
    its set of series at the first update and would never draw a series that appears later.
    """
    rows = []
    x0 = min((u.tokens for points in series.values() for u in points), default=0)
    for name, points in series.items():
        for u in points:
            rows.append({"sequence length (tokens)": u.tokens, "KV cache (MiB)": u.bytes_used / 2**20, "run": name})
        if not points:
            rows.append({"sequence length (tokens)": x0, "KV cache (MiB)": float("nan"), "run": name})
    return rows


def summary_text(stock, accel, *, greedy: bool, identical: bool | None, run_mode: str, device: DeviceInfo,
                 output_may_differ: bool) -> str:
    """The comparison line shown after both panes finish (``stock``/``accel``: GenerationStats or None)."""
    parts = []
    if stock is not None and accel is not None and stock.tokens_per_s > 0:
        ratio = accel.tokens_per_s / stock.tokens_per_s
        if run_mode == "sequential":
            parts.append(f"hf-accel / stock speed: {ratio:.2f}× ({accel.tokens_per_s:.1f} vs "
                         f"{stock.tokens_per_s:.1f} tok/s)")
        else:
            parts.append(f"{accel.tokens_per_s:.1f} vs {stock.tokens_per_s:.1f} tok/s while competing for the "
                         "device: not a speed comparison (choose 'One after the other' for that)")
    if greedy and identical is not None:
        if identical:
            parts.append("greedy tokens identical: yes")
        elif output_may_differ:
            parts.append("greedy tokens identical: no (expected: GQA conversion changed the weights)")
        else:
            parts.append("greedy tokens identical: NO")
    elif not greedy:
        parts.append("sampling: the two answers are independent draws")
    how = ("ran at the same time in two threads sharing the " + ("CPU cores" if device.device == "cpu" else "GPU")
           + ", so each pane's tok/s is lower than it would be alone"
           if run_mode == "concurrent" else "ran one after the other, each with the whole device")
    parts.append(how)
    return " · ".join(parts)


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def _warm_up(model, tokenizer, device: str) -> None:
    """One short generate so neither pane pays one-time start costs (kernel compilation) in its numbers."""
    ids = tokenizer("Hello", return_tensors="pt").to(device)
    with torch.inference_mode():
        model.generate(**ids, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)


class ModelStore:
    """The loaded weights (stock instance) and the accelerated copy for the current feature set.

    Thread-safe; one model path at a time. A model that fails to load leaves the previous one in place.
    """

    def __init__(self, device: DeviceInfo, loader=load_model):
        self.device = device
        self._loader = loader
        self._lock = threading.RLock()
        self._path_key: str | None = None
        self.stock = None
        self.tokenizer = None
        self._accel = None
        self._accel_key = None
        self.last_runs: list = []  # PaneRuns of the last comparison (a closed page does not stop them)

    @staticmethod
    def normalise_path(path) -> str | None:
        p = (path or "").strip()
        return p or None

    def is_loaded(self, path) -> bool:
        return self.stock is not None and self._path_key == (self.normalise_path(path) or "")

    def load(self, path) -> None:
        """Make ``path`` (None/"" = embedded SmolLM2) the current model. Raises ValueError with a page message."""
        key = self.normalise_path(path)
        with self._lock:
            if self.stock is not None and self._path_key == (key or ""):
                return
            name = key or DEFAULT_MODEL_LABEL
            try:
                model, tokenizer = self._loader(key, dtype=self.device.dtype, device=self.device.device)
            except ModelNotFoundError as e:
                raise ValueError(f"Could not load the model: {e}") from None
            except Exception as e:  # any loader failure is a page message, never a crash
                log.warning("loading %s failed", name, exc_info=True)
                raise ValueError(f"Could not load the model {name!r}: {type(e).__name__}: {first_line(e)}") from None
            supported = getattr(hf_accel, "SUPPORTED_MODEL_TYPES", None)
            model_type = getattr(model.config, "model_type", None)
            if supported and model_type not in supported:
                raise ValueError(f"hf-accel does not support model type {model_type!r} "
                                 f"(supported: {', '.join(supported)}); the previous model stays loaded")
            _warm_up(model, tokenizer, self.device.device)
            self.stock, self.tokenizer, self._path_key = model, tokenizer, key or ""
            self._accel, self._accel_key = None, None

    def accelerated(self, enabled: dict[str, Any], features=FEATURES):
        """The right pane's model: a copy of the stock weights with the enabled features applied.

        ``enabled`` maps feature key -> setting (None if the feature has no setting). Cached until the
        features or the model change. Raises ValueError with a page message.
        """
        key = tuple(sorted((k, repr(v)) for k, v in enabled.items()))
        with self._lock:
            if self.stock is None:
                raise ValueError("no model is loaded")
            if self._accel is not None and self._accel_key == key:
                return self._accel
            self._accel, self._accel_key = None, None  # free the old copy first
            model = build_accelerated(copy.deepcopy(self.stock), enabled, features)
            _warm_up(model, self.tokenizer, self.device.device)
            self._accel, self._accel_key = model, key
            return model


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


# --------------------------------------------------------------------------------------------------
# One pane's generation, in a thread
# --------------------------------------------------------------------------------------------------


class PaneRun:
    """Runs ``measure_generate`` in a thread and records tokens, timestamps and KV-cache bytes.

    It is the inner streamer of :func:`hf_accel.measure_generate` (which does the timing). A forward
    hook on the model catches the cache object that generate uses (the prefill pass returns it; a
    decode loop that does not go through the model's forward, like hf-accel's fast path, keeps using
    the same object), and each new token samples that cache's K/V memory.
    """

    def __init__(self, model, inputs: dict, gen_kwargs: dict):
        self.model = model
        self.inputs = inputs
        self.gen_kwargs = gen_kwargs
        self.token_ids: list[int] = []
        self.kv_points: list[KVUsage] = []  # after the prefill, then one per new token
        self.prompt_len = int(inputs["input_ids"].shape[-1])
        self._cache = None
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.stats = None
        self.error: str | None = None
        self.started = False
        self.done = threading.Event()
        self._prompt_seen = False

    # streamer interface
    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.token_ids.extend(int(t) for t in value.reshape(-1).tolist())
        self._sample_kv(self.prompt_len + len(self.token_ids))

    def end(self):
        pass  # not sampled here: a cache may already be freed when generate ends

    def _hook(self, _module, _args, _kwargs, output):
        cache = cache_of(output)
        if cache is not None:
            self._cache = cache
            self._sample_kv(self.prompt_len + len(self.token_ids))

    def _sample_kv(self, seq_len: int):
        """Record the cache's memory at sequence length ``seq_len`` (prompt + tokens generated so far)."""
        try:
            usage = kv_usage(self._cache)
        except Exception:  # a cache that cannot be read mid-generate: no plot point, no failure
            log.debug("reading the KV cache failed", exc_info=True)
            return
        if usage is None:
            return
        usage = dataclasses.replace(usage, tokens=seq_len)
        if self.kv_points and self.kv_points[-1].tokens == seq_len:
            self.kv_points[-1] = usage
        else:
            self.kv_points.append(usage)

    def start(self):
        self.started = True
        threading.Thread(target=self._run, name="hf-accel-demo-generate", daemon=True).start()

    def _run(self):
        handle = self.model.register_forward_hook(self._hook, with_kwargs=True)
        try:
            self.t_start = time.perf_counter()
            with torch.inference_mode():
                self.stats = hf_accel.measure_generate(self.model, self.inputs, streamer=self, **self.gen_kwargs)
        except Exception as e:
            log.warning("generate failed", exc_info=True)
            self.error = f"generation failed: {type(e).__name__}: {first_line(e)}"
        finally:
            handle.remove()
            self.done.set()

    def text(self, tokenizer) -> str:
        return tokenizer.decode(list(self.token_ids), skip_special_tokens=True)

    def stats_html(self) -> str:
        kv = self.kv_points[-1] if self.kv_points else None
        if self.error:
            return stats_html("error", tokens=len(self.token_ids), kv=kv, note=self.error)
        if self.stats is not None:
            s = self.stats
            return stats_html("done", tokens=s.new_tokens, seconds=s.seconds, tok_s=s.tokens_per_s,
                              ttft_s=s.ttft_s, kv=kv)
        if not self.started or self.t_start is None:
            return stats_html("waiting")
        elapsed = time.perf_counter() - self.t_start
        n = len(self.token_ids)
        return stats_html("running", tokens=n, seconds=elapsed, tok_s=n / elapsed if n and elapsed > 0 else None,
                          ttft_s=None if self.t_first is None else self.t_first - self.t_start, kv=kv)


# --------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------

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


def enabled_features(feats: list[Feature], values) -> dict:
    """{feature key: setting} of the toggled-on features, from the flat (checkbox, setting) UI values."""
    values = list(values)
    if len(values) != 2 * len(feats):
        raise ValueError("internal error: feature inputs do not match the feature list")
    return {f.key: values[2 * i + 1] for i, f in enumerate(feats) if values[2 * i]}


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
    kw = generate_kwargs(settings, tokenizer.pad_token_id)
    if not all(r.done.is_set() for r in store.last_runs):
        yield out(st("Waiting for the previous generation to finish…"))
        for r in store.last_runs:
            r.done.wait()
    runs = {STOCK: PaneRun(stock_model, inputs, kw), ACCEL: PaneRun(accel_model, inputs, kw)}
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
    running_msg = f"Generating ({how}, {settings.max_new_tokens} new tokens max)…"
    while not all(r.done.is_set() for r in runs.values()):
        if not runs[ACCEL].started and runs[STOCK].done.is_set():
            runs[ACCEL].start()
        yield snapshot(running_msg)
        time.sleep(POLL_S)
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
    yield snapshot("Done.", "ok", f'<div class="summary">{html.escape(summ)}</div>')


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


from hf_accel.demo_launch import add_arguments  # noqa: E402  (one definition of the options)


def model_problem(model: str | None) -> str | None:
    """Why ``--model`` names no model hf-accel can load (an empty string, a missing path, a folder without
    ``config.json``, a file that is not a ``.gguf``, a config transformers cannot read), or None (also for the
    default model, which loads at the first Generate if it is missing). Reads the config only (seconds)."""
    if model is None:
        return None
    if not str(model).strip():
        return "--model is empty; give a model directory or .gguf file (or leave it out for the embedded model)"
    from hf_accel.models import ModelNotFoundError, load_config

    try:
        config = load_config(model)
    except ModelNotFoundError as e:
        return f"--model: {e}"
    except (OSError, ValueError, KeyError) as e:
        return f"--model {model}: could not read its config: {type(e).__name__}: {first_line(e)}"
    model_type = getattr(config, "model_type", None)
    if model_type not in hf_accel.SUPPORTED_MODEL_TYPES:
        return (f"--model {model}: hf-accel does not support model_type {model_type!r} (supported: "
                f"{', '.join(hf_accel.SUPPORTED_MODEL_TYPES)})")
    from pathlib import Path

    path = Path(model).expanduser()
    weights = ("*.safetensors", "*.bin", "*.pt", "*.pth")
    if path.is_dir() and not any(next(path.glob(pattern), None) for pattern in weights):
        return f"--model {model}: the folder has no weights ({', '.join(weights)})"
    return None


def listen_problem(host: str, port: int) -> str | None:
    """Why the page cannot be served on ``host``:``port`` (None: it can, as far as a socket bound there now
    tells), in terms of the launcher's flags: Gradio's own message names its port search and ``launch()``
    arguments instead. IPv6 hosts are refused (Gradio's server URL cannot hold one); a name's IPv4 addresses
    must all be free."""
    import ipaddress
    import socket

    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            return f"--host {host!r}: IPv6 addresses are not supported by the demo's server; use an IPv4 address"
    except ValueError:
        pass  # a name
    try:
        infos = socket.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r} is not an IPv4 address of this machine ({getattr(e, 'strerror', None) or e})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(address)
            except OSError as e:
                return f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-accel demo", description="Stock HF generate vs hf-accel, side by side.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        import gradio  # noqa: F401
        import pandas  # noqa: F401
    except ImportError:
        print("hf-accel demo: error: gradio is not installed; run: pip install 'hf-accel[demo]' (in a clone: pip install -e '.[demo]')", file=sys.stderr)
        return 2
    try:
        device = pick_device(args.device)
    except ValueError as e:
        print(f"hf-accel demo: error: {e}", file=sys.stderr)
        return 2
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        print(f"hf-accel demo: error: --max-new-tokens must be between 1 and {MAX_NEW_TOKENS} "
              f"(got {args.max_new_tokens})", file=sys.stderr)
        return 2
    problem = listen_problem(args.host, args.port) or model_problem(args.model)
    if problem:
        print(f"hf-accel demo: error: {problem}", file=sys.stderr)
        return 2
    n_default = args.max_new_tokens or (32 if device.device == "cpu" else 128)
    store = ModelStore(device)
    app = build_app(store, default_model=args.model, default_max_new_tokens=n_default)
    if not args.no_preload:
        def preload():
            try:
                store.load(args.model)
                store.accelerated({f.key: f.setting_default for f in available_features() if f.default})
                print("hf-accel demo: model loaded", flush=True)
            except Exception as e:  # shown again on the page at the first Generate
                print(f"hf-accel demo: could not preload the model: {first_line(e)}", file=sys.stderr, flush=True)
        threading.Thread(target=preload, name="hf-accel-demo-preload", daemon=True).start()
    import gradio as gr

    print(f"hf-accel demo on {device.label}: http://{args.host}:{args.port}", flush=True)
    try:
        app.queue(default_concurrency_limit=1).launch(
            server_name=args.host, server_port=args.port, show_error=False, ssr_mode=False, quiet=True,
            css=CSS, theme=gr.themes.Default(), footer_links=[],
        )
    except OSError as e:
        print(f"hf-accel demo: error: cannot listen on {args.host}:{args.port}: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
