"""``model.generate`` on hf-accel's paths by default (instance-level wrapper).

``accelerate_model`` sets an instance attribute ``generate`` that first tries the fast decode path
(:mod:`hf_accel.engine.fast_generate`: paged prefill + CUDA-graph decode steps); where that path does
not apply (the reason is logged once) it sizes a PagedCache for the call (exactly the blocks its rows
can reach), passes it to transformers' own ``generate`` and frees every block when the call returns
(also on error). The caller's own cache (``past_key_values``/``cache``) or
``cache_implementation``, ``use_cache=False``, beam search and assisted generation keep transformers'
behaviour, with a log line saying why.
"""

from __future__ import annotations

import functools

from transformers.generation import utils as _gen_utils

from hf_accel._logging import log_once
from hf_accel.cache.paged_cache import PagedCache

# transformers >= 5.2x names the generate/forward cache argument "cache" (past_key_values deprecated).
CACHE_KWARG = "cache" if "cache" in getattr(_gen_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def _skip_reason(model, args, kwargs) -> str | None:
    gen_config = kwargs.get("generation_config") or model.generation_config
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return "the caller passed its own cache"
    if kwargs.get("cache_implementation") or getattr(gen_config, "cache_implementation", None):
        return "a cache_implementation was requested"
    if kwargs.get("use_cache", getattr(gen_config, "use_cache", True)) is False:
        return "use_cache=False"
    if (kwargs.get("num_beams") or getattr(gen_config, "num_beams", 1) or 1) > 1:
        return "beam search"
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") or getattr(
        gen_config, "prompt_lookup_num_tokens", None
    ):
        return "assisted generation"
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None or input_ids.dim() != 2:
        return "no 2-D input_ids (inputs_embeds only)"
    return None


def _blocks_needed(model, args, kwargs, block_size: int) -> int:
    gen_config = kwargs.get("generation_config") or model.generation_config
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    batch, prompt_len = input_ids.shape
    max_new = kwargs.get("max_new_tokens", getattr(gen_config, "max_new_tokens", None))
    if max_new is None:
        max_new = max(kwargs.get("max_length", getattr(gen_config, "max_length", 20) or 20) - prompt_len, 1)
    rows = batch * (kwargs.get("num_return_sequences") or getattr(gen_config, "num_return_sequences", 1) or 1)
    return rows * -(-(prompt_len + max_new + 1) // block_size)


def _try_fast(model, engine, args, kwargs):
    """Run the fast path; returns the sequences, or None (reason logged) when it does not apply."""
    if len(args) > 1:
        reason = "positional generate arguments beyond input_ids"
    else:
        call = dict(kwargs)
        if args:
            call["input_ids"] = args[0]
        elif "inputs" in call:
            call["input_ids"] = call.pop("inputs")
        user_config = call.pop("generation_config", None)
        try:
            gc, model_kwargs = model._prepare_generation_config(user_config, **call)
        except Exception as e:  # transformers raises the same error again on its own path
            reason = f"generation config not understood ({type(e).__name__})"
        else:
            ids = model_kwargs.get("input_ids")
            if (gc.max_new_tokens is None and call.get("max_length") is None and ids is not None
                    and (user_config is None or user_config.max_length is None)
                    and model.generation_config.max_length is None):
                # transformers' default length: max_length more tokens, capped by max_position_embeddings
                limit = gc.max_length + ids.shape[-1]
                max_pos = getattr(model.config, "max_position_embeddings", None)
                gc.max_new_tokens = (min(limit, max_pos) if max_pos else limit) - ids.shape[-1]
            reason = engine.check(gc, model_kwargs)
            if reason is None:
                log_once("generate-fast", "hf-accel: generate runs the fast decode path "
                         f"({'CUDA graphs' if model.device.type == 'cuda' and engine.use_cuda_graphs else 'eager steps'})")
                out = engine.generate(gc, model_kwargs)
                model._hf_accel_last_cache_stats = engine.last_stats
                return out
    log_once(f"fast-skip:{reason}", f"hf-accel: fast decode path not used: {reason}; transformers' loop runs "
             "on hf-accel's kernels")
    return None


def paged_generate(model, original_generate, block_size: int, engine, *args, **kwargs):
    """Fast path, else ``original_generate`` with a fresh PagedCache, unless :func:`_skip_reason` applies."""
    reason = _skip_reason(model, args, kwargs)
    if reason is not None:
        log_once(f"generate-skip:{reason}", f"hf-accel: generate keeps transformers' cache: {reason}")
        return original_generate(*args, **kwargs)
    if engine is not None:
        out = _try_fast(model, engine, args, kwargs)
        if out is not None:
            return out
    cache = PagedCache(model.config, num_blocks=_blocks_needed(model, args, kwargs, block_size),
                       block_size=block_size)
    log_once("generate-paged", f"hf-accel: generate uses PagedCache (block_size {block_size})")
    try:
        return original_generate(*args, **{CACHE_KWARG: cache}, **kwargs)
    finally:
        model._hf_accel_last_cache_stats = cache.memory_stats()
        cache.release()


def install(model, block_size: int, fast_decode: bool = True, cuda_graphs: bool = True) -> None:
    """Shadow ``model.generate`` on this instance only."""
    from hf_accel.engine.fast_generate import FastEngine

    original = model.generate
    engine = FastEngine(model, block_size=block_size, use_cuda_graphs=cuda_graphs) if fast_decode else None
    model._hf_accel_engine = engine
    model.generate = functools.partial(paged_generate, model, original, block_size, engine)
    functools.update_wrapper(model.generate, original)


def uninstall(model) -> None:
    model.__dict__.pop("generate", None)
    engine = model.__dict__.pop("_hf_accel_engine", None)
    if engine is not None:
        engine.release()


def last_cache_stats(model) -> dict | None:
    """``PagedCache.memory_stats()`` of the model's last paged ``generate`` call (taken before the release)."""
    return getattr(model, "_hf_accel_last_cache_stats", None)
