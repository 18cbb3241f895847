"""RMSNorm of each row: normalise in float32, round to the input dtype, multiply by the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # [N, D]
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [N, D]
    residual: torch.Tensor,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(x + residual), x + residual
    """The residual stream's add fused with the norm that follows it."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed
