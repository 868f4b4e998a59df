"""What a model's ``generate`` calls leave to read: the KV cache of the call running now
(:func:`cache_in_use`), the last call's cache statistics (:func:`last_cache_stats`) and speculative counters
(:func:`speculative_stats`)."""

from __future__ import annotations

import contextlib
import copy
import threading

from hf_accel.cache.paged_cache import PagedCache


def last_cache_stats(model) -> dict | None:
    """``PagedCache.memory_stats()`` of the model's last paged ``generate`` call (taken before the release). On the
    fast decode path its blocks are those reserved for the whole answer plus the call's one scratch block (padded
    rows write there), and its tokens those the call left in the cache; None before the first such call, after a call
    that raised (its cache's state is then not what a finished call leaves), for a model never accelerated, and for any
    other object (never raises).

    Args:
        model: the model ``generate`` was called on (a transformers model, or a peft ``PeftModel`` wrapping one).

    Returns:
        A new dict (changing it changes nothing), or None."""
    from hf_accel.integrations.patch import _unwrap_peft

    try:
        hf_model, _ = _unwrap_peft(model)
        stats = vars(hf_model).get("_hf_accel_last_cache_stats")
    except Exception:  # any object: None
        return None
    return dict(stats) if stats is not None else None


@contextlib.contextmanager
def _in_use(model, source):
    """While the body runs, :func:`cache_in_use` answers ``source``'s cache for this thread's call: a FastEngine
    (its ``cache``, made or reused by the call's prefill) or a PagedCache. One entry per calling thread (calls on
    transformers' loop may run side by side)."""
    calls = model.__dict__.setdefault("_hf_accel_in_use", {})
    me = threading.get_ident()
    calls[me] = source
    try:
        yield
    finally:
        calls.pop(me, None)


def cache_in_use(model) -> PagedCache | None:
    """The KV cache that ``model``'s ``generate`` call in progress writes on hf-accel's path, to watch its memory
    while the call runs (``memory_stats()`` from a streamer's ``put``, say): the fast decode path's PagedCache (it
    reserves the blocks of the whole answer after the prefill; None before the prefill), or the PagedCache
    transformers' loop runs on (one generate sized for the call, or one the caller passed). From the thread
    running the call (a streamer's ``put``) it is that call's cache; from another thread, the cache of the one
    call running (None while several run at once). None between calls, for a call on transformers' own cache
    (beam search, a DynamicCache the caller passed, ...) and for a model never accelerated; never raises. Read it
    only: the running call owns it (it is released, or reused by the next call, when the call returns). During a
    fast-path call its sequences hold their reserved length: ``memory_stats()["tokens_stored"]`` counts the slots
    reserved for the whole answer (prompt + ``max_new_tokens`` + the decode step's lookahead), not the tokens
    written so far, and ``get_seq_length()`` does not follow the call until it returns (the written lengths live on
    the GPU: it reads the prompt's length, or 0 on a turn that continues a passed cache); blocks and bytes are
    exact.

    Args:
        model: the model ``generate`` was called on (a transformers model, or a peft ``PeftModel`` wrapping one).
    """
    from hf_accel.engine.fast_generate import FastEngine
    from hf_accel.integrations.patch import _unwrap_peft

    try:
        hf_model, _ = _unwrap_peft(model)
        calls = dict(vars(hf_model).get("_hf_accel_in_use") or {})
    except Exception:  # any object: None
        return None
    source = calls.get(threading.get_ident())
    if source is None and len(calls) == 1:
        source = next(iter(calls.values()))
    if isinstance(source, FastEngine):
        cache = source.cache
        return cache if cache is not None and cache.seq_ids else None  # a released cache: before this call's prefill
    return source if isinstance(source, PagedCache) else None


def speculative_stats(model) -> dict | None:
    """Speculative-decoding counters of the model's last ``generate`` call, or None if it did not decode
    speculatively (also for a model never accelerated; never raises).

    Args:
        model: the model ``generate`` was called on (a transformers model, or a peft ``PeftModel`` wrapping one).

    Returns:
        A new dict (changing it changes nothing), or None.

    Keys: ``method``; ``num_draft_tokens`` (the largest k); ``match_gated`` (prompt lookup choosing each
    round from its own matches); ``verify_steps`` (verify passes with k > 0, also those in which no row had a
    draft to verify, e.g. prompt lookup without a match at a fixed k) and ``backed_off_steps`` (plain
    steps chosen by the adaptive k); ``draft_lengths`` (steps per k); ``draft_tokens`` / ``accepted_tokens``
    (drafts proposed / accepted and committed, summed over rows: drafts past the token budget or an EOS
    are not counted);
    ``acceptance_rate`` = accepted / proposed; ``mean_accepted_per_step`` (accepted drafts per row and
    verify step) and ``mean_tokens_per_step`` (tokens committed per row and verify step, the bonus or
    correction token included); ``round_ms`` (measured time per round by k, from one round's completion to
    the next one's, so the host's turnaround between rounds is included; recent rounds weigh more, as
    the adaptive k uses them; the estimates are kept from call to call for calls of the same shape, so k
    values this call did not run can appear). The keys of ``draft_lengths`` and ``round_ms`` are the k values as strings.
    ``acceptance_rate`` is None when nothing was drafted; the two per-step means are None when no verify step
    ran (a verify step in which no row had a draft counts: 0 accepted, 1 token per row)."""
    from hf_accel.integrations.patch import _unwrap_peft

    hf_model, _ = _unwrap_peft(model)
    stats = getattr(hf_model, "_hf_accel_spec_stats", None)
    return copy.deepcopy(stats) if stats else None
