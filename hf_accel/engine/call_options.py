"""The options of a ``generate`` call as the fast path reads them: which generation options and arguments it
implements (directly, or inside transformers' own ``generate``: :data:`PREPARED_LOOP_OPTIONS`), and the call's
EOS / pad ids, attention mask, passed cache, expanded rows and logits processors, by transformers' rules."""

from __future__ import annotations

import copy
import numbers

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# GenerationConfig fields the fast path implements (others must keep their default values).
_HANDLED = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k",
    "top_p", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "transformers_version",
    "_from_model_config", "output_attentions", "output_hidden_states", "num_beams", "num_return_sequences",
    "cache_implementation", "decoder_start_token_id", "repetition_penalty", "return_dict_in_generate",
}
# the caller's cache (a PagedCache: the previous turn's, see passed_cache) under either transformers name
_CACHE_NAMES = ("past_key_values", "cache")
_MODEL_KWARGS = {"input_ids", "attention_mask", "streamer", "synced_gpus", *_CACHE_NAMES}
# generation outputs besides sequences and the cache that return_dict_in_generate can ask for
_OUTPUT_OPTIONS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
#: Generation options that only shape transformers' logits processors and stopping criteria (each processor reads
#: the tokens so far and the step's logits, none calls the model), and the per-step outputs: a call with any of them
#: decodes on the fast path with the processors, criteria and outputs transformers prepares for it
#: (:meth:`~hf_accel.engine.fast_generate.FastEngine.decode_prepared`, the ``prepared_loop`` route of
#: :meth:`~hf_accel.engine.fast_generate.FastEngine.check`).
PREPARED_LOOP_OPTIONS = frozenset({
    "sequence_bias", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "top_h", "min_p", "typical_p",
    "epsilon_cutoff", "eta_cutoff", "watermarking_config", "renormalize_logits", "max_time", "output_scores",
    "output_logits",
})
#: generate arguments the prepared loop takes besides _MODEL_KWARGS: transformers builds them into its lists
_PREPARED_LOOP_KWARGS = frozenset({"logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "tokenizer"})


def eos_ids(eos) -> list[int]:
    """A generation config's ``eos_token_id`` as a list of distinct Python ints (first occurrence order): None, an int
    of any kind (numpy, a one-element tensor), or a list / tuple / tensor of them, as transformers accepts them."""
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        ids = [int(x) for x in eos.flatten().tolist()]
    elif isinstance(eos, numbers.Integral):
        ids = [int(eos)]
    else:
        ids = [int(x) for x in eos]
    return list(dict.fromkeys(ids))  # each id once, in the given order (the first is the default pad id)


def call_inputs(gc, model_kwargs, input_ids, vocab_size: int | None = None):
    """``(attention_mask, eos_ids, pad_id)`` of a generate call, by transformers' rules: without a mask, one
    is inferred from padding when the pad id occurs in the prompt and is not an EOS id; the pad id defaults
    to the first EOS id (else 0). Ids come back as Python ints.

    With ``vocab_size``, a pad id outside ``[0, vocab_size)`` comes back as 0 for one-row calls: the pad id a
    finished row is fed in the steps after its end (transformers' loop stops a one-row call at its EOS and
    never feeds it; those steps' tokens are not returned). ``FastEngine.check`` sends batches with such a
    pad id to transformers' loop."""
    eos_list = eos_ids(gc.eos_token_id)
    pad = int(gc.pad_token_id) if gc.pad_token_id is not None else (eos_list[0] if eos_list else 0)
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        infer = gc.pad_token_id is not None and pad not in eos_list and bool((input_ids == pad).any())
        attention_mask = input_ids.ne(pad).long() if infer else torch.ones_like(input_ids)
    if vocab_size is not None and not 0 <= pad < vocab_size and input_ids.shape[0] == 1:
        pad = 0
    return attention_mask.to(input_ids.device), eos_list, pad


def passed_cache(model_kwargs):
    """The cache object a call passed (any transformers ``Cache``: ``past_key_values=`` or ``cache=``), or None."""
    for name in _CACHE_NAMES:
        if model_kwargs.get(name) is not None:
            return model_kwargs[name]
    return None


def expand_return_sequences(gc, model_kwargs):
    """A sampling call with ``num_return_sequences = n > 1`` as the batch transformers' loop decodes for it:
    each row's ``input_ids`` / ``attention_mask`` repeated n times in place (``repeat_interleave``, as
    transformers' ``_expand_inputs_for_generation``), and a copy of ``gc`` with ``num_return_sequences = 1``.
    The result is transformers' [batch * n, prompt_len + new] row order.

    Returns ``(gc, model_kwargs)`` unchanged where that does not apply: n = 1, greedy (transformers refuses
    n > 1 there), beam search, or a passed cache (its rows are the caller's). ``gc`` and ``model_kwargs`` are not
    modified."""
    n = gc.num_return_sequences or 1
    if n <= 1 or not gc.do_sample or (gc.num_beams or 1) > 1 or passed_cache(model_kwargs) is not None:
        return gc, model_kwargs
    gc = copy.copy(gc)
    gc.num_return_sequences = 1
    model_kwargs = dict(model_kwargs)
    for name in ("input_ids", "attention_mask"):
        value = model_kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            model_kwargs[name] = value.repeat_interleave(n, dim=0)
    return gc, model_kwargs


def output_cache(out):
    """The cache a ``generate`` output carries (``out.cache`` in newer transformers, ``out.past_key_values`` in
    older ones), or None (a tensor output, or no cache)."""
    for name in _CACHE_NAMES[::-1]:
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


def repetition_penalty(gc) -> float | None:
    """The call's repetition penalty (CTRL, Keskar et al. 2019, §4.1), or None when it is off (None or 1.0)."""
    penalty = getattr(gc, "repetition_penalty", None)
    return None if penalty is None or penalty == 1.0 else float(penalty)


def sampling_warpers(gc) -> LogitsProcessorList:
    """transformers' temperature / top-k / top-p warpers of a sampling call, in transformers' order (empty
    for greedy)."""
    warpers = LogitsProcessorList()
    if gc.do_sample:
        if gc.temperature is not None and gc.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(gc.temperature))
        if gc.top_k is not None and gc.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
        if gc.top_p is not None and gc.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
    return warpers
