"""Calibration statistics for the training-free pooling methods, and the similarity grouping.

One forward pass over a short calibration text records, for every layer, the second moment of the
attention input ``x`` (the hidden state after the layer's input norm, with a constant 1 appended so
that biases are covered): ``C = E[x x^T]``. Every statistic the methods need follows from ``C`` and the
weights alone, because K, V and Q are linear in ``x``: ``E[k_a k_b^T] = W_a C W_b^T``.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from hf_accel.conversion.heads import attention_modules, compute_dtype

MAX_EXHAUSTIVE_PARTITIONS = 50_000


def calibration_windows(input_ids: torch.Tensor, context_length: int, max_tokens: int) -> torch.Tensor:
    """Cut token ids into full, non-overlapping windows.

    Args:
        input_ids: [n] or [1, n], int64, token ids of the calibration text.
        context_length: tokens per window.
        max_tokens: use at most this many tokens (a multiple of ``context_length`` is used).

    Returns:
        [windows, context_length] int64.

    Raises:
        ValueError: fewer than ``context_length`` tokens, a non-positive length, or ids of another shape than
            [n] / [1, n] (several rows would be read as one text, windows running across their boundaries).
    """
    if context_length < 1 or max_tokens < 1:
        raise ValueError(f"context_length and max_tokens must be >= 1; got {context_length}, {max_tokens}")
    if not (input_ids.dim() == 1 or (input_ids.dim() == 2 and input_ids.shape[0] == 1)):
        raise ValueError(f"calibration token ids must be one text, [n] or [1, n]; got shape {tuple(input_ids.shape)} "
                         "(join the texts into one, or pass one)")
    ids = input_ids.reshape(-1)
    windows = min(ids.numel(), max_tokens) // context_length
    if windows == 0:
        raise ValueError(
            f"calibration text has {ids.numel()} tokens; need at least context_length={context_length}"
        )
    return ids[: windows * context_length].view(windows, context_length)


@torch.no_grad()
def collect_input_moments(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = False) -> list[torch.Tensor]:
    """Second moment of each attention layer's input, augmented with a constant 1 for the bias.

    Args:
        model: a supported transformers causal LM (its eval-mode forward is run).
        windows: [windows, seq] int64 token ids (see :func:`calibration_windows`).
        batch_size: windows per forward pass.
        progress: show a tqdm bar.

    Returns:
        One [hidden + 1, hidden + 1] tensor per layer (float32, or float64 for a float64 model), on
        the model's device: ``E[x~ x~^T]`` over all calibration tokens, ``x~ = [x; 1]``.
    """
    from tqdm.auto import tqdm

    modules = attention_modules(model)
    device = modules[0].k_proj.weight.device
    dtype = compute_dtype(modules[0].k_proj.weight.dtype)
    hidden = modules[0].k_proj.in_features
    sums = [torch.zeros(hidden + 1, hidden + 1, dtype=dtype, device=device) for _ in modules]
    count = [0]

    def make_hook(i):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, hidden).to(dtype)
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
            sums[i].addmm_(x.T, x)
            if i == 0:
                count[0] += x.shape[0]
        return hook

    handles = [m.k_proj.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(modules)]
    was_training = model.training
    model.eval()
    try:
        starts = range(0, windows.shape[0], batch_size)
        for s in tqdm(starts, desc="calibration", disable=not progress, leave=False):
            model(input_ids=windows[s : s + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return [s / count[0] for s in sums]


def _augmented(linear: nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """[out, in + 1]: the weight with the bias (or zeros) as the last column."""
    w = linear.weight.detach().to(dtype)
    b = linear.bias.detach().to(dtype) if linear.bias is not None else torch.zeros_like(w[:, 0])
    return torch.cat([w, b[:, None]], dim=1)


def head_moments(linear: nn.Linear, num_heads: int, moment: torch.Tensor) -> torch.Tensor:
    """``E[y_h y_g^T]`` for the heads of a projection ``y = W x + b``.

    Args:
        linear: a q/k/v projection with ``num_heads`` heads of width ``d``.
        num_heads: heads in its output.
        moment: [in + 1, in + 1], from :func:`collect_input_moments`.

    Returns:
        [num_heads, num_heads, d, d], float, the per-head-pair second moments of the output.
    """
    w = _augmented(linear, moment.dtype).to(moment.device)
    m = w @ moment @ w.T
    d = m.shape[0] // num_heads
    return m.view(num_heads, d, num_heads, d).permute(0, 2, 1, 3)


def head_distances(module: nn.Module, num_kv_heads: int, moment: torch.Tensor) -> torch.Tensor:
    """Dissimilarity of the KV heads of one layer on the calibration data.

    ``D[a, b] = E||k_a - k_b||^2 / mean_h E||k_h||^2 + (the same for v)``: the squared distance of the
    two heads' activations, K and V each normalised by their average head energy so both count alike.

    Returns:
        [num_kv_heads, num_kv_heads], float, symmetric, zero diagonal.
    """
    total = None
    for name in ("k_proj", "v_proj"):
        m = head_moments(getattr(module, name), num_kv_heads, moment)
        gram = torch.einsum("abii->ab", m)
        diag = gram.diagonal()
        dist = diag[:, None] + diag[None, :] - 2 * gram
        dist = dist.clamp_min(0) / diag.mean().clamp_min(torch.finfo(dist.dtype).tiny)
        total = dist if total is None else total + dist
    total.fill_diagonal_(0)
    return total


def partition_cost(dist: torch.Tensor, groups: list[list[int]]) -> float:
    """Sum over groups of ``sum_{a<b in g} D[a, b] / |g|``: with ``D`` a squared distance this is the
    total squared distance of the heads to their group mean (the error mean pooling makes)."""
    total = 0.0
    for g in groups:
        idx = torch.tensor(g)
        total += float(dist[idx][:, idx].sum()) / (2 * len(g))
    return total


def _count_partitions(n: int, size: int) -> int:
    groups = n // size
    return math.factorial(n) // (math.factorial(size) ** groups * math.factorial(groups))


def _all_partitions(items: list[int], size: int):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for mates in itertools.combinations(rest, size - 1):
        remaining = [x for x in rest if x not in mates]
        for tail in _all_partitions(remaining, size):
            yield [[first, *mates], *tail]


def _local_search(dist: torch.Tensor, groups: list[list[int]], max_rounds: int = 1000) -> list[list[int]]:
    """Best-improvement swaps of two heads between groups until no swap lowers the cost."""
    d = dist.double().cpu()
    groups = [list(g) for g in groups]
    for _ in range(max_rounds):
        best, best_move = -1e-12, None
        for gi, gj in itertools.combinations(range(len(groups)), 2):
            for ai, a in enumerate(groups[gi]):
                for bj, b in enumerate(groups[gj]):
                    rest_i = [x for x in groups[gi] if x != a]
                    rest_j = [x for x in groups[gj] if x != b]
                    # change in sum of in-group distances (all groups have the same size)
                    delta = (d[a, rest_i].sum() + d[b, rest_j].sum() - d[b, rest_i].sum() - d[a, rest_j].sum())
                    if delta > best:
                        best, best_move = float(delta), (gi, ai, gj, bj)
        if best_move is None:
            break
        gi, ai, gj, bj = best_move
        groups[gi][ai], groups[gj][bj] = groups[gj][bj], groups[gi][ai]
    return groups


def balanced_groups(dist: torch.Tensor, num_groups: int) -> list[list[int]]:
    """Split ``n`` heads into ``num_groups`` equal groups with a small :func:`partition_cost`.

    Exhaustive search when there are at most :data:`MAX_EXHAUSTIVE_PARTITIONS` partitions (so 9 heads
    into 3 groups is solved exactly); otherwise swap-based local search started from the adjacent
    grouping and from a greedy nearest-neighbour grouping, keeping the cheaper result. Ties keep the
    adjacent grouping, so heads that are already well grouped are not moved.

    Args:
        dist: [n, n], float, symmetric head dissimilarities (e.g. :func:`head_distances`).
        num_groups: a divisor of n.

    Returns:
        Groups as sorted lists of head indices, ordered by their smallest member.
    """
    n = dist.shape[0]
    size = n // num_groups
    adjacent = [list(range(g * size, (g + 1) * size)) for g in range(num_groups)]
    if size == 1 or num_groups == 1:
        return adjacent
    candidates = [adjacent]
    if _count_partitions(n, size) <= MAX_EXHAUSTIVE_PARTITIONS:
        candidates.extend(_all_partitions(list(range(n)), size))
    else:
        d = dist.double().cpu()
        left, greedy = list(range(n)), []
        while left:
            seed = left[0]
            mates = sorted(left[1:], key=lambda x: float(d[seed, x]))[: size - 1]
            greedy.append([seed, *mates])
            left = [x for x in left if x != seed and x not in mates]
        candidates = [_local_search(dist, adjacent), _local_search(dist, greedy)]
    best = min(candidates, key=lambda g: partition_cost(dist, g) - (1e-9 if g is adjacent else 0.0))
    return sorted((sorted(g) for g in best), key=lambda g: g[0])
