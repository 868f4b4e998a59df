"""A model's speculative engines: one :class:`~hf_accel.speculative.engine.SpeculativeEngine` per (method, draft
model, exit layer), built on the first call that needs it and kept on the model, and the draft models they
accelerated (reverted when the engines close)."""

from __future__ import annotations

import torch

from hf_accel._logging import log_once
from hf_accel.speculative.config import SpeculativeConfig
from hf_accel.speculative.engine import SpeculativeEngine


class EngineCache(dict):
    """A model's :class:`SpeculativeEngine` objects by (method, draft model id, exit layer). A copy of the model
    (``copy.deepcopy``, ``torch.save``) gets an empty cache: the engines hold captured graphs and are keyed by
    the original draft's id; the copy builds its own on its first speculative call.

    ``owned_drafts``: draft models that an engine of this cache accelerated (its own, and those a copy's
    original had, which the copy carries as accelerated copies), so that :meth:`close` reverts them."""

    def __init__(self):
        super().__init__()
        self.owned_drafts: list = []

    def __reduce__(self):
        owned = [d for d in self._owned() if _is_accelerated(d)]
        return (EngineCache, (), {"owned_drafts": owned})

    def _owned(self) -> list:
        drafts = list(self.owned_drafts)
        for engine in self.values():
            draft = engine.config.draft_model
            if engine.owns_draft() and all(d is not draft for d in drafts):
                drafts.append(draft)
        return drafts

    def owns(self, draft) -> bool:
        return any(d is draft for d in self.owned_drafts)

    def release_drafts(self, keep=None) -> None:
        """Revert the owned draft models without an engine here, except ``keep`` (switching draft models)."""
        from hf_accel.integrations.patch import revert_model

        for draft in [d for d in self.owned_drafts if d is not keep]:
            if _is_accelerated(draft):
                revert_model(draft)
        self.owned_drafts = [d for d in self.owned_drafts if d is keep]

    def close(self) -> None:
        """Close every engine and revert every draft model this cache accelerated (and still is)."""
        for engine in list(self.values()):
            engine.close()
        self.clear()
        self.release_drafts()


def _is_accelerated(model) -> bool:
    from hf_accel.integrations.patch import is_accelerated

    return is_accelerated(model)


def engine_for(model, fast, config: SpeculativeConfig) -> SpeculativeEngine:
    """The model's cached :class:`SpeculativeEngine` for this method (and draft model), or a new one.

    A cached draft-model engine whose draft the caller reverted (``revert_model``) since is replaced (logged): the
    new engine accelerates the draft again (and owns it, as on its first use), or, where the caller accelerated it
    again, drafts through the caller's acceleration and leaves it the caller's to revert.

    Raises:
        ValueError: a draft model hf-accel cannot run (for instance one accelerated with ``fast_decode=False``).
    """
    engines = model.__dict__.setdefault("_hf_accel_spec_engines", EngineCache())
    key = (config.method, id(config.draft_model) if config.draft_model is not None else None, config.exit_layer)
    engine = engines.get(key)
    if engine is not None and engine.draft_fast is not None and engine.draft_changed():
        log_once("spec:draft-reverted", "hf-accel: the draft model was reverted (revert_model) since it last drafted; "
                 "it is accelerated again for drafting (where the caller accelerated it again, that acceleration "
                 "is used and stays the caller's)")
        engines.pop(key).close()  # reverts nothing: the engine no longer owns the draft
        engine = None
    if engine is None:
        if config.method == "draft_model":  # keep one draft model referenced (and accelerated) at a time
            for old in [k for k in engines if k[0] == "draft_model"]:
                engines.pop(old).close()
            engines.release_drafts(keep=config.draft_model)
        engine = engines[key] = SpeculativeEngine(fast, config)
        if config.draft_model is not None and engines.owns(config.draft_model):
            engine.draft_accelerated_here = True  # a copy's draft, accelerated by its original's engine
            engines.owned_drafts = [d for d in engines.owned_drafts if d is not config.draft_model]
        log_once(f"spec:{key}", f"hf-accel: speculative decoding with {config.method}"
                 + (f" (exit layer {engine.exit_layer})" if config.method == "early_exit" else ""))
        dtype = next(model.parameters()).dtype
        if dtype in (torch.float16, torch.bfloat16):
            log_once(f"spec-low-precision:{dtype}", f"hf-accel: speculative decoding on a {dtype} model: the verify "
                     "pass scores k + 1 positions in one forward, whose logits round differently from one-token "
                     "steps, so greedy output can differ from plain greedy where two tokens' logits (nearly) tie; "
                     "in float32 it equals plain greedy")
    else:
        engine.config = config
    return engine
