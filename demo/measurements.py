"""What the demo measures in a run and how it shows it: KV-cache memory, the stats line, the plot, the summary.

:func:`kv_usage` reads the K/V memory a transformers cache (or hf-accel's paged cache) holds;
:func:`cache_of` finds that cache in a forward's output. :func:`stats_html` renders a pane's numbers
(tokens/s, time to first token, tokens, KV cache), :func:`kv_plot_rows` the rows of the KV-cache plot,
and :func:`summary_text` the comparison line shown after both panes finish.
"""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_runs import DeviceInfo

log = logging.getLogger("hf_accel.demo")


# --------------------------------------------------------------------------------------------------
# Measuring the KV cache
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Rendering the numbers
# --------------------------------------------------------------------------------------------------


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
