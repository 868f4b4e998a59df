"""Which ``generate`` calls the fast decode path takes: the model's and the call's checks of
:class:`~hf_accel.engine.fast_generate.FastEngine`, and the cache blocks a call reserves.

A call the fast path cannot serve gets a one-line reason (logged by the caller), and runs transformers' own
loop instead: that loop still runs on hf-accel's attention kernels and paged cache.
"""

from __future__ import annotations

import functools
import numbers
import sys

import torch
from torch.nn.modules import module as torch_module

from hf_accel.cache import paged_cache
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.engine.call_options import (
    _HANDLED, _MODEL_KWARGS, _OUTPUT_OPTIONS, _PREPARED_LOOP_KWARGS, PREPARED_LOOP_OPTIONS, call_inputs,
    passed_cache, repetition_penalty,
)
from hf_accel.engine.weight_snapshot import snapshot_intact
from hf_accel.integrations.attention import ATTN_NAME
from hf_accel.kernels.attention import MAX_HEAD_DIM, SUPPORTED_DTYPES

_ROPE_OK = {"default", "linear", "llama3", "yarn"}
# Tokens per row reserved past prompt + max_new_tokens at most (a speculative round's drafts: k_max + 1).
MAX_LOOKAHEAD = 33


def model_reason(model) -> str | None:
    """Why ``model`` cannot take the fast decode path (None if it can): training mode, parameters on several
    devices or offloaded (on the meta device), a forward replaced on the instance or forward hooks on its modules
    (:func:`hooked_modules`), sliding-window layers, a dtype the kernels do not take, head_dim above the kernels'
    limit, or a rope type whose frequencies depend on the sequence length. Reads the model only (no engine
    needed)."""
    cfg = model.config
    if model.training:
        return "the model is in training mode"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return "the model is spread over several devices"
    if any(d.type == "meta" for d in devices):  # accelerate's cpu_offload / disk offload: hooks bring weights in
        return "its weights are offloaded (parameters on the meta device, loaded by accelerate hooks per forward)"
    if "forward" in vars(model):  # the fast path runs the layers itself: a wrapper around forward would be bypassed
        return ("its forward is replaced on the instance (accelerate's mixed precision, a compiled forward, ...), "
                "which the fast path would bypass")
    hooked = hooked_modules(model)
    if hooked:
        more = f" and {len(hooked) - 3} more" if len(hooked) > 3 else ""
        return (f"forward hooks or a replaced forward on {', '.join(hooked[:3])}{more} (the fast path runs the "
                "layers itself and would skip them)")
    head_weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if not isinstance(head_weight, torch.Tensor) or head_weight.dim() != 2:  # the fast path's LM head reads it
        return f"an LM head without a [vocab, hidden] weight ({type(getattr(model, 'lm_head', None)).__name__})"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    dtype = next(model.parameters()).dtype
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (the kernels take {', '.join(str(d) for d in SUPPORTED_DTYPES)})"
    layers = getattr(cfg, "num_hidden_layers", None)
    if layers != len(model.model.layers):  # transformers' early-exit loop changes it for its draft
        return f"config.num_hidden_layers ({layers}) differs from the model's {len(model.model.layers)} layers"
    head_dim = model.model.layers[0].self_attn.head_dim
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in _ROPE_OK:
        return (f"rope_type {rope!r} (the fast path computes the rotary tables of "
                f"{', '.join(sorted(_ROPE_OK))} only)")
    return None


_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def _layer_class_forwards(model) -> tuple:
    """The distinct (class, ``forward``) pairs of the model, its inner model and rotary embedding, the decoder layers,
    their attention (with its q_norm / k_norm), MLP and norms and the final norm, in first-seen order (a patch on a
    class replaces the forward for every instance, a class set on one module only for it; the fast path runs those
    modules' math itself after the prefill). Reads the module dicts directly: it runs on every call."""
    try:
        inner = model.model
        classes = {type(model): None, type(inner): None, type(inner.norm): None}
        rotary = inner._modules.get("rotary_emb")  # its forward computes the cos/sin the fused step keeps as a table
        if rotary is not None:
            classes[type(rotary)] = None
        for layer in inner.layers._modules.values():
            classes[type(layer)] = None
            parts = layer._modules
            for name in _LAYER_PARTS:
                classes[type(parts[name])] = None
            attn_parts = parts["self_attn"]._modules
            for name in ("q_norm", "k_norm"):  # (qwen3)
                if name in attn_parts:
                    classes[type(attn_parts[name])] = None
    except (AttributeError, KeyError, TypeError):
        return ()
    return tuple((cls, getattr(cls, "forward", None)) for cls in classes)


