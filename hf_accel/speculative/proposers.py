"""Draft proposers: prompt lookup (n-gram copy), early exit (a layer prefix of the target) and a draft
model. Each drafts ``k`` tokens per row with static shapes and no host sync (capturable in a CUDA
graph together with the verify pass)."""

from __future__ import annotations

import torch

from hf_accel.kernels.argmax import argmax_rows
from hf_accel.kernels.ngram_lookup import ngram_lookup, ngram_lookup_ref
from hf_accel.speculative.verify import sample


def prompt_lookup(tokens: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, k: int, max_ngram: int = 3,
                  min_ngram: int = 1, use_kernel: bool | None = None, out=None):
    """Draft by copying what followed the first occurrence of the row's last n-gram in the row's
    earlier tokens (Saxena 2023, "Prompt Lookup Decoding", as transformers' ``prompt_lookup_num_tokens``),
    trying ``n = max_ngram .. min_ngram``. The first occurrence is usually in the prompt, the passage an
    input-grounded answer copies from: on SmolLM2 with grounded prompts it gave 2.5-3.8 tokens per verify
    step against 1.9-3.3 for the most recent occurrence (64 tokens, k = 8, CPU, float32).

    Args:
        tokens: [batch, capacity] int64 — prompt + committed output per row (left padding included).
        lengths: [batch] int64 — committed tokens per row (including the padding).
        starts: [batch] int64 — first real token per row (the left-padding count); matches never start
            before it.
        k: tokens to draft (>= 1).
        use_kernel: the one-launch Triton kernel (default: on CUDA) or the PyTorch reference.
        out: optional (drafts [batch, k] int64, valid [batch, k] bool, ngram [batch] int64) contiguous
            buffers: written with the drafts, their valid masks and the length of each row's matched n-gram
            (0: none), and returned.

    Returns:
        (drafts [batch, k] int64, valid [batch, k] bool): ``valid`` is a prefix per row (False where no
        n-gram matched, or where the copied span reaches the end of the committed tokens); with ``out``
        the three buffers.
    """
    kernel = use_kernel if use_kernel is not None else tokens.is_cuda
    if out is None:
        if kernel:  # the engine's own rows: no device read of their lengths in a round
            return ngram_lookup(tokens, lengths, starts, k, max_ngram, min_ngram, check_lengths=False)
        return ngram_lookup_ref(tokens, lengths, starts, k, max_ngram, min_ngram)
    if kernel:
        return ngram_lookup(tokens, lengths, starts, k, max_ngram, min_ngram, out=out, check_lengths=False)
    for buf, value in zip(out, ngram_lookup_ref(tokens, lengths, starts, k, max_ngram, min_ngram, with_ngram=True)):
        buf.copy_(value)
    return out


def _pick(logits: torch.Tensor, warp, do_sample: bool, step=None):
    """Next draft token from draft logits [b, vocab]: argmax (one :func:`argmax_rows` launch on CUDA with the
    step's scratch), or a sample of the warped distribution (returned too, [b, vocab] float32)."""
    if not do_sample:
        if step is not None and logits.is_cuda:
            return argmax_rows(logits, scratch=step.argmax_scratch(logits)), None
        return logits.argmax(dim=-1), None
    probs = torch.softmax(warp(logits), dim=-1)
    return sample(probs), probs


def draft_chain(step, first_ids, first_pos, first_cache_lens, block_table, key_mask, k: int, warp, do_sample: bool,
                next_step=None):
    """``k`` autoregressive draft tokens from a :class:`~hf_accel.engine.decode_step.DecodeStep` (an
    early-exit layer prefix of the target, or a draft model's step).

    Args:
        step: runs the first call over ``first_ids`` [b, t] (t = 1, or 2 for a draft model that re-feeds
            its last committed token too) at ``first_pos`` [b, t] after ``first_cache_lens`` [b] int32.
        next_step: the step for the following single-token calls (default ``step``).
        block_table / key_mask: that model's paged-cache metadata.

    Returns:
        (drafts [b, k] int64, draft_probs [b, k, vocab] float32 or None for greedy).
    """
    next_step = next_step or step
    t = first_ids.shape[1]
    logits = step.forward_tokens(first_ids, first_pos, first_cache_lens, block_table, key_mask, last_only=True)
    tok, prob = _pick(logits, warp, do_sample, step)
    drafts, probs = [tok], [prob]
    pos = first_pos[:, -1:]
    lens = first_cache_lens + t
    for _ in range(1, k):
        pos = pos + 1
        logits = next_step.forward_tokens(tok[:, None], pos, lens, block_table, key_mask, last_only=True)
        lens = lens + 1
        tok, prob = _pick(logits, warp, do_sample, next_step)
        drafts.append(tok)
        probs.append(prob)
    return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if do_sample else None)
