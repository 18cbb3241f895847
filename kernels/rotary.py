"""Rotary embedding in the rotate-half layout: x * cos + rotate_half(x) * sin, per head."""

from __future__ import annotations

import torch


def rotary_ref(
    x: torch.Tensor,  # [N, heads, head_dim]
    cos: torch.Tensor,  # [N, 1, head_dim]
    sin: torch.Tensor,  # [N, 1, head_dim]
) -> torch.Tensor:  # [N, heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
