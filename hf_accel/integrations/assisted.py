"""transformers' assisted-generation arguments of a ``generate`` call (``assistant_model=``,
``prompt_lookup_num_tokens=``, ``assistant_early_exit=``, ``max_matching_ngram_size=``) read as a
:class:`~hf_accel.speculative.SpeculativeConfig`, so that an existing script's assisted calls decode on hf-accel's
speculative path (also at batch sizes above 1, where transformers' assisted loop refuses)."""

from __future__ import annotations

import copy
import numbers

from hf_accel._logging import log_once
from hf_accel.speculative.config import MAX_NGRAM, SpeculativeConfig

#: The call arguments that ask for assisted generation (taken off the call once read).
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "max_matching_ngram_size")


class StockLoopReason(str):
    """Why a call's assisted generation runs on transformers' own loop *and cache* (no PagedCache)."""


def assisted_config(model, kwargs) -> tuple[SpeculativeConfig | None, dict, str | None]:
    """transformers' assisted-generation arguments of a call as a :class:`SpeculativeConfig`.

    Returns ``(config, kwargs without those arguments, reason)``: config None and kwargs unchanged when
    the call asks for none; ``reason`` set when it asks for a kind hf-accel does not run (then the call
    is left to transformers), also for an ``assistant_model`` that
    :func:`~hf_accel.speculative.config.check_draft` refuses (another architecture, vocabulary or device,
    training mode, ...: transformers' own assisted loop runs it, or raises its own error).

    An ``assistant_early_exit`` of 0 (not "no early exit": transformers' loop runs a draft of no layers) or of at
    least the model's layer count (its draft runs every layer) gives a :class:`StockLoopReason`: the call runs
    transformers' own assisted loop on transformers' own cache, as without hf-accel (the draft's own ``generate``
    calls included).

    Raises:
        ValueError: a negative ``assistant_early_exit`` int (stock transformers fails on it with a less specific
            message and leaves the model config's layer count negative); a ``prompt_lookup_num_tokens`` int below 1
            (stock transformers refuses it too, with a less specific message).
    """
    configs = [c for c in (kwargs.get("generation_config"), model.generation_config) if c is not None]

    def option(name):  # as transformers merges them: the call's kwarg, the caller's config, the model's config
        value = kwargs.get(name)
        for config in configs:
            if value is None:
                value = getattr(config, name, None)
        if type(value).__module__ == "numpy" and isinstance(value, numbers.Integral):
            value = int(value)  # numpy ints as transformers takes them
        return value

    assistant = kwargs.get("assistant_model")
    lookup = option("prompt_lookup_num_tokens")
    if isinstance(lookup, int) and not isinstance(lookup, bool) and lookup < 1:
        # 0 would otherwise read as "not asked for" and run without it, where transformers raises
        raise ValueError(f"prompt_lookup_num_tokens must be a positive number of draft tokens, got {lookup}")
    early = option("assistant_early_exit")
    if isinstance(early, int) and not isinstance(early, bool) and early < 0:
        # transformers' early-exit loop would set the model config's layer count to it, fail on it and leave it so
        raise ValueError(f"assistant_early_exit must be a number of layers >= 0, got {early}")
    if isinstance(early, int) and not isinstance(early, bool) and early == 0:
        # 0 would otherwise read as "not asked for"; transformers' early-exit loop sets the model config's layer
        # count to it for its draft, for which no PagedCache can be built
        return None, kwargs, StockLoopReason("assistant_early_exit=0 drafts with no layers")
    if assistant is None and not lookup and not early:
        return None, kwargs, None
    if kwargs.get("assistant_tokenizer") is not None or kwargs.get("tokenizer") is not None:
        return None, kwargs, "assisted generation with a draft tokenizer (universal assisted decoding)"
    if sum(x is not None and x is not False and x != 0 for x in (assistant, lookup, early)) > 1:
        return None, kwargs, "more than one kind of assisted generation in one call"
    for name, value in (("prompt_lookup_num_tokens", lookup), ("assistant_early_exit", early)):
        if value and (isinstance(value, bool) or not isinstance(value, int)):
            return None, kwargs, f"{name}={value!r} is not an int"
    layers = getattr(model.config, "num_hidden_layers", None)
    if early and isinstance(early, int) and not isinstance(early, bool) and layers is not None and early >= layers:
        # transformers' loop sets the model config to that many layers for its draft (which then runs them all)
        return None, kwargs, StockLoopReason(f"assistant_early_exit={early} is not below the model's {layers} "
                                             f"layers (hf-accel drafts with 1 .. {layers - 1} of them)")
    if assistant is not None:  # the model itself too: transformers' assisted loop takes it, hf-accel does not
        from hf_accel.speculative.config import check_draft

        try:
            check_draft(model, assistant)
        except ValueError as e:  # transformers' assisted loop takes what hf-accel's drafting does not (a GPT-2
            return None, kwargs, f"the assistant model cannot draft on hf-accel's path ({e})"  # draft, ...)
    try:
        if assistant is not None:
            config = SpeculativeConfig(method="draft_model", draft_model=assistant)
        elif lookup:
            if int(lookup) > 32:
                log_once("lookup-cap", f"hf-accel: prompt_lookup_num_tokens={lookup} drafts at most 32 tokens here")
            ngram = option("max_matching_ngram_size")  # transformers' longest n-gram matched (its default: 2)
            if ngram is not None and (isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1):
                return None, kwargs, f"max_matching_ngram_size={ngram!r} is not an int >= 1"
            if ngram is not None and ngram > MAX_NGRAM:
                log_once("ngram-cap", f"hf-accel: max_matching_ngram_size={ngram} matches at most {MAX_NGRAM}-grams here")
            config = SpeculativeConfig(method="prompt_lookup", num_draft_tokens=min(int(lookup), 32),
                                       **({} if ngram is None else {"max_ngram": min(ngram, MAX_NGRAM)}))
        else:
            config = SpeculativeConfig(method="early_exit", exit_layer=int(early))
    except ValueError as e:
        return None, kwargs, f"assisted generation options not understood ({e})"
    rest = {k: v for k, v in kwargs.items() if k not in _ASSISTED}
    # A caller's generation config may carry the options too: pass a copy without them. (The model's own
    # generation config is not passed along: transformers would warn about a generation_config given with
    # generation kwargs. Its options are ignored by _skip_reason(assisted_handled=True) and cleared by
    # _try_fast after transformers re-applies them.)
    if rest.get("generation_config") is not None:
        gc = copy.deepcopy(rest["generation_config"])
        gc.prompt_lookup_num_tokens = None
        gc.assistant_early_exit = None
        gc.max_matching_ngram_size = None
        rest["generation_config"] = gc
    return config, rest, None
