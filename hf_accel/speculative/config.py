"""``SpeculativeConfig``: which proposer drafts tokens for speculative decoding, and how many."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

METHODS = ("prompt_lookup", "early_exit", "draft_model")
MAX_NGRAM = 16  # the lookup kernel unrolls its compares over every n-gram length
_DEFAULT_DRAFT_TOKENS = {"prompt_lookup": 15, "early_exit": 4, "draft_model": 4}
_DEFAULT_NGRAMS = (3, 1)  # (max_ngram, min_ngram): the fields' defaults below


@dataclass
class SpeculativeConfig:
    """Speculative decoding options of :func:`hf_accel.accelerate_model` (``speculative=...``).

    Attributes:
        method: ``"prompt_lookup"`` (drafts copied from what followed the first earlier occurrence of
            the last n-gram in prompt + output; Saxena 2023, "Prompt Lookup Decoding"), ``"early_exit"``
            (self-speculative: the first ``exit_layer`` decoder layers + the model's own final norm and LM
            head draft on the same KV cache; Elhoushi et al. 2024, LayerSkip §4; Zhang et al. 2023,
            "Draft & Verify") or ``"draft_model"`` (a smaller causal LM with the same vocabulary;
            Leviathan et al. 2023; Chen et al. 2023).
        draft_model: the draft for ``"draft_model"``: a transformers causal LM of a type hf-accel
            supports, on the target's device, with the target's ``vocab_size``. It is accelerated too.
        num_draft_tokens: the largest number of tokens drafted per verify step (k), 1 to 32. Default 15 for prompt
            lookup: drafting is free, and verifying 17 tokens of SmolLM2 at bs1 on an H200 took 1.017 ms
            against 0.981 ms for one (``profile_speculative_round-20261201.json``); 15 drafts + 1 make the 16
            token rows of one row block of the fused small-batch matmuls (up to
            :data:`hf_accel.engine.step_switches.FUSED_LINEAR_MAX_ROWS` rows run there). 31 drafts did not
            separate from 15 on the H200 (``bench_speculative-bs1-5pass-k31-20261203-3da9682.json``). 4 for
            the model-based drafts.
        adaptive: choose k per verify step from the measured acceptance and step times (down to 0: plain
            decoding, "backed off", with an occasional probe); with ``False`` k stays ``num_draft_tokens``.
            Sampling stays exact either way, but with ``adaptive`` the k sequence depends on measured
            times, so a fixed seed does not repeat the same samples across calls; with ``False`` it does.
        exit_layer: layers of the early-exit draft (``"early_exit"`` only); default half of the model's
            layers. Models trained with an early-exit loss (LayerSkip) draft well from early layers; a model
            trained without one needs most of its layers (SmolLM2-135M: 0% of drafts accepted at 8 of 30
            layers, ~20% at 27), and then the adaptive draft length backs off to plain decoding.
        max_ngram / min_ngram: n-gram lengths prompt lookup tries, longest first (max_ngram <= 16).
        match_gated: prompt lookup with ``adaptive``: each round's lookup runs at the end of the round
            before, and the next round's k (0: plain decoding) is chosen knowing how long an n-gram each row
            matched, with acceptance tracked per matched length. A round with no match, or only matches
            that rarely hold (on SmolLM2 mostly 1-grams), is a plain step instead of a verify pass over
            drafts that would be rejected. With ``False`` k is chosen from the acceptance of past rounds
            alone, one round ahead of the counters (the host never waits for the GPU). ``None`` (the
            default): match-gated for one-row calls, not for batches, where the H200 measured the
            ungated chooser faster (``docs/speculative.md``).

    Raises:
        ValueError: an unknown method, a missing/extra ``draft_model``, an ``exit_layer`` with another method,
            ``match_gated`` or other n-gram lengths than the defaults with another method than prompt lookup,
            ``match_gated=True`` with ``adaptive=False``, or a count out of range.
    """

    method: str
    draft_model: Any = None
    num_draft_tokens: int | None = None
    adaptive: bool = True
    exit_layer: int | None = None
    max_ngram: int = _DEFAULT_NGRAMS[0]
    min_ngram: int = _DEFAULT_NGRAMS[1]
    match_gated: bool | None = None

    def __post_init__(self):
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {self.adaptive!r}")
        if self.match_gated is not None and not isinstance(self.match_gated, bool):
            raise ValueError(f"match_gated must be True, False or None, got {self.match_gated!r}")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("draft_model is required by method 'draft_model' and only by it")
        if self.num_draft_tokens is None:
            self.num_draft_tokens = _DEFAULT_DRAFT_TOKENS[self.method]
        for name in ("num_draft_tokens", "exit_layer", "max_ngram", "min_ngram"):  # numpy ints as Python ints
            value = getattr(self, name)
            if type(value).__module__ == "numpy" and isinstance(value, numbers.Integral):
                setattr(self, name, int(value))
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) or not (
                1 <= self.num_draft_tokens <= 32):
            raise ValueError(f"num_draft_tokens must be an int in [1, 32], got {self.num_draft_tokens!r}")
        if self.exit_layer is not None and (isinstance(self.exit_layer, bool) or not isinstance(self.exit_layer, int)
                                            or self.exit_layer < 1):
            raise ValueError(f"exit_layer must be a positive int, got {self.exit_layer!r}")
        if self.exit_layer is not None and self.method != "early_exit":
            raise ValueError(f"exit_layer applies to method 'early_exit' only, not {self.method!r}")
        if not (all(isinstance(v, int) and not isinstance(v, bool) for v in (self.min_ngram, self.max_ngram))
                and 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM):
            raise ValueError(f"need ints 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got {self.min_ngram!r}, "
                             f"{self.max_ngram!r}")
        if self.method != "prompt_lookup":  # options another method would ignore: refused, as exit_layer is
            if self.match_gated is not None:
                raise ValueError(f"match_gated applies to method 'prompt_lookup' only, not {self.method!r}")
            if (self.max_ngram, self.min_ngram) != _DEFAULT_NGRAMS:
                raise ValueError(f"max_ngram / min_ngram apply to method 'prompt_lookup' only, not {self.method!r}")
        if self.match_gated and not self.adaptive:
            raise ValueError("match_gated=True needs adaptive=True (the match-gated chooser picks each round's k); "
                             "with adaptive=False every round drafts num_draft_tokens")

    @classmethod
    def from_arg(cls, arg) -> "SpeculativeConfig":
        """``speculative=`` of ``accelerate_model``: a config, a method name, or a draft model. A config is
        copied (and so validated again): fields changed after construction are checked, and changes made
        after ``accelerate_model`` do not reach the accelerated model (``revert_model`` and accelerate it again to
        apply them).

        Raises:
            TypeError: anything else (a peft model as the draft: with a hint to merge it). ValueError: a config whose
                fields were set to invalid values.
        """
        if isinstance(arg, cls):
            return dataclasses.replace(arg)
        if isinstance(arg, str):
            return cls(method=arg)
        from transformers import PreTrainedModel

        if isinstance(arg, PreTrainedModel):
            return cls(method="draft_model", draft_model=arg)
        if _is_peft(arg):
            raise TypeError(f"a peft {type(arg).__qualname__} cannot be the draft model of speculative=: merge its "
                            "adapters into a transformers model first (draft.merge_and_unload()); as "
                            "generate(assistant_model=...) it runs in transformers' assisted loop")
        names = " or ".join(repr(m) for m in METHODS if m != "draft_model")  # that method takes a model
        raise TypeError(f"speculative must be a SpeculativeConfig, {names}, or a draft model (a transformers "
                        f"PreTrainedModel); got {type(arg).__qualname__}")


def _is_peft(obj) -> bool:
    """Whether ``obj`` is a peft model (a PeftModel or tuner wrapper): a draft hf-accel takes only once merged."""
    return type(obj).__module__.startswith("peft.")


_NO_DRAFT_STEP = ("the draft model was accelerated without fast_decode; it has no decode step to draft with "
                  "(revert_model(draft) first, or accelerate it with paged_cache=True, fast_decode=True)")


def head_rows_reason(target, draft) -> str | None:
    """Why the draft's next-token distributions cannot be compared with the target's (None if they can): their LM
    heads give different numbers of logits (rejection sampling compares them token by token)."""
    rows = [getattr(getattr(getattr(m, "lm_head", None), "weight", None), "shape", (None,))[0] for m in (draft, target)]
    if None not in rows and rows[0] != rows[1]:
        return (f"the draft model's LM head gives {rows[0]} logits, the target's {rows[1]}; they must score the same "
                "vocabulary")
    return None


def check_draft(target, draft) -> None:
    """Raise ValueError if ``draft`` cannot draft for ``target``: not a supported transformers causal LM,
    another vocabulary size (it must share the tokenizer), another device, the target itself, accelerated
    without the fast decode step, or unable to run that step (training mode, a dtype the kernels do not
    take, ...: :func:`~hf_accel.engine.eligibility.model_reason`). Changes neither model."""
    from transformers import PreTrainedModel

    from hf_accel.engine.eligibility import model_reason
    from hf_accel.integrations.patch import SUPPORTED_MODEL_TYPES, is_accelerated

    if not isinstance(draft, PreTrainedModel) or not hasattr(draft, "lm_head"):
        hint = " (merge a peft model's adapters into it first: draft.merge_and_unload())" if _is_peft(draft) else ""
        raise ValueError(f"the draft model must be a transformers causal LM, got {type(draft).__qualname__}{hint}")
    if draft is target:
        raise ValueError("the draft model is the target itself; use method 'early_exit' for self-speculation")
    if getattr(draft.config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"draft model_type {getattr(draft.config, 'model_type', None)!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if getattr(draft.config, "vocab_size", None) != target.config.vocab_size:
        raise ValueError(f"the draft model's vocab_size ({getattr(draft.config, 'vocab_size', None)}) differs "
                         f"from the target's ({target.config.vocab_size}); it must share the tokenizer")
    if draft.device != target.device:
        raise ValueError(f"the draft model is on {draft.device}, the target on {target.device}")
    reason = head_rows_reason(target, draft)
    if reason:
        raise ValueError(reason)
    if is_accelerated(draft) and getattr(draft, "_hf_accel_engine", None) is None:
        raise ValueError(_NO_DRAFT_STEP)
    reason = model_reason(draft)
    if reason:
        raise ValueError(f"the draft model cannot run hf-accel's decode step: {reason}")


def check_speculative(model, config: SpeculativeConfig) -> None:
    """Raise ValueError naming what ``accelerate_model(model, speculative=config)`` refuses, without building
    anything (so a caller can check before other work): early exit on a model of fewer than 2 layers or an
    ``exit_layer`` not below its layer count; a draft model :func:`check_draft` refuses."""
    n_layers = model.config.num_hidden_layers
    if config.method == "early_exit":
        if n_layers < 2:
            raise ValueError("early-exit drafting needs a model with at least 2 layers")
        if config.exit_layer is not None and config.exit_layer >= n_layers:
            raise ValueError(f"exit_layer must be < the model's {n_layers} layers, got {config.exit_layer}")
    if config.draft_model is not None:
        check_draft(model, config.draft_model)
