"""RMSNorm with GLM-5.3's numerics (fp32 statistics, eps inside the sqrt, weight applied in the input dtype).

The one RMSNorm of the package: decoder norms, MLA q/kv latent norms, MTP norms and the vision tower's norms.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_glm5.models.params import param_device


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32 (HF ``Glm5NextTextRMSNorm``).

    Normalises the last dim of any layout ([s, b, h] activations, [..., heads, d] per-head norms). Replicated over
    TP; with sequence parallelism the weight is tagged ``sequence_parallel`` so megatron-core all-reduces its grad.
    Built like megatron-core norms: ``RMSNorm(config=..., hidden_size=..., eps=...)``; positional
    ``RMSNorm(hidden_size, eps)`` also works.
    """

    def __init__(self, config=None, hidden_size: int = None, eps: float = 1e-5, **_unused):
        if isinstance(config, int):  # RMSNorm(hidden_size, eps[, config=...]) form
            config, hidden_size, eps = _unused.pop("config", None), config, hidden_size if hidden_size is not None else eps
        super().__init__()
        dtype = getattr(config, "params_dtype", None) if config is not None else None
        self.weight = nn.Parameter(torch.ones(hidden_size, device=param_device(config), dtype=dtype))
        self.eps = eps
        self.weight.tensor_model_parallel = False
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
