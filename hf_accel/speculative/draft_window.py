"""Draft-model inputs over windows of committed tokens: each round's re-feed of the last two committed tokens, and
the catch-up forward of a draft whose paged cache lagged behind while the engine backed off to plain rounds
(:mod:`hf_accel.speculative.engine`, "A draft model while backed off"). Device work only: gathers from the
round state's token buffer, no host reads.
"""

from __future__ import annotations

import torch

from hf_accel.speculative.state import RoundState


def window_inputs(st: RoundState, width: int, end: torch.Tensor):
    """Draft-model input over the ``width`` committed tokens before index ``end`` [b] of each row: ids [b,
    width] int64, their rotary positions [b, width] int64 and the cache length before them [b] int32.

    The window starts at ``end - width`` clamped at 0; a row with fewer tokens then also feeds tokens at
    and past ``end`` (pad past its length), whose K/V land in slots past the row's length, masked out
    and overwritten before they are read, like rejected drafts. Positions in the left padding are
    clamped at 0 (masked keys). Rows of the batch bucket that hold no sequence have length 1."""
    first = (end - width).clamp(min=0)
    idx = first[:, None] + torch.arange(width, device=end.device)
    pos = (idx - st.starts[:, None]).clamp(min=0)
    return st.tokens.gather(1, idx), pos, first.to(torch.int32)


def refeed_inputs(st: RoundState):
    """The draft model's first input of a round: the last two committed tokens [b, 2], their positions and
    the cache length before them. Its cache then holds every committed token but the newest, whatever
    the last round accepted: a round that drafted accepts n of k drafts and commits n + 1 tokens, and
    its draft steps wrote K/V of all but the last draft, so at least the committed tokens but the two
    newest are in the draft's cache after the round."""
    return window_inputs(st, 2, st.lengths)


def catch_up_width(max_plain_run: int) -> int:
    """Width of :func:`catch_up_inputs`' window: ``max_plain_run + 1``."""
    return max_plain_run + 1


def catch_up_inputs(st: RoundState, width: int):
    """Catch-up input of a draft model whose cache lagged through plain rounds: the ``width`` committed
    tokens before the newest (ids [b, width] int64, positions, cache length before them [b] int32).

    Exact for every row, whatever its own gap: after a round that drafted (or after the prefill), the
    draft's cache holds at least the committed tokens but the two newest (see :func:`refeed_inputs`);
    each of the at most ``R = max_plain_run`` plain rounds since commits at most one token per row, so
    at most the ``R + 2`` newest tokens are missing. The window (``R + 1`` tokens ending at the
    newest-but-one) covers all but the newest, which the next round's re-feed writes. Rewriting K/V of
    tokens already cached, at the same positions, writes the same values."""
    return window_inputs(st, width, st.lengths - 1)
