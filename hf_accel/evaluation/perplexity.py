"""Perplexity of a causal LM over a fixed token sequence with fixed windows.

Windows of ``context_length`` tokens start every ``stride`` tokens (the method of the transformers
"Perplexity of fixed-length models" guide). A token is scored at most once, in the first window where
it is not the window's first token (so it has context), and only if no earlier window scored it.
With ``stride < context_length`` that is every token but the sequence's first; with ``stride ==
context_length`` the windows do not overlap and each scores its last ``context_length - 1`` tokens.
``perplexity = exp(sum of token negative log-likelihoods / tokens scored)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from hf_accel._checks import check_int, check_token_ids, model_positions


@dataclass
class PerplexityResult:
    """Perplexity and what it was computed over."""

    perplexity: float  # exp(nll_per_token)
    nll_per_token: float  # mean negative log-likelihood, nats / token
    tokens_scored: int
    windows: int
    context_length: int
    stride: int

    def as_dict(self) -> dict:
        return asdict(self)


def _windows(n: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) per window."""
    out, prev_end, begin = [], 0, 0
    while prev_end < n:
        end = min(begin + context_length, n)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        begin += stride
    return out


@torch.inference_mode()
def perplexity(
    model,
    input_ids: torch.Tensor,
    context_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``input_ids`` with fixed windows (see the module docstring).

    Args:
        model: a transformers causal LM (its eval-mode forward is used; training mode is restored).
        input_ids: [n] or [1, n], int64, token ids, n >= 2.
        context_length: tokens per window, at most the model's ``max_position_embeddings`` (default: 512, or
            ``max_position_embeddings`` where that is smaller).
        stride: start-to-start distance of windows, 1 <= stride <= context_length (default:
            context_length, i.e. non-overlapping windows).
        batch_size: windows of equal length per forward pass.
        progress: show a tqdm bar.

    Returns:
        :class:`PerplexityResult`; ``perplexity`` is ``inf`` where ``exp(nll_per_token)`` exceeds a float's range.

    Raises:
        ValueError: ``input_ids`` not an int64 tensor, an id outside the model's vocabulary, fewer than 2 tokens, a
            batch dimension other than 1, a length/stride/batch_size that is not an int or out of range, or a
            ``context_length`` above the model's ``max_position_embeddings``.
    """
    from tqdm.auto import tqdm

    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.int64:
        got = f"{input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an int64 tensor of token ids; got {got}")
    for name, value in (("context_length", context_length), ("stride", stride), ("batch_size", batch_size)):
        if value is not None:
            check_int(value, name)
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [n] or [1, n]; got shape {tuple(input_ids.shape)}")
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.numel() < 2:
        raise ValueError(f"need at least 2 token ids in a [n] or [1, n] tensor; got shape {tuple(input_ids.shape)}")
    check_token_ids(input_ids, model, "input_ids")
    max_pos = model_positions(model)
    if context_length is None:
        context_length = min(512, max_pos) if max_pos else 512
    stride = context_length if stride is None else stride
    if context_length < 2 or not 1 <= stride <= context_length:
        raise ValueError(f"need context_length >= 2 and 1 <= stride <= context_length; got {context_length}, {stride}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    if max_pos and context_length > max_pos:  # windows past the trained positions
        raise ValueError(f"context_length={context_length} is more than the model's {max_pos} positions "
                         "(max_position_embeddings)")
    device = next(model.parameters()).device
    windows = _windows(input_ids.numel(), context_length, stride)
    batches: list[list[tuple[int, int, int]]] = []
    for w in windows:
        if batches and len(batches[-1]) < batch_size and batches[-1][0][1] - batches[-1][0][0] == w[1] - w[0]:
            batches[-1].append(w)
        else:
            batches.append([w])
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in tqdm(batches, desc="perplexity", disable=not progress, leave=False):
            ids = torch.stack([input_ids[b:e] for b, e, _ in batch]).to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            for row, (b, e, first) in enumerate(batch):
                lp = torch.log_softmax(logits[row, first - b - 1 : e - b - 1], dim=-1)
                target = ids[row, first - b : e - b]
                total -= float(lp.gather(1, target[:, None]).sum())
                count += e - first
    finally:
        model.train(was_training)
    nll = total / count
    try:
        ppl = math.exp(nll)
    except OverflowError:  # a mean NLL above ~709.8 nats: beyond a float
        ppl = math.inf
    return PerplexityResult(ppl, nll, count, len(windows), context_length, stride)
