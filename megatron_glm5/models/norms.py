"""RMSNorm with GLM-5.3's numerics (fp32 statistics, eps inside the sqrt, weight applied in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32.

    Works on any layout (normalises the last dim): [s, b, h] activations, [.., heads, d] per-head norms.
    ``sequence_parallel`` marks the weight so megatron-core all-reduces its grad over TP when SP is on.
    Signature matches megatron-core norm builders: ``RMSNorm(config, hidden_size, eps)``.
    """

    def __init__(self, config=None, hidden_size: int = None, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        if config is not None:
            setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
