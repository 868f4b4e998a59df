"""RoPE + cache-write kernel: the rotated K's second output (``k_out``) used by the prompt prefill's attention.

Runs under Triton's interpreter on the CPU (float32) and compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from hf_accel.kernels.rope_cache import rope_and_cache, rope_and_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b=5, h=6, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h * d, generator=g)
    k = torch.randn(b, hkv * d, generator=g)
    v = torch.randn(b, hkv * d, generator=g)
    ang = torch.rand(b, d // 2, generator=g) * 50
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    kc = torch.full((6, 4, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    slots = torch.tensor([0, 5, -1, 9, 22][:b], dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k, v, cos, sin, kc, vc, slots)]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("hkv,heads_per_program", [(2, None), (2, 1), (1, 4), (2, 2)])
def test_k_out_holds_the_rotated_keys_of_every_row(qk_norm, hkv, heads_per_program, monkeypatch):
    """Against transformers' ops, with the default heads per program (all under the interpreter, 1 on a GPU),
    one head per program (the GPU's), and 4 of 7 heads (a program with a masked row: q and k heads in one
    tile), 2 of 8."""
    from hf_accel.kernels import rope_cache

    if heads_per_program is not None:
        monkeypatch.setattr(rope_cache, "heads_per_program", lambda heads: heads_per_program)
    q, k, v, cos, sin, kc, vc, slots = _inputs(hkv=hkv)
    w = torch.linspace(0.5, 1.5, 16, device=DEVICE) if qk_norm else None
    k_out = torch.full((5, hkv, 16), float("nan"), device=DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    out = rope_and_cache(q, k, v, cos, sin, kc, vc, slots, w, w, 1e-6, k_out=k_out)
    k_ref = torch.empty_like(k_out)
    ref = rope_and_cache_ref(q, k, v, cos, sin, kc2, vc2, slots, w, w, 1e-6, k_out=k_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)  # row 2 (slot -1) included
    # the cache holds the same rotated keys where a slot was given
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(kc[slot // 4, slot % 4], k_out[row], rtol=0, atol=0)
    assert torch.isnan(kc).sum() == kc.numel() - 4 * hkv * 16  # nothing else written
    assert torch.isnan(vc).sum() == vc.numel() - 4 * hkv * 16
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(vc[slot // 4, slot % 4], v[row].view(hkv, 16), rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["shape", "dtype", "strided"])
def test_k_out_errors(bad):
    q, k, v, cos, sin, kc, vc, slots = _inputs()
    if bad == "shape":
        k_out = torch.empty(5, 3, 16, device=DEVICE)
    elif bad == "dtype":
        k_out = torch.empty(5, 2, 16, dtype=torch.float16, device=DEVICE)
    else:
        k_out = torch.empty(5, 2, 32, device=DEVICE)[..., :16]
    with pytest.raises(ValueError, match="k_out"):
        rope_and_cache(q, k, v, cos, sin, kc, vc, slots, k_out=k_out)


@pytest.mark.parametrize("bad", ["value_layout", "value_shape", "strided_rows"])
def test_cache_layouts_it_cannot_write_are_refused(bad):
    """The kernel addresses both pools with the key pool's strides and contiguous rows: a value pool of another
    layout or shape, or pools with strided rows, raise instead of being written in the wrong places."""
    q, k, v, cos, sin, kc, vc, slots = _inputs()
    if bad == "value_layout":
        vc = torch.full((16, 2, 4, 6), float("nan"), device=DEVICE).permute(3, 2, 1, 0)
    elif bad == "value_shape":
        vc = vc[:5]
    else:
        kc = torch.full((6, 4, 2, 32), float("nan"), device=DEVICE)[..., ::2]
        vc = torch.full((6, 4, 2, 32), float("nan"), device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="key_cache and value_cache must have one shape and one layout"):
        rope_and_cache(q, k, v, cos, sin, kc, vc, slots)


@pytest.mark.parametrize("slot", [24, 10**8, -2])
@pytest.mark.parametrize("op", ["rope_and_cache", "gemv_rope", "fused_linear_rope"])
def test_slots_outside_the_pools_are_refused(op, slot):
    """24 slots (6 blocks of 4): a slot past them would be written past the pools (the interpreter crashed the
    process), one below -1 skipped silently; each launcher raises, and the caches stay untouched."""
    from hf_accel.kernels.fused_linear import fused_linear_rope
    from hf_accel.kernels.gemv import gemv_rope

    q, k, v, cos, sin, kc, vc, slots = _inputs(b=2, h=2, hkv=1, d=32)  # head_dim / 2 a multiple of 16
    slots = torch.tensor([3, slot], dtype=torch.int32, device=DEVICE)
    before = kc.clone()
    with pytest.raises(ValueError, match=r"slot_mapping holds slots in .*the pools have 24 slots"):
        if op == "rope_and_cache":
            rope_and_cache(q, k, v, cos, sin, kc, vc, slots)
        else:
            x = torch.randn(2 if op == "fused_linear_rope" else 1, 32, device=DEVICE)
            w = torch.randn((2 + 2 * 1) * 32, 32, device=DEVICE)
            fn = gemv_rope if op == "gemv_rope" else fused_linear_rope
            n = x.shape[0]
            fn(x, w, cos[:n], sin[:n], kc, vc, slots[-n:], 2)
    assert torch.equal(torch.isnan(kc), torch.isnan(before))


@pytest.mark.parametrize("bad", ["norm_length", "int_q", "float_slots"])
def test_rope_and_cache_refuses_inputs_it_would_misread(bad):
    q, k, v, cos, sin, kc, vc, slots = _inputs()
    w = torch.ones(16, device=DEVICE)
    if bad == "norm_length":
        with pytest.raises(ValueError, match=r"q_norm_weight must be \[head_dim=16\]"):
            rope_and_cache(q, k, v, cos, sin, kc, vc, slots, w[:5], w)
    elif bad == "int_q":
        with pytest.raises(ValueError, match="q must be floating point"):
            rope_and_cache(q.int(), k, v, cos, sin, kc, vc, slots)
    else:
        with pytest.raises(ValueError, match="slot_mapping must be int32/int64"):
            rope_and_cache(q, k, v, cos, sin, kc, vc, slots.float())
