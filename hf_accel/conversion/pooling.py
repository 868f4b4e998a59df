"""Pooling weights: how the r KV heads of a group are combined into one.

Every method returns matrices ``A_j`` [head_dim, head_dim] per head ``j`` of a group, and the pooled
projection is ``W = sum_j A_j W_j`` (see :func:`hf_accel.conversion.heads.pool_module_kv`).

* ``mean`` — ``A_j = I / r``: Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer
  Models from Multi-Head Checkpoints", §3.1.
* ``norm`` and ``activation`` — the least-squares pooled head. For V, the group's output is
  ``sum_i O_i v_{h(i)}`` (``O_i`` the o_proj columns of query head ``i``); the shared ``W`` minimising
  ``sum_i E||O_i (W_{h(i)} - W) x||^2`` is ``W = (sum_j G_j)^-1 sum_j G_j W_j`` with
  ``G_j = sum_{i reads j} O_i^T O_i`` (the input second moment cancels). For K, the logit of query head
  ``i`` is ``q_i^T R k_{h(i)}`` with R a RoPE rotation; minimising the logit error
  ``sum_i E (q_i^T R (k_{h(i)} - k))^2`` with q independent of k and R averaged over relative positions
  gives a per-RoPE-frequency weighted mean, the weight of head j at frequency pair p being the query
  energy ``sum_{i reads j} E[q_{i,p}^2 + q_{i,p+d/2}^2]``.

  ``activation`` uses those formulas with query energies measured on calibration text (V: the o_proj
  Gram matrices, which need no data). ``norm`` is their data-free, isotropic version: one scalar per
  head, ``||W_q rows of its query heads||_F^2`` for K and ``||O columns of its query heads||_F^2`` for V.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_accel.conversion.calibration import head_moments
from hf_accel.conversion.heads import compute_dtype

METHODS = ("mean", "norm", "activation", "pca")
CALIBRATED_METHODS = ("activation", "pca")  # "pca" lives in hf_accel.conversion.compensation


def _eye_weights(scalars: torch.Tensor, d: int) -> torch.Tensor:
    """[G, r] scalar weights (normalised per group) -> [G, r, d, d] matrices."""
    w = scalars / scalars.sum(dim=1, keepdim=True)
    eye = torch.eye(d, dtype=w.dtype, device=w.device)
    return w[:, :, None, None] * eye


def mean_weights(new_kv: int, r: int, d: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """``A_j = I / r``: [new_kv, r, d, d]."""
    return _eye_weights(torch.ones(new_kv, r, dtype=dtype, device=device), d)


def _query_blocks(weight: torch.Tensor, num_kv_heads: int, d: int, dim: int) -> torch.Tensor:
    """Split q_proj rows (dim=0) or o_proj columns (dim=1) into per-KV-head blocks:
    [num_kv_heads, rep * d, other]."""
    w = weight if dim == 0 else weight.T
    return w.reshape(num_kv_heads, -1, w.shape[-1])


def norm_weights(module: nn.Module, num_kv_heads: int, new_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-free scalar weights from the norms of the query rows / o_proj columns reading each head.

    Returns:
        (A_k, A_v), each [new_kv, r, d, d], r = num_kv_heads // new_kv.
    """
    dtype = compute_dtype(module.q_proj.weight.dtype)
    r = num_kv_heads // new_kv
    q = _query_blocks(module.q_proj.weight.detach().to(dtype), num_kv_heads, d, 0)
    o = _query_blocks(module.o_proj.weight.detach().to(dtype), num_kv_heads, d, 1)
    sk = q.pow(2).sum(dim=(1, 2)).view(new_kv, r)
    sv = o.pow(2).sum(dim=(1, 2)).view(new_kv, r)
    return _eye_weights(sk, d), _eye_weights(sv, d)


def _v_gram_weights(module: nn.Module, num_kv_heads: int, new_kv: int, d: int, ridge: float) -> torch.Tensor:
    dtype = compute_dtype(module.o_proj.weight.dtype)
    r = num_kv_heads // new_kv
    o = module.o_proj.weight.detach().to(dtype)  # [hidden, heads * d]
    num_heads = o.shape[1] // d
    rep = num_heads // num_kv_heads
    o = o.view(o.shape[0], num_kv_heads, rep, d)
    gram = torch.einsum("nkri,nkrj->kij", o, o).view(new_kv, r, d, d)  # G_j
    total = gram.sum(dim=1)  # [new_kv, d, d]
    eye = torch.eye(d, dtype=dtype, device=o.device)
    total = total + ridge * total.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * eye
    a = torch.linalg.solve(total[:, None], gram)  # (sum G)^-1 G_j
    # the ridge makes sum_j A_j slightly less than I; spread the rest evenly so the weights are an
    # exact affine combination (heads that are already equal then pool to themselves)
    return a + (eye - a.sum(dim=1, keepdim=True)) / r


def activation_weights(
    module: nn.Module, num_heads: int, num_kv_heads: int, new_kv: int, d: int, moment: torch.Tensor,
    ridge: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares weights: K per RoPE frequency from calibration query energies, V from o_proj Grams.

    Args:
        moment: [hidden + 1, hidden + 1], the layer's input second moment
            (:func:`hf_accel.conversion.calibration.collect_input_moments`).
        ridge: relative Tikhonov term added to ``sum_j G_j`` before solving (keeps it invertible).

    Returns:
        (A_k, A_v), each [new_kv, r, d, d].
    """
    r = num_kv_heads // new_kv
    m = head_moments(module.q_proj, num_heads, moment)  # [H, H, d, d]
    energy = torch.stack([m[i, i].diagonal() for i in range(num_heads)])  # [H, d]
    half = d // 2
    pair = energy[:, :half] + energy[:, half:]  # RoPE pairs (p, p + d/2)
    per_kv = pair.view(num_kv_heads, num_heads // num_kv_heads, half).sum(1).view(new_kv, r, half)
    per_kv = per_kv.clamp_min(torch.finfo(per_kv.dtype).tiny)
    w = per_kv / per_kv.sum(dim=1, keepdim=True)
    w = torch.cat([w, w], dim=-1)  # [new_kv, r, d]
    a_k = torch.diag_embed(w)
    a_v = _v_gram_weights(module, num_kv_heads, new_kv, d, ridge).to(a_k.dtype)
    return a_k, a_v
