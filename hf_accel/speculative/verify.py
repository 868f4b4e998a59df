"""Verification of drafted tokens: greedy acceptance and lossless rejection sampling.

Both take the target's scores at the ``k + 1`` positions of one verify pass (the last committed token,
then the ``k`` drafts) and return the tokens to commit: ``out[:, :n]`` are the accepted drafts and
``out[:, n]`` the target's own token at the first rejected position (or the bonus token after ``k``
accepted drafts), so every verify step commits ``n + 1 >= 1`` tokens per row.

Everything is batched per row with static shapes and no host sync, so a verify step can be captured in
a CUDA graph.
"""

from __future__ import annotations

import torch


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` [..., vocab] float32 (rows sum to 1, non-negative): int64 [...].

    Exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` (equivalent to inverse-CDF sampling; no sort, no
    host sync, capturable in a CUDA graph)."""
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1)


def greedy_accept(draft_tokens: torch.Tensor, draft_valid: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification (speculative greedy decoding; Leviathan et al. 2023, §2.3 with argmax).

    Args:
        draft_tokens: [batch, k] int64 — drafted tokens.
        draft_valid: [batch, k] bool — False where a row has no draft (a row's valid drafts are a prefix).
        target_logits: [batch, k + 1, vocab] — the target's scores at the last committed token and at
            each draft.

    Returns:
        (out [batch, k + 1] int64, num_accepted [batch] int64): ``out`` is the target's argmax at every
        position; the first ``num_accepted`` drafts equal it, so committing ``out[:, :num_accepted + 1]``
        gives exactly the target's greedy continuation.

    Raises:
        RuntimeError (PyTorch's) for shapes that do not match as above; values are not checked (an internal
        step of the speculative engine, which builds its inputs).
    """
    k = draft_tokens.shape[1]
    out = target_logits.argmax(dim=-1)
    ok = (draft_tokens == out[:, :k]) & draft_valid
    return out, ok.long().cumprod(dim=1).sum(dim=1)


def rejection_sample(draft_tokens: torch.Tensor, draft_valid: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor):
    """Speculative sampling that keeps the target's distribution (Leviathan et al. 2023, Algorithm 1;
    Chen et al. 2023, Algorithm 2).

    Draft ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection
    the token is drawn from ``normalise(max(p_j - q_j, 0))``; after ``k`` acceptances a bonus token is
    drawn from ``p_k``. A position without a valid draft draws from ``p_j`` itself.

    Args:
        draft_tokens: [batch, k] int64.
        draft_valid: [batch, k] bool (a prefix per row).
        draft_probs: [batch, k, vocab] float32 — the draft's (warped) distributions the drafts were
            sampled from, or None for a deterministic proposer (prompt lookup: ``q_j`` is a point mass
            on ``d_j``, so ``d_j`` is accepted with probability ``p_j(d_j)`` and the residual is ``p_j``
            without ``d_j``).
        target_probs: [batch, k + 1, vocab] float32 — the target's warped distributions.

    Returns:
        (out [batch, k + 1] int64, num_accepted [batch] int64) as in :func:`greedy_accept`.

    Raises:
        RuntimeError (PyTorch's) for shapes that do not match as above; the distributions are not checked
        (rows must be non-negative and sum to 1, as the engine's softmax outputs do).
    """
    b, k = draft_tokens.shape
    if k == 0:  # nothing drafted: plain sampling from p_0
        return sample(target_probs), torch.zeros(b, dtype=torch.long, device=target_probs.device)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        q = torch.zeros_like(target_probs[:, :k]).scatter_(-1, draft_tokens[..., None], 1.0)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
        q = draft_probs
    u = torch.rand_like(p_draft)
    accept = (u * q_draft < p_draft) & draft_valid
    n = accept.long().cumprod(dim=1).sum(dim=1)
    q = q * draft_valid[..., None]  # no draft at a position: its residual is p itself
    residual = torch.cat([(target_probs[:, :k] - q).clamp_(min=0), target_probs[:, k:]], dim=1)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual, but then the draft is never rejected; guard the division anyway
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), target_probs)
    resampled = sample(residual)
    pos = torch.arange(k + 1, device=draft_tokens.device)
    drafts = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
    out = torch.where(pos < n[:, None], drafts, resampled)
    return out, n
