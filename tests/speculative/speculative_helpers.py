"""Helpers shared by the speculative ``generate`` test modules in this folder (imported as
``from speculative_helpers import ...``; pytest puts this folder on ``sys.path`` for its test modules).

``LAYERS``: the tiny targets' layer count; ``truncated``: a draft model cut from a target; ``spec_arg``: the
``speculative=`` argument for a method name of the parametrized tests; ``repetitive_batch``: left-padded prompts
that prompt lookup finds n-grams in; ``greedy``: a greedy ``generate`` call; ``_messages``: a test's log messages
holding a text.
"""

from __future__ import annotations

import copy

import torch

from hf_accel import SpeculativeConfig


LAYERS = 4


def _messages(caplog, needle):
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def truncated(model, layers: int):
    """A draft model: a copy of ``model`` keeping its first ``layers`` decoder layers."""
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:layers])
    draft.config.num_hidden_layers = layers
    return draft


def spec_arg(method: str, model, **options):
    if method.startswith("draft_model"):
        layers = LAYERS if method == "draft_model-copy" else 1
        return SpeculativeConfig(method="draft_model", draft_model=truncated(model, layers), **options)
    return SpeculativeConfig(method=method, **options)


def repetitive_batch(tiny, lengths=(14, 9, 6), seed=0):
    """Left-padded prompts whose second half repeats the first (prompt lookup finds n-grams)."""
    ids, mask = tiny.batch(seed=seed, lengths=lengths)
    for row, n in enumerate(lengths):
        w = ids.shape[1]
        half = n // 2
        ids[row, w - half:] = ids[row, w - n: w - n + half]
    return ids, mask


def greedy(model, ids, mask, pad, max_new_tokens=20, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad, **kwargs)
