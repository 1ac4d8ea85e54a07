"""Plain-PyTorch statement of what the kernels compute (full matrices: small inputs only).

With x_ij = s * <A_i, B_j>:
    row_lse_i = log sum_j exp(x_ij),   col_lse_j = log sum_i exp(x_ij)
    dX_ij     = g_row_i softmax_j(x)_ij + g_col_j softmax_i(x)_ij
              = g_row_i exp(x_ij - row_lse_i) + g_col_j exp(x_ij - col_lse_j)
    dA = s dX B,   dB = s dX^T A,   ds = sum_ij dX_ij <A_i, B_j>
    CLIP loss = mean_i [ (row_lse_i + col_lse_i) / 2 - x_ii ]   (square batch)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..launching import f32_out_ok


def lse_pair_reference(a: Tensor, b: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """(row_lse, col_lse) of x = s * a @ b.T, computed in float64."""
    x = scale.double() * a.double() @ b.double().T
    return torch.logsumexp(x, 1), torch.logsumexp(x, 0)


def lse_grad_reference(a: Tensor, b: Tensor, scale: Tensor, g_row: Tensor, g_col: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(dA, dB, ds) of sum_i g_row_i row_lse_i + sum_j g_col_j col_lse_j, in float64."""
    a, b, s = a.double(), b.double(), scale.double()
    dot = a @ b.T
    x = s * dot
    dx = g_row.double()[:, None] * torch.softmax(x, 1) + g_col.double()[None, :] * torch.softmax(x, 0)
    return s * dx @ b, s * dx.T @ a, (dx * dot).sum()


def clip_loss_reference(img: Tensor, txt: Tensor, scale: Tensor) -> Tensor:
    """Symmetric CLIP loss in float64 (open_clip's ClipLoss value)."""
    row, col = lse_pair_reference(img, txt, scale)
    diag = scale.double() * (img.double() * txt.double()).sum(-1)
    return (0.5 * (row + col) - diag).mean()


ROW_DOT_CHUNK = 1 << 20  # elements per chunk of row_dot's fp32 temporaries (3 x 4 MB)


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    """(m,) fp32 <a_i, b_i> (no autograd), with no fp32 (m, c) copy: 16-bit CUDA inputs in
    one batched product with fp32 accumulation and output (one launch: the loss is host-bound
    at small b), otherwise in fp32 chunks."""
    a, b = a.detach(), b.detach()
    if a.is_cuda and a.element_size() == 2 and f32_out_ok(torch.bmm, a[:1, None], a[:1, :, None]):
        return torch.bmm(a[:, None], b[:, :, None], out_dtype=torch.float32).view(-1)
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    step = max(1, ROW_DOT_CHUNK // max(1, a.shape[1]))
    for lo in range(0, a.shape[0], step):
        out[lo:lo + step] = (a[lo:lo + step].detach().float() * b[lo:lo + step].detach().float()).sum(-1)
    return out
