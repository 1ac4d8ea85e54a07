"""The SigLIP tile math in plain PyTorch, float64: what the Triton kernels compute.

x_ij = s <A_i, B_j> + t, z_ij = +1 on the diagonal when ``diag`` else -1;
row_loss_i = sum_j softplus(-z_ij x_ij); dX_ij = g_i (sigmoid(x_ij) - [i == j and diag]);
dA = s dX B, dB = s dX^T A, ds = sum dX_ij <A_i, B_j>, dt = sum dX_ij.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _signs(m: int, n: int, diag: bool, device) -> Tensor:
    z = -torch.ones(m, n, dtype=torch.float64, device=device)
    if diag:
        z.diagonal().fill_(1.0)
    return z


def sigmoid_rows_reference(a: Tensor, b: Tensor, s: Tensor, t: Tensor, diag: bool) -> Tensor:
    """row_loss (m,) float64."""
    x = float(s) * a.double() @ b.double().T + float(t)
    return F.softplus(-_signs(*x.shape, diag, a.device) * x).sum(1)


def sigmoid_grad_reference(a: Tensor, b: Tensor, s: Tensor, t: Tensor, g: Tensor, diag: bool):
    """(dA, dB, ds, dt) float64 for upstream g (m,) of the row losses."""
    dot = a.double() @ b.double().T
    x = float(s) * dot + float(t)
    z = _signs(*x.shape, diag, a.device)
    dx = -z * torch.sigmoid(-z * x) * g.double()[:, None]
    return float(s) * dx @ b.double(), float(s) * dx.T @ a.double(), (dx * dot).sum(), dx.sum()
