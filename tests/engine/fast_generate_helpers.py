"""Helpers shared by the fast-decode-path ``generate`` test modules in this folder (imported as
``from fast_generate_helpers import ...``; pytest puts this folder on ``sys.path`` for its test modules).

``_generate``: a ``generate`` call (greedy unless told); ``_accelerated``: an accelerated copy of a model, its
engine on the fused Triton step if asked; ``_messages``: hf-accel's log messages holding a text (``FAST_MSG``: the
one the fast path logs); ``finish_steps`` / ``pick_eos``: the step at which each row emits an EOS id, and EOS ids
taken from stock's own output that end rows at chosen steps; ``CASES`` / ``_case``: the greedy cases (EOS rows and
steps, length options) and their model, batch, options and stock output; ``MODEL_TYPES``: the tiny model types.
"""

from __future__ import annotations

import copy

import torch

from hf_accel import accelerate_model


FAST_MSG = "generate runs the fast decode path"
MODEL_TYPES = ["llama", "qwen2", "mistral", "qwen3"]


def _messages(caplog, needle):
    return [r.getMessage() for r in caplog.records if r.name == "hf_accel" and needle in r.getMessage()]


def _generate(model, ids, mask, pad, **kwargs):
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **kwargs)


def _accelerated(model, fused=False):
    ours = accelerate_model(copy.deepcopy(model))
    if fused:
        ours._hf_accel_engine.fused = True
    return ours


def finish_steps(generated: torch.Tensor, eos: list[int]) -> list[int | None]:
    """Per row: the step at which greedy decoding emits one of ``eos`` first (None: never)."""
    steps = []
    for row in generated.tolist():
        hits = [t for t, token in enumerate(row) if token in eos]
        steps.append(hits[0] if hits else None)
    return steps


def pick_eos(generated: torch.Tensor, at: dict[int, int]) -> list[int]:
    """EOS ids, taken from stock's own output ``generated`` (no EOS, [batch, steps]), that end row ``r``
    at step ``at[r]`` (or the nearest later step where no earlier-chosen id interferes)."""
    eos: list[int] = []
    wanted: dict[int, int] = {}
    for row, first in at.items():
        for t in range(first, generated.shape[1]):
            candidate = eos + [int(generated[row, t])]
            steps = finish_steps(generated, candidate)
            if steps[row] == t and all(steps[r] == s for r, s in wanted.items()):
                eos, wanted[row] = candidate, t
                break
        else:
            raise AssertionError(f"no EOS id ends row {row}")
    return eos


# name -> (EOS rows/steps, generate options; WIDTH is replaced by the padded prompt width)
CASES = {
    # row 0 ends at step 2, the other rows run to the end: finished rows are padded
    "max_new_tokens": ({0: 2}, dict(max_new_tokens=12)),
    # every row ends, at steps 2 / 5 / 8 or so: the call stops before max_new_tokens (surplus steps trimmed)
    "all_rows_finish": ({0: 2, 1: 5, 2: 8}, dict(max_new_tokens=20)),
    "max_length": ({0: 2}, dict(max_length="WIDTH+9")),
    # the EOS id of step 2 is suppressed until 6 new tokens: transformers' processor on the host
    "min_new_tokens": ({0: 2}, dict(max_new_tokens=12, min_new_tokens=6)),
    "min_length": ({0: 2}, dict(max_new_tokens=12, min_length="WIDTH+6")),
    # both: min_new_tokens takes precedence (transformers resets min_length to prompt + min_new_tokens), so the
    # EOS of step 2 ends row 0 (hf-accel applied both minimums and suppressed it until step 6)
    "both_min_lengths": ({0: 2}, dict(max_new_tokens=12, min_new_tokens=1, min_length="WIDTH+6")),
}


def _case(tiny, model_type, case):
    """(model, ids, mask, generate kwargs with eos_token_id, stock output)."""
    model = tiny.model(model_type)
    ids, mask = tiny.batch(seed=1)
    width = ids.shape[1]
    eos_at, options = CASES[case]
    kwargs = {k: (width + int(v.split("+")[1]) if isinstance(v, str) else v) for k, v in options.items()}
    free = tiny.greedy(model, ids, mask, 20)[:, width:]  # stock, EOS suppressed: what each row would say
    eos = pick_eos(free, eos_at)
    kwargs["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    stock = _generate(model, ids, mask, tiny.PAD, **kwargs)
    # The EOS really is in the middle: rows finish at different steps (None: not within the limit).
    steps = finish_steps(stock[:, width:], eos)
    if case.startswith("min_"):  # row 0's EOS at step 2 was suppressed
        assert steps[0] is None or steps[0] >= 6, steps
    else:
        assert steps[0] == 2 and len(set(steps)) > 1, steps
    if case == "all_rows_finish":
        assert None not in steps and len(set(steps)) == 3 and stock.shape[1] == width + max(steps) + 1 < width + 16
    return model, ids, mask, kwargs, stock
