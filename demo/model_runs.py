"""The models the two panes run, and one pane's generation.

:func:`pick_device` chooses the device (and dtype) the demo runs on; :class:`ModelStore` holds the loaded
weights (the stock instance) and the accelerated copy for the current feature set; :class:`PaneRun` runs
``generate`` for one pane in a thread and records its tokens, timing and KV-cache memory.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

import hf_accel
from hf_accel.models import ModelNotFoundError, load_model

from features import FEATURES, build_accelerated
from measurements import KVUsage, cache_of, kv_usage, stats_html
from request import first_line

log = logging.getLogger("hf_accel.demo")

DEFAULT_MODEL_LABEL = "embedded SmolLM2-135M-Instruct"


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
        """The model a Model box entry names: None for the embedded model (empty, or "default" where no folder of
        that name is here, as :func:`hf_accel.models.load_model` reads it), else the stripped path."""
        p = (path or "").strip()
        if p == "default" and not os.path.exists(p):
            return None
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


# --------------------------------------------------------------------------------------------------
# One pane's generation, in a thread
# --------------------------------------------------------------------------------------------------


class GenerationStopped(Exception):
    """Raised from a :class:`PaneRun`'s streamer once :meth:`PaneRun.stop` was called: it ends the ``generate``
    call at its next token (an exception from a streamer leaves no state behind, in stock transformers and in
    hf-accel)."""


class PaneRun:
    """Runs ``measure_generate`` in a thread and records tokens, timestamps and KV-cache bytes.

    It is the inner streamer of :func:`hf_accel.measure_generate` (which does the timing). Each new token
    samples the K/V memory of the cache the call writes: with ``paged`` (a model accelerated with its paged
    cache) the one :func:`hf_accel.cache_in_use` names, with no hook (a forward hook turns hf-accel's fast decode
    path off); otherwise the one the model's forward returns, caught by a forward hook. :meth:`stop` ends the
    call at its next token (a stopping criterion would do it too, but would take hf-accel off its fused decode
    loop, which the comparison measures).
    """

    def __init__(self, model, inputs: dict, gen_kwargs: dict, *, paged: bool = False):
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
        self.stopped = False  # ended by stop() before its last token
        self._stop = threading.Event()
        self._prompt_seen = False
        self._paged = paged

    def stop(self) -> None:
        """End the generation at its next token (nothing happens to a run that has ended or never starts)."""
        self._stop.set()

    def wait(self) -> None:
        """Return once the run has ended; at once for a run that was never started."""
        if self.started:
            self.done.wait()

    # streamer interface
    def put(self, value):
        if self._stop.is_set():
            raise GenerationStopped
        if self._paged:
            self._cache = hf_accel.cache_in_use(self.model) or self._cache
        if not self._prompt_seen:  # generate hands the prompt over after the prefill
            self._prompt_seen = True
            if self._paged:
                self._sample_kv(self.prompt_len)
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
        handle = None if self._paged else self.model.register_forward_hook(self._hook, with_kwargs=True)
        try:
            self.t_start = time.perf_counter()
            with torch.inference_mode():
                self.stats = hf_accel.measure_generate(self.model, self.inputs, streamer=self, **self.gen_kwargs)
        except GenerationStopped:
            self.stopped = True
        except Exception as e:
            log.warning("generate failed", exc_info=True)
            self.error = f"generation failed: {type(e).__name__}: {first_line(e)}"
        finally:
            if handle is not None:
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