#: Packages whose decorators may wrap a layer class's ``forward`` as transformers defines it (transformers' own
#: deprecation, gradient-checkpointing and output-capturing wrappers, the ``kernels`` hub layer wrapper transformers
#: applies, torch's ``no_grad``): a wrapper from anywhere else is a patch.
_WRAPPER_PACKAGES = frozenset({"transformers", "kernels", "torch"})


def _defined_in(fn) -> str | None:
    """Name of the module whose namespace ``fn`` was defined in (its ``__globals__``, which ``functools.wraps`` does
    not copy, unlike ``__module__``); None for an object without one (a partial, a callable object)."""
    namespace = getattr(fn, "__globals__", None)
    return namespace.get("__name__") if isinstance(namespace, dict) else None


@functools.lru_cache(maxsize=256)
def _own_forward(cls, forward) -> bool:
    """Whether ``forward`` (``cls.forward``) is transformers' own code for ``cls``: following ``__wrapped__``, the
    innermost function was defined in the namespace of a transformers model module (that module's own globals, not a
    copy) as the method of a class ``cls`` inherits from, and every wrapper around it in a package of
    :data:`_WRAPPER_PACKAGES` (transformers wraps the forwards of its ``GradientCheckpointingLayer`` subclasses, the
    caller's subclasses too). False for a patch on the class (a function from elsewhere, another class's forward,
    a wrapper from elsewhere), a subclass outside transformers that overrides ``forward``, and trust_remote_code
    layers (the fast path computes transformers' math and cannot tell whether theirs is the same)."""
    chain, fn = [], forward
    while fn is not None and len(chain) < 16:
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    names = [_defined_in(f) for f in chain]
    if None in names or not names[-1].startswith("transformers."):
        return False
    innermost = chain[-1]
    module = sys.modules.get(names[-1])
    owner = getattr(innermost, "__qualname__", "").rpartition(".")[0]
    if module is None or innermost.__globals__ is not vars(module) or not any(
            c.__qualname__ == owner and c.__module__ == names[-1] for c in cls.__mro__):
        return False
    return all(name.split(".")[0] in _WRAPPER_PACKAGES for name in names[:-1])


def replaced_forwards(model) -> list[str]:
    """Names of the classes among :func:`_layer_class_forwards`' whose ``forward`` is not transformers' own
    (:func:`_own_forward`; an unhashable forward counts as not): the fast path runs those modules' math itself and
    would skip the replacement."""
    changed = set()
    for cls, fn in _layer_class_forwards(model):
        try:
            own = fn is not None and _own_forward(cls, fn)
        except TypeError:  # (an unhashable callable set as forward)
            own = False
        if fn is not None and not own:
            changed.add(cls.__name__)
    return sorted(changed)


def hooked_modules(model) -> list[str]:
    """Names of the modules of ``model`` whose forward the fast path would not run as the user set it up: a forward
    hook or pre-hook other than transformers' own (its output-capturing hooks, which record only while
    ``output_hidden_states`` / ``output_attentions`` asks), a forward replaced on a submodule, or any global forward
    hook (name ``"*"``)."""
    names = ["*"] if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks else []
    for name, module in model.named_modules():
        hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
        if (name and "forward" in module.__dict__) or any(
                not (getattr(h, "__module__", None) or "").startswith("transformers.") for h in hooks):
            names.append(name or "the model")
    return names


