"""Principal-subspace pooling with query / output compensation (method ``"pca"``).

Mean pooling keeps ``q_proj`` and ``o_proj`` and replaces the r heads of a group by one average head.
This method instead picks the shared head that keeps the most of what the group's query heads read,
and re-fits each query head's side of the product to it, in closed form from the calibration
second moment ``C = E[x x^T]`` of the layer input (see :mod:`hf_accel.conversion.calibration`):

* V: query head ``i`` (reading old head ``h``) contributes ``O_i v_h`` to the output. With a shared
  ``v = P x`` and a refitted ``O_i' = O_i B_h``, the least-squares error
  ``sum_h E||G_h^(1/2) (W_h x - B_h P x)||^2`` (``G_h = sum_{i reads h} O_i^T O_i``) is minimised by
  ``B_h = W_h C P^T (P C P^T)^-1`` and by the rows of ``P C^(1/2)`` spanning the top ``head_dim``
  eigenvectors of ``S = C^(1/2) (sum_h W_h^T G_h W_h) C^(1/2)`` — reduced-rank regression
  (Izenman 1975, "Reduced-rank regression for the multivariate linear model").
* K: RoPE rotates each frequency pair ``(p, p + d/2)`` of a head as a complex number ``k_p``, and the
  only maps on the query side that commute with every rotation are complex scalars. So per pair the
  shared key is ``k_p = sum_h a_h k_{h,p}`` and query head ``i`` is rescaled by ``conj(c_h)`` with
  ``k_{h,p} ~ c_h k_p``: the best such rank-1 approximation of the r complex signals, weighted by the
  query energy ``e_h = sum_{i reads h} E|q_{i,p}|^2`` that multiplies each head's logit error, is the
  top eigenvector ``u`` of ``D M D`` (``M_ab = E[k_{a,p} conj(k_{b,p})]``, ``D = diag(sqrt(e))``):
  ``a_h = conj(u_h) sqrt(e_h)``, ``c_h = u_h / sqrt(e_h)`` (principal component analysis in C^r).

Both steps are exact when the heads of a group are equal (then the shared head is that head). Models
whose attention normalises q / k per head after the projection (Qwen3's ``q_norm`` / ``k_norm``) are
not supported: the query-side rescaling would be undone by the norm.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_accel.conversion.heads import _set_bookkeeping, _set_linear

UNSUPPORTED_MODEL_TYPES = ("qwen3",)


def _sqrt_and_inverse_sqrt(c: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    lam, u = torch.linalg.eigh(c)
    lam = lam.clamp_min(floor * lam.max().clamp_min(torch.finfo(lam.dtype).tiny))
    return (u * lam.sqrt()) @ u.T, (u * lam.rsqrt()) @ u.T


def _weights(linear: nn.Linear, with_bias: bool, dtype: torch.dtype) -> torch.Tensor:
    w = linear.weight.detach().to(dtype)
    if with_bias:
        w = torch.cat([w, linear.bias.detach().to(dtype)[:, None]], dim=1)
    return w


@torch.no_grad()
def pca_pool_module(
    module: nn.Module, num_heads: int, num_kv_heads: int, new_kv: int, head_dim: int, moment: torch.Tensor,
    floor: float = 1e-7,
) -> None:
    """Pool adjacent KV heads of one attention module into ``new_kv`` heads with compensation (in place).

    Args:
        module: a Llama-family attention module (see :mod:`hf_accel.conversion.heads`).
        num_heads, num_kv_heads, new_kv, head_dim: query heads, current and new KV heads, head width.
        moment: [hidden + 1, hidden + 1], float, the layer input's second moment with the bias column
            (:func:`hf_accel.conversion.calibration.collect_input_moments`).
        floor: eigenvalues of ``C`` below ``floor * max`` are raised to it (keeps ``C^-1/2`` finite).

    Raises:
        ValueError: K and V projections disagree on having a bias.
    """
    with_bias = module.k_proj.bias is not None
    if with_bias != (module.v_proj.bias is not None) or with_bias != (module.q_proj.bias is not None):
        raise ValueError("q/k/v projections must all have a bias or all have none")
    dt = torch.float64
    device = module.k_proj.weight.device
    c = moment.to(device=device, dtype=dt)
    c = c if with_bias else c[:-1, :-1]
    r, rep, d, half = num_kv_heads // new_kv, num_heads // num_kv_heads, head_dim, head_dim // 2
    wk = _weights(module.k_proj, with_bias, dt).view(num_kv_heads, d, -1)
    wv = _weights(module.v_proj, with_bias, dt).view(num_kv_heads, d, -1)
    wq = _weights(module.q_proj, with_bias, dt).view(num_heads, d, -1)
    o = module.o_proj.weight.detach().to(dt).view(-1, num_heads, d)
    wq_new, o_new = wq.clone(), o.clone()
    k_new = torch.empty(new_kv, d, wk.shape[-1], dtype=dt, device=device)
    v_new = torch.empty_like(k_new)
    c_half, c_inv_half = _sqrt_and_inverse_sqrt(c, floor)

    # V: reduced-rank regression per group, then o_proj columns refitted per old head
    o_heads = o.view(o.shape[0], num_kv_heads, rep, d)
    gram = torch.einsum("nkri,nkrj->kij", o_heads, o_heads)  # G_h [n, d, d]
    for g in range(new_kv):
        hs = range(g * r, (g + 1) * r)
        s = sum(c_half @ wv[h].T @ gram[h] @ wv[h] @ c_half for h in hs)
        s = (s + s.T) / 2
        _, vecs = torch.linalg.eigh(s)
        p = vecs[:, -d:].T @ c_inv_half  # [d, in]
        v_new[g] = p
        pcp = p @ c @ p.T
        for h in hs:
            b = torch.linalg.solve(pcp, (wv[h] @ c @ p.T).T).T  # W_h C P^T (P C P^T)^-1
            o_new[:, h * rep : (h + 1) * rep] = o[:, h * rep : (h + 1) * rep] @ b

    # K: complex rank-1 approximation per RoPE frequency pair, query heads rescaled per pair
    q_energy = torch.einsum("hdi,ij,hdj->hd", wq, c, wq)
    energy = (q_energy[:, :half] + q_energy[:, half:]).view(num_kv_heads, rep, half).sum(1)  # [n, half]
    idx = torch.arange(half, device=device)
    for g in range(new_kv):
        hs = list(range(g * r, (g + 1) * r))
        km = torch.einsum("adi,ij,bej->abde", wk[hs], c, wk[hs])  # E[k_a k_b^T] [r, r, d, d]
        re = km[:, :, idx, idx] + km[:, :, idx + half, idx + half]
        im = km[:, :, idx + half, idx] - km[:, :, idx, idx + half]
        m = torch.complex(re, im).permute(2, 0, 1)  # [half, r, r], M_ab = E[k_a conj(k_b)]
        sq = energy[hs].T.clamp_min(torch.finfo(dt).tiny).sqrt()  # [half, r]
        sigma = sq[:, :, None] * m * sq[:, None, :]
        _, vecs = torch.linalg.eigh((sigma + sigma.mH) / 2)
        u = vecs[:, :, -1]  # [half, r], unit norm
        a = u.conj() * sq
        # scale the shared key to the mean energy of the heads it replaces (keeps activations in range)
        pooled_energy = torch.einsum("pa,pab,pb->p", a, m, a.conj()).real
        mean_energy = m.diagonal(dim1=1, dim2=2).real.mean(1)
        scale = (mean_energy / pooled_energy.clamp_min(torch.finfo(dt).tiny)).sqrt()
        a = a * scale[:, None]
        beta = u.conj() / sq / scale[:, None]  # conj(c_h) with the scale undone
        kx = torch.zeros(half, wk.shape[-1], dtype=dt, device=device)
        ky = torch.zeros_like(kx)
        for j, h in enumerate(hs):
            xh, yh = wk[h, :half], wk[h, half:]
            ar, ai = a[:, j].real[:, None], a[:, j].imag[:, None]
            kx += ar * xh - ai * yh
            ky += ai * xh + ar * yh
            br, bi = beta[:, j].real[:, None], beta[:, j].imag[:, None]
            qx, qy = wq[h * rep : (h + 1) * rep, :half], wq[h * rep : (h + 1) * rep, half:]
            wq_new[h * rep : (h + 1) * rep, :half] = br * qx - bi * qy
            wq_new[h * rep : (h + 1) * rep, half:] = bi * qx + br * qy
        k_new[g] = torch.cat([kx, ky], dim=0)

    for linear, w in ((module.k_proj, k_new), (module.v_proj, v_new), (module.q_proj, wq_new)):
        w = w.reshape(-1, w.shape[-1])
        _set_linear(linear, w[:, :-1] if with_bias else w, w[:, -1] if with_bias else None)
    _set_linear(module.o_proj, o_new.reshape(o.shape[0], -1),
                None if module.o_proj.bias is None else module.o_proj.bias.detach())
    _set_bookkeeping(module, num_heads, new_kv)
