"""``model.generate`` on hf-accel's paths by default (instance-level wrapper).

``accelerate_model`` sets an instance attribute ``generate`` that first tries the fast decode path
(:mod:`hf_accel.engine.fast_generate`: paged prefill + CUDA-graph decode steps); where that path does
not apply (the reason is logged once) it sizes a growable PagedCache for the call (the blocks its rows
reach as transformers' loop runs it; a longer answer grows it), passes it to transformers' own ``generate``
and frees every block when the call returns (also on error), unless the call returns the cache
(``return_dict_in_generate=True``): then the caller gets it filled and growable, to pass back for the next turn. Multi-turn calls take the fast path too: it
returns a growable PagedCache with ``return_dict_in_generate=True`` and continues a PagedCache passed back
(:meth:`FastEngine.check <hf_accel.engine.fast_generate.FastEngine.check>` says when it cannot). Any other cache
the caller passes (``past_key_values``/``cache``), ``cache_implementation``, ``use_cache=False``, beam search
and assisted generation outside the fast path keep transformers' behaviour, with a log line saying why.

Speculative decoding (:mod:`hf_accel.speculative`) runs on the fast path when the model was accelerated
with ``speculative=...`` or when a call uses transformers' assisted-generation arguments
(``assistant_model=``, ``prompt_lookup_num_tokens=``, ``assistant_early_exit=``), at any batch size.
Where it does not apply the call takes the plain fast path (logged), and where the fast path does not
apply, transformers' own assisted generation runs with the caller's arguments.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import threading

import torch
from transformers.generation import utils as _gen_utils

from hf_accel._logging import log_once
from hf_accel.cache import paged_cache
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.engine import call_lock
from hf_accel.engine.call_options import expand_return_sequences, output_cache, passed_cache
from hf_accel.integrations.assisted import _ASSISTED, StockLoopReason, assisted_config
# cache_in_use, last_cache_stats and speculative_stats are also read from this module (re-exported)
from hf_accel.integrations.call_state import _in_use, cache_in_use, last_cache_stats, speculative_stats  # noqa: F401
from hf_accel.integrations.generation_config import prepare_generation_config
from hf_accel.kernels.device import on_device
from hf_accel.speculative.config import SpeculativeConfig


# transformers >= 5.2x names the generate/forward cache argument "cache" (past_key_values deprecated).
CACHE_KWARG = "cache" if "cache" in getattr(_gen_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def _call(args, kwargs) -> tuple[dict, object]:
    """A generate call's keyword arguments with its token ids as ``input_ids`` (from the first positional argument
    or ``inputs=``), and the caller's ``generation_config`` (popped)."""
    call = dict(kwargs)
    if args and (args[0] is not None or "input_ids" not in call):
        call["input_ids"] = args[0]
    elif "inputs" in call:
        call["input_ids"] = call.pop("inputs")
    return call, call.pop("generation_config", None)