class CallChecks:
    """The fast path's checks, as methods of :class:`~hf_accel.engine.fast_generate.FastEngine` (which sets
    ``model``, ``block_size``, ``cache``, ``merged``, ``snapshot`` and defines ``release``)."""

    @property
    def device(self) -> torch.device:
        """The model's device, read off its LM head weight (``PreTrainedModel.device`` walks the modules to find
        a first parameter: microseconds per read, several reads per call)."""
        head = getattr(self.model, "lm_head", None)
        weight = getattr(head, "weight", None)
        return weight.device if isinstance(weight, torch.Tensor) else self.model.device

    @property
    def vocab_size(self) -> int:
        """Rows of the model's input embedding (the token ids a step can take). peft wraps the embedding of a
        model whose LoRA or trainable tokens target it (``lora.Embedding``, ``TrainableTokensWrapper``): the
        wrapped module's rows."""
        embed = self.model.get_input_embeddings()
        while not hasattr(embed, "num_embeddings") and hasattr(embed, "base_layer"):
            embed = embed.base_layer
        if hasattr(embed, "num_embeddings"):
            return embed.num_embeddings
        return embed.weight.shape[0]

    def _model_reason(self) -> str | None:
        """Why the model cannot take the fast path (None if it can). The full check walks every module
        (~1 ms per ``generate`` call on a slow host), so a None answer is kept while a cheap key stays the same:
        training mode, the embedding / LM head / final norm weights (identity, device, dtype), the layer modules,
        whether ``forward`` is replaced on the instance and the number of global forward hooks; and while the
        snapshot of the built steps (:mod:`.weight_snapshot`: every weight, module and forward hook) holds. A
        refusal is checked again at each call (those calls run transformers' loop). A changed weight key or
        snapshot also drops this engine's cache, steps and merged projections (built for the old weights), which
        the next call builds again."""
        m = self.model
        try:
            inner = m.model
            weights = (tuple(id(layer) for layer in inner.layers),
                       *((id(w), w.device, w.dtype) for w in (inner.embed_tokens.weight, m.lm_head.weight,
                                                               inner.norm.weight)))
        except AttributeError:  # not a llama-family layout: no key, the full check answers
            return self._model_reason_uncached()
        if self.snapshot is not None and not snapshot_intact(self.snapshot):
            # a weight, buffer, module or forward hook changed since the steps were built: they (and the merged
            # matrices) would read the old weights or skip the hook
            self.release()
            self._reason_cache = None
        key = (m.training, "forward" in vars(m), getattr(m.config, "num_hidden_layers", None),
               getattr(m.config, "_attn_implementation", None), _layer_class_forwards(m),
               len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks), weights)
        cached = getattr(self, "_reason_cache", None)
        # the key does not cover hooks or forwards replaced on submodules: the snapshot does, so a None answer is
        # reused only while one exists (after a release, e.g. by state_dict(), the full check runs again)
        if cached is not None and cached[0] == key and cached[1] is None and self.snapshot is not None:
            return None
        if cached is not None and cached[0][-1] != weights:
            self.release()
        reason = self._model_reason_uncached()
        self._reason_cache = (key, reason)
        return reason

    def _model_reason_uncached(self) -> str | None:
        m = self.model
        attn = getattr(m.config, "_attn_implementation", None)
        if attn != ATTN_NAME:  # set_attn_implementation(...) after accelerate_model: the fast path runs hf-accel's
            return f"the attention implementation is {attn!r} (set after accelerate_model), not hf-accel's"
        changed = replaced_forwards(m)
        if changed:  # a class-level patch of a layer's forward (or a subclass's own), which the fast path would not run
            return (f"the forward of {', '.join(changed)} is not transformers' own (replaced on the class, or "
                    "overridden by a subclass; the fast path runs the layers itself and would skip it)")
        return model_reason(m)

    def check(self, gc, model_kwargs, prepared_loop: bool = False) -> str | None:
        """Reason why this call can't take the fast path, or None.

        ``prepared_loop``: whether it can take the fast path inside transformers' own ``generate``, with the logits
        processors, stopping criteria and outputs transformers prepares
        (:meth:`~hf_accel.engine.fast_generate.FastEngine.decode_prepared`): also the options
        of :data:`PREPARED_LOOP_OPTIONS`, custom ``logits_processor`` / ``stopping_criteria`` lists,
        ``prefix_allowed_tokens_fn``, and a repetition penalty over a padded batch."""
        reason = self._model_reason()
        if reason:
            return reason
        extra = set(model_kwargs) - _MODEL_KWARGS - (_PREPARED_LOOP_KWARGS if prepared_loop else set())
        extra = {k for k in extra if model_kwargs[k] is not None}
        if extra:
            return f"unsupported generate arguments: {', '.join(sorted(extra))}"
        defaults = type(gc)._get_default_generation_params() if hasattr(type(gc), "_get_default_generation_params") else {}
        # the attributes themselves: GenerationConfig.to_dict deep-copies them on every call
        for key, value in vars(gc).items():
            if key in _HANDLED or key.startswith("_") or (prepared_loop and key in PREPARED_LOOP_OPTIONS):
                continue
            if key in ("output_scores", "output_logits") and not getattr(gc, "return_dict_in_generate", False):
                continue  # transformers returns them only with return_dict_in_generate
            if key == "max_matching_ngram_size" and getattr(gc, "prompt_lookup_num_tokens", None) is None:
                continue  # transformers reads it only for prompt lookup
            default = defaults.get(key, None)
            if value not in (default, None) and value != {}:
                return f"generation option {key}={value!r}"
        for name in ("max_new_tokens", "max_length"):
            value = getattr(gc, name, None)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                return f"{name}={value!r} is not an int (transformers' loop runs it as it does)"
        penalty = getattr(gc, "repetition_penalty", None)
        if penalty is not None and penalty != 1.0 and not isinstance(penalty, float):
            return f"repetition_penalty={penalty!r} is not a float (transformers refuses it)"
        if (gc.num_beams or 1) > 1:
            return "beam search"
        if (gc.num_return_sequences or 1) > 1:  # sampling calls arrive expanded (expand_return_sequences)
            return ("num_return_sequences > 1 with a passed cache" if gc.do_sample
                    else "num_return_sequences > 1 without sampling (transformers refuses it)")
        if gc.cache_implementation is not None:
            return f"cache_implementation={gc.cache_implementation!r}"
        if gc.use_cache is False:
            return "use_cache=False"
        ids = model_kwargs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[1] == 0:
            return "no non-empty 2-D input_ids"
        if model_kwargs.get("synced_gpus"):
            return "synced_gpus (every rank steps until all ranks have finished)"
        try:  # once per call: without a mask it reads the prompt (a device sync on a GPU)
            call_mask, _, pad = call_inputs(gc, model_kwargs, ids)
        except (TypeError, ValueError, RuntimeError):
            call_mask = pad = None  # ids that are not ints: refused below
        # without a mask transformers infers one from the pad id: it may end in 0 (a prompt ending in the pad id)
        mask = model_kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.shape != ids.shape:
            return (f"attention_mask of shape {tuple(mask.shape)} does not match input_ids' {tuple(ids.shape)} "
                    "(transformers' loop runs it as it does)")
        if mask is None:
            mask = call_mask
        if mask is not None and mask.dim() == 2 and mask.shape == ids.shape and not bool(mask[:, -1].all()):
            # transformers warns about it in its own loop; the fast path assumes left padding
            if not bool(mask.any(dim=1).all()):
                return "a row of the batch is all padding (its attention_mask is all zeros)"
            return "right-padded batch (decoder-only models need padding_side='left')"
        if self._max_new(gc, ids.shape[1]) <= 0:
            return "the prompt is not shorter than max_length"  # transformers raises its own error
        if pad is None:  # transformers' loop raises its own error
            return (f"eos_token_id={gc.eos_token_id!r} / pad_token_id={gc.pad_token_id!r} are not token ids "
                    "(ints or int tensors)")
        vocab = self.vocab_size
        if ids.shape[0] > 1 and not 0 <= pad < vocab:  # a one-row call feeds 0 instead (call_inputs)
            return (f"pad_token_id {pad} is outside the vocabulary of {vocab} tokens (a finished row of a batch is "
                    "fed it; transformers' loop raises where that happens)")
        if (not prepared_loop and repetition_penalty(gc) is not None
                and not bool(call_mask.bool().all())):
            # transformers 5.x versions differ on whether left padding counts as seen tokens (pad = EOS often)
            return "repetition_penalty with a padded batch"
        if getattr(gc, "return_dict_in_generate", False):
            asked = [name for name in _OUTPUT_OPTIONS if getattr(gc, name, False)
                     and not (prepared_loop and name in PREPARED_LOOP_OPTIONS)]
            if asked:
                return f"return_dict_in_generate with {', '.join(asked)}"
        reason = self._passed_cache_reason(passed_cache(model_kwargs), gc, ids)
        if reason:
            return reason
        sw = getattr(self.model.config, "sliding_window", None)
        layer_types = getattr(self.model.config, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            sw = None  # (qwen2/qwen3: a window no layer uses, as with use_sliding_window=False or max_window_layers)
        if sw is not None and ids.shape[1] + self._max_new(gc, ids.shape[1]) > sw:
            if self.model.config.model_type == "llama":
                return (f"the sequence would exceed the config's sliding_window ({sw}), which llama's attention "
                        "ignores; transformers' loop runs with a cache that keeps every token's K/V, so the tokens "
                        "equal stock's use_cache=False output, not stock's cached output (its cache drops K/V "
                        "older than the window under a full causal mask; README, Known limitations)")
            return f"the sequence would exceed the sliding window ({sw})"
        need = self.blocks_needed(gc, ids)
        if need > self._pool_blocks():
            fit = self._blocks_that_fit()
            if fit is not None and need > fit:  # the fast path reserves the whole answer up front
                gib = need * self._block_bytes() / 2**30
                return (f"the KV cache of prompt + max_new_tokens ({need} blocks with the fast path's "
                        f"{MAX_LOOKAHEAD}-token lookahead and scratch block, {gib:.1f} GiB) does not fit in free "
                        f"device memory ({fit} blocks)")
        return None

    def _passed_cache_reason(self, prefix, gc, ids: torch.Tensor) -> str | None:
        """Why the fast path cannot continue from the cache a call passed (None: it can, or none was passed); raises
        ValueError for a PagedCache holding another number of sequences than the batch has rows (no path can run it).
        It takes a :class:`PagedCache` holding the same number of tokens in every row (a previous turn's, as
        ``generate(..., return_dict_in_generate=True)`` returns it, or an empty one) whose pools match the model,
        fewer tokens than ``input_ids`` has, and room (or ``growable``) for this call's answer."""
        if prefix is None:
            return None
        if not isinstance(prefix, PagedCache):
            return f"the caller passed its own cache ({type(prefix).__name__})"
        m, batch, prompt_len = prefix.manager, ids.shape[0], ids.shape[1]
        layers = prefix.layers
        lengths = {layer.length for layer in layers}
        if len(lengths) != 1:
            return "the passed PagedCache holds a partial step"
        cached = lengths.pop()
        if m is None and prefix._num_blocks is None:
            return "an empty PagedCache sized by memory_fraction (its pools are sized at its first update)"
        if m is None or not prefix.seq_ids:
            if cached:
                return "the passed PagedCache is out of sync"
        else:
            if len(prefix.seq_ids) != batch:  # transformers' loop would raise this at its first forward
                raise ValueError(f"PagedCache holds {len(prefix.seq_ids)} sequences but the batch has {batch} rows "
                                 f"(pass the cache a call of {batch} rows returned, or a new PagedCache)")
            if any(m.length(s) != cached for s in prefix.seq_ids):
                return "the passed PagedCache's rows hold different numbers of tokens"
        if cached >= prompt_len:
            return f"the passed cache holds {cached} tokens, not fewer than the {prompt_len} input tokens"
        config = self.model.config
        if len(layers) != config.num_hidden_layers:
            return f"the passed PagedCache has {len(layers)} layers, the model {config.num_hidden_layers}"
        want = (config.num_key_value_heads, self.model.model.layers[0].self_attn.head_dim)
        dtype = next(self.model.parameters()).dtype
        for layer in layers:
            if layer.is_initialized and (tuple(layer.keys.shape[2:]) != want or layer.keys.dtype != dtype
                                         or layer.keys.device != self.device):
                return (f"the passed PagedCache's pools ({tuple(layer.keys.shape[2:])}, {layer.keys.dtype}, "
                        f"{layer.keys.device}) do not match the model's K/V ({want}, {dtype}, {self.device})")
        if m is None:  # its pools are made at the end, for the answer's K/V: a size they cannot have raises now
            prefix.check_pools_fit(*want, dtype, self.device)
        if not prefix.growable:  # the answer's K/V are written into it at the end: check the room now
            keep = prompt_len + self._max_new(gc, prompt_len) - 1
            if not prefix.seq_ids:
                need = batch * -(-keep // prefix.block_size)
                free = prefix._num_blocks if m is None else m.num_free_blocks
            else:
                need = m.blocks_needed_together(prefix.seq_ids, keep - cached)
                free = m.num_free_blocks
            if need > free:
                return (f"the passed PagedCache (not growable) has {free} free blocks and prompt + max_new_tokens "
                        f"need {need} more (an answer that outgrows them before it ends raises OutOfBlocksError)")
        return None

    def blocks_needed(self, gc, input_ids: torch.Tensor) -> int:
        """Cache blocks a call reserves at most: every row's prompt + max new tokens + the largest lookahead of
        a speculative call, plus the scratch block."""
        batch, prompt_len = input_ids.shape
        return batch * -(-(prompt_len + self._max_new(gc, prompt_len) + MAX_LOOKAHEAD) // self.block_size) + 1

    def _block_bytes(self) -> int:
        return paged_cache.kv_block_bytes(self.model.config, self.block_size, next(self.model.parameters()).dtype,
                                          num_layers=len(self.model.model.layers))

    def _pool_blocks(self) -> int:
        return self.cache.manager.num_blocks if self.cache is not None and self.cache.manager is not None else 0

    def _blocks_that_fit(self) -> int | None:
        """Blocks a new pool may have: this engine's pool (freed before a new one is made) plus what fits in
        free device memory (None where free memory cannot be read: not checked)."""
        fit = paged_cache.blocks_that_fit(self.device, self._block_bytes())
        return None if fit is None else fit + self._pool_blocks()

    @staticmethod
    def _max_new(gc, prompt_len: int) -> int:
        if gc.max_new_tokens is not None:
            return gc.max_new_tokens
        return max((gc.max_length or 20) - prompt_len, 0)
