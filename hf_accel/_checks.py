"""Argument checks shared by the public functions: an int in a range, token ids in a model's vocabulary.

Each raises ValueError naming the argument and what it got, before anything runs.
"""

from __future__ import annotations

import numbers

import torch


def check_int(value, name: str, *, minimum: int | None = None, maximum: int | None = None,
              maximum_reason: str = "") -> int:
    """``value`` as an int, checked: an integral number (not a bool) within ``[minimum, maximum]`` (either bound
    optional). ``maximum_reason`` is appended to the message of a value above ``maximum`` (" (the model's
    positions)", say).

    Raises:
        ValueError: not an integral number, or outside the bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int; got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum}{maximum_reason}; got {value}")
    return value


def check_token_ids(ids, model, name: str) -> torch.Tensor:
    """``ids`` checked as token ids for ``model``: an integer tensor whose values lie in ``[0, vocabulary)``, the
    vocabulary being the rows of ``model.get_input_embeddings()`` (not checked where the model has none).
    Returns ``ids`` unchanged.

    Raises:
        ValueError: not a torch tensor, not of an integer dtype, or an id outside the vocabulary."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor of token ids; got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids; got a {ids.dtype} tensor")
    embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    vocab = getattr(embeddings, "num_embeddings", None)
    if isinstance(vocab, int) and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name} must lie in [0, {vocab}) (the model's vocabulary); got {int(ids.min())} .. "
                         f"{int(ids.max())}")
    return ids


def model_positions(model) -> int | None:
    """``model.config.max_position_embeddings`` where it is an int (the positions the model was trained on), else
    None."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and not isinstance(positions, bool) else None