def _as_keywords(original_generate, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``generate``'s positional arguments after the token ids (``generate(ids, generation_config)``) as keywords
    under transformers' parameter names, so that every decision reads them where it reads keywords. Left as they
    are (and run by transformers' loop and cache, :func:`_paged_generate`) where they cannot be named: more of
    them than the signature's positional parameters, a name also passed by keyword (transformers raises), or a
    signature that cannot be read."""
    if len(args) <= 1:
        return args, kwargs
    try:
        params = [p for p in inspect.signature(original_generate).parameters.values()
                  if p.kind is p.POSITIONAL_OR_KEYWORD]
    except (TypeError, ValueError):
        return args, kwargs
    if len(args) > len(params):
        return args, kwargs
    named = dict(zip((p.name for p in params[1:]), args[1:]))
    if any(name in kwargs for name in named):
        return args, kwargs
    return args[:1], {**kwargs, **named}


def _prepared(model, args, kwargs):
    """transformers' own prepared ``(GenerationConfig, model_kwargs)`` of a call (the model's generation config
    merged into the caller's, the call's options applied), with the default length resolved as transformers'
    loop resolves it (``max_new_tokens`` set when the call gives no length). Raises what transformers raises."""
    call, user_config = _call(args, kwargs)
    gc, model_kwargs = prepare_generation_config(model, user_config, call)
    ids = model_kwargs.get("input_ids")
    if (gc.max_new_tokens is None and call.get("max_length") is None and isinstance(ids, torch.Tensor)
            and (user_config is None or user_config.max_length is None)
            and model.generation_config.max_length is None):
        # transformers' default length: max_length more tokens, capped by max_position_embeddings
        limit = gc.max_length + ids.shape[-1]
        max_pos = getattr(model.config, "max_position_embeddings", None)
        gc.max_new_tokens = (min(limit, max_pos) if max_pos else limit) - ids.shape[-1]
    return gc, model_kwargs


def _skip_reason(model, args, kwargs, assisted_handled: bool = False, engine=None, gc=None) -> str | None:
    """Why ``generate`` keeps transformers' own loop and cache (None: hf-accel's path may run).
    ``assisted_handled``: the call's assisted-generation options were turned into a speculative config.
    ``engine``: the model's fast decode engine, which may continue a PagedCache the caller passes (a previous
    turn's). ``gc``: the call's prepared GenerationConfig (:func:`_prepared`: the model's generation config
    merged into the caller's, as transformers' loop reads it); None: read from the call and the configs."""
    gen_config = gc if gc is not None else (kwargs.get("generation_config") or model.generation_config)
    options = {} if gc is not None else kwargs  # a prepared config holds the call's options already
    passed = passed_cache(kwargs)
    if passed is not None and not isinstance(passed, PagedCache):
        return "the caller passed its own cache"
    if options.get("cache_implementation") or getattr(gen_config, "cache_implementation", None):
        return "a cache_implementation was requested"
    if options.get("use_cache", getattr(gen_config, "use_cache", True)) is False:
        return "use_cache=False"
    if (options.get("num_beams") or getattr(gen_config, "num_beams", 1) or 1) > 1:
        return "beam search"
    if not assisted_handled and (kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") or getattr(
        gen_config, "prompt_lookup_num_tokens", None
    ) or kwargs.get("assistant_early_exit") or getattr(gen_config, "assistant_early_exit", None)):
        return "assisted generation"
    mismatch = _layers_unlike_config(model)
    if mismatch is not None:
        return mismatch
    input_ids = _input_ids(args, kwargs)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return ("no 2-D input_ids (inputs_embeds only)" if kwargs.get("inputs_embeds") is not None
                else "no 2-D integer input_ids")
    if input_ids.device.type == "meta":  # no values (torch.is_autocast_enabled rejects the device type too)
        return "input_ids on the meta device"
    if torch.is_autocast_enabled(input_ids.device.type):
        return "autocast is on (transformers' loop runs under it as asked; hf-accel's attention falls back to SDPA)"
    return None


def _check_passed_length(passed, input_ids, attention_mask) -> None:
    """ValueError for a passed PagedCache that holds as many tokens as ``input_ids`` or more, where ``input_ids``
    is the whole conversation (no ``attention_mask``, or one as wide as ``input_ids``): generate feeds the model the
    tokens past the cache (none here; transformers' loop fails on the empty slice with a reshape error). With a
    wider mask, ``input_ids`` may hold only the new tokens (transformers' other continuation form): not checked."""
    if not isinstance(passed, PagedCache) or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != input_ids.shape[1]:
        return
    cached = passed.get_seq_length()
    if cached >= input_ids.shape[1]:
        raise ValueError(f"the passed PagedCache holds {cached} tokens and input_ids has {input_ids.shape[1]}: "
                         "input_ids must hold the tokens the cache holds plus at least one new token (the previous "
                         "turn's sequences followed by the new prompt)")


def _decoder_layers(model) -> torch.nn.ModuleList | None:
    """``model.model.layers`` of a llama-family model (None where the model has no such ModuleList)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def _layers_unlike_config(model) -> str | None:
    """Why a PagedCache, which keeps one pool per configured layer and takes each forward as a step of every
    layer, cannot serve the layers transformers' forward runs (the first ``config.num_hidden_layers``; None: it
    can): layers removed or reordered without updating ``config.num_hidden_layers`` and each attention's
    ``layer_idx`` (pruning). Transformers' own cache takes such a model, so its loop and cache run it."""
    layers = _decoder_layers(model)
    if layers is None:
        return None
    configured = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(configured, int):
        return None
    if configured > len(layers):  # fewer configured layers run the first ones (transformers' early-exit draft)
        return (f"the model has {len(layers)} decoder layers and config.num_hidden_layers says {configured} (layers "
                "removed without updating the config)")
    for i, layer in zip(range(configured), layers):  # (slicing a ModuleList builds a new one: ~50 us a call)
        idx = getattr(layer._modules.get("self_attn"), "layer_idx", i)
        if idx != i:
            return f"decoder layer {i} has self_attn.layer_idx {idx} (layers removed or reordered)"
    return None


def _input_ids(args, kwargs):
    """A generate call's token ids: the first positional argument, ``inputs=`` (transformers' name for
    it) or ``input_ids=``."""
    if args and args[0] is not None:
        return args[0]
    return kwargs["inputs"] if kwargs.get("inputs") is not None else kwargs.get("input_ids")


def _blocks_needed(gc, input_ids: torch.Tensor, block_size: int) -> int:
    """Cache blocks of a call that transformers' loop runs (``gc`` from :func:`_prepared`): every returned row's
    prompt + new tokens."""
    batch, prompt_len = input_ids.shape
    max_new = gc.max_new_tokens
    if max_new is None:
        max_new = max((gc.max_length or 20) - prompt_len, 1)
    rows = batch * max(gc.num_return_sequences or 1, gc.num_beams or 1)
    # lengths as transformers' loop reads them: it stops once the length reaches max_length (3.5 new: 4 tokens)
    return int(rows) * math.ceil((prompt_len + math.ceil(max_new) + 1) / block_size)


def _try_fast(model, engine, args, kwargs, speculative: SpeculativeConfig | None = None, prepared=None,
              original_generate=None, assisted: bool = False):
    """Run the fast path (speculative with ``speculative``); returns the sequences, or None (reason logged)
    when it does not apply. ``prepared``: :func:`_prepared`'s result for this call, if the caller has it.
    ``original_generate``: transformers' ``generate``; with it, a call that needs transformers' logits processors,
    stopping criteria or per-step outputs runs the fast path inside it (:func:`_run_prepared_loop`). ``assisted``:
    ``speculative`` comes from the call's assisted-generation arguments (a streamer gets what transformers'
    assisted loop gives it)."""
    if len(args) > 1:
        reason = "positional generate arguments beyond input_ids"
    else:
        try:
            gc, model_kwargs = prepared if prepared is not None else _prepared(model, args, kwargs)
        except Exception as e:  # transformers raises the same error again on its own path
            reason = f"generation config not understood ({type(e).__name__}: {e})"
        else:
            if speculative is not None:  # the assisted options that asked for it (transformers may re-apply
                gc.prompt_lookup_num_tokens = None  # the model's own generation config's values)
                gc.assistant_early_exit = None
                gc.max_matching_ngram_size = None
            gc, model_kwargs = expand_return_sequences(gc, model_kwargs)  # sampling, n > 1: n rows per prompt
            # concurrent calls on one model wait for each other, unless the running one stops stepping (it may be
            # waiting for this one: a streamer that runs generate on this model in another thread and joins it)
            with engine.call_lock.unless_stalled() as held:
                if not held:
                    reason = (f"a generate call running on this model in another thread ran no step for "
                              f"{call_lock.STALL_S:g} s while this one waited for it (is a streamer or callback of "
                              "that call waiting for this one?)")
                else:
                    reason = engine.check(gc, model_kwargs)
                    if reason is None:
                        with _in_use(model, engine):
                            return _run_fast(model, engine, gc, model_kwargs, speculative, assisted)
                    if original_generate is not None:
                        call, gc, model_kwargs = _stop_strings_as_criterion(model, kwargs, gc, model_kwargs)
                        prepared_reason = engine.check(gc, model_kwargs, prepared_loop=True)
                        if prepared_reason is None:
                            with _in_use(model, engine):
                                return _run_prepared_loop(model, engine, original_generate, args, call,
                                                          model_kwargs, reason, speculative)
                        reason = prepared_reason  # what keeps the call off both routes
    log_once(f"fast-skip:{reason}", f"hf-accel: fast decode path not used: {reason}; transformers' loop runs "
             "on hf-accel's kernels")
    return None


def _run_fast(model, engine, gc, model_kwargs, speculative: SpeculativeConfig | None, assisted: bool = False):
    """The fast path (speculative where asked and
    :meth:`~hf_accel.speculative.engine.SpeculativeEngine.check` allows) for a call that
    ``engine.check`` accepted; the caller holds ``engine.call_lock``."""
    log_once("generate-fast", "hf-accel: generate runs the fast decode path "
             f"({'CUDA graphs' if engine.device.type == 'cuda' and engine.use_cuda_graphs else 'eager steps'})")
    model._hf_accel_spec_stats = model._hf_accel_last_cache_stats = None  # set again if the call returns
    if speculative is not None:
        from hf_accel.speculative.registry import engine_for

        spec = engine_for(model, engine, speculative)
        spec_reason = spec.check(gc, model_kwargs)
        if spec_reason is None:
            out = spec.generate(gc, model_kwargs, assisted=assisted)
            model._hf_accel_spec_stats = spec.last_stats
            model._hf_accel_last_cache_stats = engine.last_stats
            return out
        log_once(f"spec-skip:{spec_reason}", f"hf-accel: speculative decoding not used: {spec_reason}; "
                 "plain fast path")
    out = engine.generate(gc, model_kwargs)
    model._hf_accel_last_cache_stats = engine.last_stats
    return out


def _stop_strings_as_criterion(model, kwargs, gc, model_kwargs):
    """A call's ``stop_strings=`` (with its ``tokenizer=``) as transformers' own ``StopStringCriteria`` in the call's
    ``stopping_criteria``: transformers hands no tokenizer to a ``custom_generate`` decoding method's criteria, so
    the prepared loop gets the criterion built here instead. Returns ``(kwargs, gc, model_kwargs)`` for the
    prepared loop (copies; unchanged where the call has no such option, no tokenizer, or a generation config that
    sets stop strings too: those keep transformers' loop)."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    strings = kwargs.get("stop_strings")
    tokenizer = kwargs.get("tokenizer")
    configs = (kwargs.get("generation_config"), model.generation_config)
    if strings is None or tokenizer is None or any(getattr(c, "stop_strings", None) for c in configs if c is not None):
        return kwargs, gc, model_kwargs
    if any(isinstance(c, StopStringCriteria) for c in (kwargs.get("stopping_criteria") or [])):
        return kwargs, gc, model_kwargs  # transformers lets the caller's criterion replace the one of stop_strings

    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=strings)
    call = {k: v for k, v in kwargs.items() if k != "stop_strings"}
    call["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), criterion])
    gc = copy.copy(gc)
    gc.stop_strings = None
    model_kwargs = dict(model_kwargs, stopping_criteria=call["stopping_criteria"])
    return call, gc, model_kwargs


def _run_prepared_loop(model, engine, original_generate, args, kwargs, model_kwargs, reason: str,
                       speculative: SpeculativeConfig | None):
    """transformers' ``generate`` with its own preparation (checks, ``num_return_sequences`` expansion, special
    tokens, lengths, logits processors, stopping criteria) and hf-accel's decoding method
    (:meth:`FastEngine.decode_prepared <hf_accel.engine.fast_generate.FastEngine.decode_prepared>`) as its
    ``custom_generate``: for calls the direct fast path does not take only because of ``reason`` (an option of
    that kind). The caller holds ``engine.call_lock``."""
    log_once(f"prepared-loop:{reason}", "hf-accel: generate runs the fast decode path inside transformers' generate "
             "(its logits processors, stopping criteria and outputs), for "
             + reason.replace("unsupported generate arguments", "generate arguments"))
    if speculative is not None:
        log_once(f"spec-skip:{reason}", f"hf-accel: speculative decoding not used: {reason}; plain fast path")
    model._hf_accel_spec_stats = model._hf_accel_last_cache_stats = None  # set again if the call returns
    streamer = model_kwargs.get("streamer")
    prefix = passed_cache(model_kwargs)

    def decode(_model, input_ids, logits_processor, stopping_criteria, generation_config, **rest):
        # transformers passes neither the streamer nor the tokenizer to a custom_generate callable; the streamer
        # already got the prompt from generate itself
        return engine.decode_prepared(input_ids, logits_processor, stopping_criteria, generation_config, rest,
                                      streamer=streamer, prefix=prefix)

    call = dict(kwargs)
    for name in _ASSISTED:  # a speculative call's own options (handled: the plain fast path runs)
        call.pop(name, None)
    out = original_generate(*args, custom_generate=decode, **call)
    model._hf_accel_last_cache_stats = engine.last_stats
    return out


def _prepared_or_none(model, args, kwargs):
    """:func:`_prepared`'s ``(GenerationConfig, model_kwargs)``, or None where transformers cannot prepare the
    call (its own loop then raises the error)."""
    try:
        return _prepared(model, args, kwargs)
    except Exception:
        return None


def _continuous_batching(model, original_generate, engine, args, kwargs):
    """``generate(cache_implementation="paged")``: transformers switches to its continuous-batching engine, which
    takes only its own attention implementations; the call runs it with the model's attention from before
    :func:`~hf_accel.integrations.patch.accelerate_model` (:func:`_with_original_attention`)."""
    from hf_accel.integrations.patch import original_attention

    log_once("continuous-batching", "hf-accel: cache_implementation='paged' runs transformers' continuous batching "
             f"with the model's own attention ({original_attention(model)!r}), not hf-accel's kernels")
    return _with_original_attention(model, original_generate, engine, args, kwargs)


def _with_original_attention(model, original_generate, engine, args, kwargs):
    """transformers' ``generate`` with the model's attention implementation from before
    :func:`~hf_accel.integrations.patch.accelerate_model`, hf-accel's set back afterwards (also on error). Calls on
    the fast path wait meanwhile (they need hf-accel's attention)."""
    from hf_accel.integrations.patch import original_attention

    before = original_attention(model)
    current = model.config._attn_implementation
    with engine.call_lock if engine is not None else contextlib.nullcontext():
        model.set_attn_implementation(before)
        try:
            return original_generate(*args, **kwargs)
        finally:
            model.set_attn_implementation(current)


def _foreign_attention(model) -> str | None:
    """Why no forward of ``model`` may use hf-accel's attention (None: it may): a decoder layer whose attention
    module has a config of its own (a layer taken from another model) that selects another attention
    implementation. transformers builds one attention mask per forward, in the format of the model config's
    implementation, and hands it to every layer: that layer's attention function would get hf-accel's
    mask (a 2-D key mask), which it cannot read."""
    layers = _decoder_layers(model)
    if layers is None:
        return None
    config = model.config
    for i, layer in enumerate(layers):
        own = getattr(layer._modules.get("self_attn"), "config", config)
        if own is config:
            continue
        impl = getattr(own, "_attn_implementation", None)
        if impl is not None and impl != config._attn_implementation:
            return (f"decoder layer {i}'s attention has its own config (a layer of another model) selecting "
                    f"attention {impl!r}")
    return None


def _shared_layer_idx(model) -> str | None:
    """Why the model's attention from before ``accelerate_model`` must run its ``generate`` (None: it need not): two
    decoder layers with one ``self_attn.layer_idx`` (a layer duplicated without renumbering it, as in depth
    up-scaling). Both write their K/V into one layer of transformers' cache, which then holds more keys than the
    queries and the mask cover; transformers' attention functions read that in their own ways (SDPA's causal
    flag aligns it top-left, hf-accel's kernels bottom-right), so only the model's own attention gives stock's
    tokens."""
    layers = _decoder_layers(model)
    if layers is None:
        return None
    configured = getattr(model.config, "num_hidden_layers", None)
    runs = configured if isinstance(configured, int) else len(layers)  # (transformers runs the first ones)
    seen: dict[object, int] = {}
    for i, layer in zip(range(runs), layers):
        idx = getattr(layer._modules.get("self_attn"), "layer_idx", None)
        if idx is None:
            continue
        if idx in seen:
            return (f"decoder layers {seen[idx]} and {i} have the same self_attn.layer_idx ({idx}), so share a cache "
                    "layer")
        seen[idx] = i
    return None


def paged_generate(model, original_generate, block_size: int, engine, *args, speculative=None, **kwargs):
    """Fast path (speculative where asked), else ``original_generate`` with a fresh PagedCache, unless
    :func:`_skip_reason` applies. Those decisions read the call's prepared generation config (the model's
    generation config merged into a caller's ``generation_config``, as transformers' loop reads it). Runs with
    the model's GPU as the current CUDA device (:func:`~hf_accel.kernels.device.on_device`: a model on
    ``cuda:1`` while ``cuda:0`` is current)."""
    passed = passed_cache(kwargs)
    passed = passed if isinstance(passed, PagedCache) else None
    if passed is not None:
        _check_passed_tokens(passed, _input_ids(args, kwargs), kwargs.get("attention_mask"))
    with on_device(engine.device if engine is not None else model.device):
        out = _paged_generate(model, original_generate, block_size, engine, *args, speculative=speculative,
                              **kwargs)
    returned = output_cache(out)
    _record_tokens(passed if passed is not None else returned if isinstance(returned, PagedCache) else None, out)
    return out


def _check_passed_tokens(passed: PagedCache, input_ids, attention_mask) -> None:
    """ValueError where ``input_ids`` (the whole conversation: no mask, or one as wide) differs, at a position its
    mask attends, from the tokens ``passed`` holds the K/V of (:attr:`PagedCache.token_ids`, recorded by an earlier
    call): the cache belongs to another conversation, or to a branch that grew it (the same cache passed to two
    continuations). Not checked where the cache has no record, or ``input_ids`` holds only the new tokens."""
    recorded = passed.token_ids
    if recorded is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape != input_ids.shape:
        return
    n = min(recorded.shape[1], input_ids.shape[1], passed.get_seq_length())
    if n == 0 or recorded.shape[0] != input_ids.shape[0]:
        return
    given = input_ids[:, :n]
    differ = given.to(recorded.device) != recorded[:, :n]
    if isinstance(attention_mask, torch.Tensor):
        differ &= attention_mask[:, :n].to(recorded.device).bool()
    if not bool(differ.any()):
        return
    row, pos = (int(v) for v in differ.nonzero()[0])
    raise ValueError(
        f"the passed PagedCache holds the K/V of other tokens than input_ids: row {row}, position {pos} is token "
        f"{int(recorded[row, pos])} in the cache and {int(given[row, pos])} in input_ids. A cache continues the "
        "conversation it was filled with (input_ids: its previous turn's sequences followed by the new prompt); to "
        "branch two continuations from one cache, pass each a copy.deepcopy of it")


def _record_tokens(cache: PagedCache | None, out) -> None:
    """:attr:`PagedCache.token_ids` of ``cache`` after a call that returned ``out``: its sequences but the last token,
    where they are the tokens of the cached positions (as many rows, one position more); None otherwise (the call
    was given only the new tokens)."""
    if cache is None:
        return
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    fits = (isinstance(sequences, torch.Tensor) and sequences.dim() == 2 and sequences.shape[0] == len(cache.seq_ids)
            and sequences.shape[1] - 1 == cache.get_seq_length())
    cache.token_ids = sequences[:, :-1].detach().clone() if fits else None


def _paged_generate(model, original_generate, block_size: int, engine, *args, speculative=None, **kwargs):
    if model.__dict__.get("_hf_accel_stock_generate") == threading.get_ident():
        return original_generate(*args, **kwargs)  # a draft call inside transformers' own assisted loop
    model._hf_accel_spec_stats = None  # set again only by a call that decodes speculatively
    from hf_accel.integrations.patch import revert_if_lora_changed

    if revert_if_lora_changed(model):  # merged LoRA adapters gone stale: hf-accel reverted (logged)
        return original_generate(*args, **kwargs)
    args, kwargs = _as_keywords(original_generate, args, kwargs)
    if len(args) > 1:  # options hf-accel cannot read (use_cache=False, a cache_implementation ...): stock runs them
        log_once("generate-positional", "hf-accel: generate keeps transformers' loop and cache: positional "
                 "arguments after input_ids that do not name generate's parameters")
        return original_generate(*args, **kwargs)
    if kwargs.get("cache_implementation") == "paged":  # transformers reads it from the call's arguments only
        return _continuous_batching(model, original_generate, engine, args, kwargs)
    foreign = _foreign_attention(model) or _shared_layer_idx(model)
    if foreign is not None:
        from hf_accel.integrations.patch import original_attention

        log_once(f"foreign-attention:{foreign}", f"hf-accel: generate runs transformers' loop with the model's own "
                 f"attention ({original_attention(model)!r}): {foreign}")
        return _with_original_attention(model, original_generate, engine, args, kwargs)
    call_spec, rest, assisted_reason = assisted_config(model, kwargs)
    if call_spec is not None and engine is not None:
        prepared = _prepared_or_none(model, args, rest)
        reason = _skip_reason(model, args, rest, assisted_handled=True, engine=engine,
                              gc=None if prepared is None else prepared[0])
        out = None if reason is not None else _try_fast(model, engine, args, rest, speculative=call_spec,
                                                        prepared=prepared, original_generate=original_generate,
                                                        assisted=True)
        if out is not None:
            return out
        ids = _input_ids(args, kwargs)
        rows = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1
        batch_note = f" (transformers' assisted generation takes one row; this call has {rows})" if rows > 1 else ""
        log_once(f"assisted-stock:{reason}:{rows > 1}", "hf-accel: assisted generation runs transformers' own loop"
                 + (f": {reason}" if reason else "") + batch_note)
        return original_generate(*args, **kwargs)
    if isinstance(assisted_reason, StockLoopReason):
        log_once(f"assisted-stock-cache:{assisted_reason}", "hf-accel: transformers' assisted generation runs on "
                 f"its own cache: {assisted_reason}")
        # its early-exit draft calls this model's generate from this thread (which must then run as stock: no
        # PagedCache) with the model config's layer count changed while it runs; fast-path calls of other threads wait
        with engine.call_lock if engine is not None else contextlib.nullcontext():
            layers, model._hf_accel_stock_generate = model.config.num_hidden_layers, threading.get_ident()
            try:
                return _loop_on_passed(model, original_generate, args, kwargs)
            finally:
                model.config.num_hidden_layers, model._hf_accel_stock_generate = layers, None
    if assisted_reason is not None:
        log_once(f"assisted-stock:{assisted_reason}", f"hf-accel: transformers' assisted generation runs: {assisted_reason}")
    prepared = _prepared_or_none(model, args, kwargs)
    if prepared is None:  # transformers' own loop raises why
        return original_generate(*args, **kwargs)
    _check_passed_length(passed_cache(kwargs), _input_ids(args, kwargs), kwargs.get("attention_mask"))
    gc = prepared[0]
    if call_spec is None and assisted_reason is None and engine is not None and speculative is not None:
        reason = _skip_reason(model, args, kwargs, engine=engine, gc=gc)
        if reason is None:
            out = _try_fast(model, engine, args, kwargs, speculative=speculative, prepared=prepared,
                            original_generate=original_generate)
            if out is not None:
                return out
    reason = _skip_reason(model, args, kwargs, engine=engine, gc=gc)
    if reason is not None:
        if isinstance(passed_cache(kwargs), PagedCache):  # (its loop writes the caller's PagedCache)
            log_once(f"generate-skip-passed:{reason}", f"hf-accel: generate continues the caller's PagedCache in "
                     f"transformers' loop: {reason}")
        else:
            log_once(f"generate-skip:{reason}", f"hf-accel: generate keeps transformers' cache: {reason}")
        return _loop_on_passed(model, original_generate, args, kwargs)
    if engine is not None and speculative is None:
        out = _try_fast(model, engine, args, kwargs, prepared=prepared, original_generate=original_generate)
        if out is not None:
            return out
    if passed_cache(kwargs) is not None:  # a PagedCache the fast path did not take (reason logged)
        log_once("generate-passed-paged", "hf-accel: generate continues the caller's PagedCache in transformers' loop")
        return _loop_on_passed(model, original_generate, args, kwargs)
    num_blocks = _blocks_needed(gc, _input_ids(args, kwargs), block_size)
    fit = paged_cache.blocks_that_fit(model.device, paged_cache.kv_block_bytes(
        model.config, block_size, next(model.parameters()).dtype))
    # sized for the call as transformers' loop will run it; growable, so that an answer longer than that estimate
    # (an option read in a way this estimate does not know) costs a copy of the pools, not an error
    growable = True
    if fit is not None and num_blocks > fit:
        log_once(f"pool-fit:{fit}", f"hf-accel: the KV cache of prompt + max_new_tokens ({num_blocks} blocks) does "
                 f"not fit in free device memory: the PagedCache gets {max(fit, 1)} blocks, and an answer that "
                 "outgrows them raises OutOfBlocksError")
        num_blocks, growable = max(fit, 1), False
    cache = PagedCache(model.config, num_blocks=num_blocks, block_size=block_size, growable=growable)
    log_once("generate-paged", f"hf-accel: generate uses PagedCache (block_size {block_size})")
    returned = False
    model._hf_accel_last_cache_stats = None  # set again if the call returns
    try:
        with _in_use(model, cache):
            out = original_generate(*args, **{CACHE_KWARG: cache}, **kwargs)
        # return_dict_in_generate: the caller gets the cache, filled, to pass back for the next turn (as
        # transformers' own DynamicCache); it grows from then on, since its pool was sized for this call
        returned = output_cache(out) is cache
        if returned:
            cache.growable = True
        model._hf_accel_last_cache_stats = cache.memory_stats()
        return out
    finally:
        if not returned:
            cache.release()


def _loop_on_passed(model, original_generate, args, kwargs):
    """transformers' loop on the call's own cache; a PagedCache the caller passed is named by :func:`cache_in_use`
    while it runs, and its ``memory_stats()`` become :func:`last_cache_stats` (as for the PagedCache generate makes).
    A call that raises (a streamer's KeyboardInterrupt, say) leaves that cache as it was passed, as the fast path
    does: the next turn, or a retry of this one, then continues from the tokens before this call."""
    passed = passed_cache(kwargs)
    if not isinstance(passed, PagedCache):
        return original_generate(*args, **kwargs)
    start = passed.get_seq_length()
    model._hf_accel_last_cache_stats = None  # set again if the call returns
    try:
        with _in_use(model, passed):
            out = original_generate(*args, **kwargs)
    except BaseException:
        _roll_back(passed, start)
        raise
    model._hf_accel_last_cache_stats = passed.memory_stats()
    return out


def _roll_back(cache: PagedCache, length: int) -> None:
    """``cache`` back to its first ``length`` tokens after a failed call (a partial step included); never raises
    (the call's own error is the one to see)."""
    try:
        if length == 0:
            cache.release()
        elif max(layer.length for layer in cache.layers) > length:
            cache.crop(length)
    except Exception:  # pragma: no cover - the cache then says what is wrong at its next use
        log_once("roll-back-failed", "hf-accel: the passed PagedCache could not be rolled back after the failed call")


def install(model, block_size: int, fast_decode: bool = True, cuda_graphs: bool = True,
            speculative: SpeculativeConfig | None = None) -> None:
    """Shadow ``model.generate`` on this instance only (speculative decoding by default with ``speculative``).

    Raises:
        ValueError: ``speculative`` without ``fast_decode``, or a draft model hf-accel cannot run.
    """
    from hf_accel.engine.fast_generate import FastEngine

    if speculative is not None and not fast_decode:
        raise ValueError("speculative decoding runs on the fast decode path: it needs fast_decode=True")
    original = model.generate
    engine = FastEngine(model, block_size=block_size, use_cuda_graphs=cuda_graphs) if fast_decode else None
    if speculative is not None:
        from hf_accel.speculative.registry import engine_for

        engine_for(model, engine, speculative)  # checks the draft model now
    model._hf_accel_engine = engine
    if engine is not None:  # the model's and its base model's state_dict() (see _projections_own_storage)
        owners = [m for m in (model, getattr(model, "model", None)) if isinstance(m, torch.nn.Module)]
        model._hf_accel_state_dict_hooks = [
            *(m.register_state_dict_pre_hook(functools.partial(_projections_own_storage, model)) for m in owners),
            *(m.register_state_dict_post_hook(functools.partial(_unshared_projections, model)) for m in owners),
            *(m.register_load_state_dict_pre_hook(functools.partial(_release_before_load, model)) for m in owners)]
    model.generate = functools.partial(paged_generate, model, original, block_size, engine, speculative=speculative)
    # name, doc and __wrapped__ (inspect.signature follows it), not __annotations__: transformers' hold ForwardRefs,
    # which do not pickle (torch.save(model) of an accelerated model)
    functools.update_wrapper(model.generate, original, assigned=("__module__", "__name__", "__qualname__", "__doc__"))


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _projections_own_storage(model, module, prefix, keep_vars) -> None:
    """``state_dict()`` of a model (or of its base model) whose fast path merged its Q/K/V and gate/up projections
    (their weights are slices of one matrix per layer): the engine gives them their own storage back first (one
    layer's projections copied at a time) and drops its steps, which the next ``generate`` builds again. Otherwise
    savers that refuse or drop tensors sharing storage (accelerate's ``save_model``, safetensors' ``save_model``)
    would write a checkpoint without some weights or raise. Inside a running ``generate`` of this thread (a
    streamer's callback) the slices are left as they are (:func:`_unshared_projections` copies them)."""
    from hf_accel.engine.merged_weights import projections_share_storage

    engine = model.__dict__.get("_hf_accel_engine")
    if engine is None or engine.call_lock.held_here():
        return
    with engine.call_lock:  # waits for a generate running in another thread
        if engine.merged or projections_share_storage(model):  # (a model loaded by torch.load shares, unmerged)
            engine.release()


def _release_before_load(model, module, *args) -> None:
    """``load_state_dict`` on the model (or its base model): the engine drops its steps and gives merged projections
    their own storage back first. With ``assign=True`` the merged matrices would otherwise stay in memory beside the
    new weights until the next ``generate`` (most of the model's weights, twice); an in-place load then fills
    the modules' own storage, and the next ``generate`` merges and builds its steps again."""
    engine = model.__dict__.get("_hf_accel_engine")
    if engine is None or engine.call_lock.held_here() or not (engine.merged or engine.steps):
        return
    with engine.call_lock:  # waits for a generate running in another thread
        engine.release()


def _unshared_projections(model, module, state_dict, prefix, local_metadata) -> None:
    """After ``state_dict()``: projection entries that still share storage (a ``generate`` in another thread merged
    them again while the state dict was being built, or this thread's running ``generate`` holds them merged) are
    replaced by copies, so that no saver drops them. Other shared entries (tied embeddings) stay as stock has them."""
    by_storage: dict[int, list[str]] = {}
    for key, value in state_dict.items():
        parts = key.rsplit(".", 2)
        if key.startswith(prefix) and len(parts) == 3 and parts[1] in _PROJECTIONS and isinstance(value, torch.Tensor):
            by_storage.setdefault(value.untyped_storage().data_ptr(), []).append(key)
    for keys in by_storage.values():
        if len(keys) > 1:
            for key in keys:
                state_dict[key] = state_dict[key].detach().clone()


def uninstall(model) -> None:
    engine = model.__dict__.get("_hf_accel_engine")
    if engine is not None:  # first: an error here leaves the model as it was (accelerated, generate installed)
        engine.release()
    model.__dict__.pop("generate", None)
    for hook in model.__dict__.pop("_hf_accel_state_dict_hooks", ()):
        hook.remove()
    model.__dict__.pop("_hf_accel_engine", None)
    engines = model.__dict__.pop("_hf_accel_spec_engines", None)
    if engines is not None:
        engines.close()  # reverts the draft models its engines accelerated
    for name in ("_hf_accel_spec_stats", "_hf_accel_last_cache_stats", "_hf_accel_generation_configs",
                 "_hf_accel_in_use"):
        model.__dict__.pop(name, None)
