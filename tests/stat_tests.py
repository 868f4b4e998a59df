"""Statistical tests shared by the sampling tests (no scipy dependency)."""

from __future__ import annotations

import torch


def homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of Pearson's chi-squared test that two samples of token ids come from one distribution.

    Categories with an expected count below 5 in either sample are pooled into one bin (the usual
    validity rule); p = Q(dof / 2, chi2 / 2), the regularized upper incomplete gamma function.
    """
    k = int(max(a.max(), b.max())) + 1
    counts = torch.stack([torch.bincount(a.flatten(), minlength=k), torch.bincount(b.flatten(), minlength=k)])
    counts = counts.double()
    expected_min = counts.sum(0) * counts.sum(1).min() / counts.sum()
    rare = expected_min < 5
    table = torch.cat([counts[:, ~rare], counts[:, rare].sum(1, keepdim=True)], 1)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    chi2 = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2.0))


def goodness_of_fit_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-squared test that ``samples`` (token ids) are draws from ``probs`` [vocab].

    Categories with an expected count below 5 are pooled into one bin."""
    probs = probs.double() / probs.double().sum()
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    expected = probs * n
    rare = expected < 5
    obs = torch.cat([counts[~rare], counts[rare].sum().reshape(1)])
    exp = torch.cat([expected[~rare], expected[rare].sum().reshape(1)])
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # a draw of a token the distribution excludes
        obs, exp = obs[:-1], exp[:-1]
    if exp.numel() < 2:
        return 1.0
    chi2 = ((obs - exp) ** 2 / exp).sum()
    dof = exp.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2.0))
