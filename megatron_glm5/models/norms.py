"""RMSNorm with GLM-5.3's numerics (fp32 statistics, eps inside the sqrt, weight applied in the input dtype).

The one RMSNorm of the package: decoder norms, MLA q/kv latent norms, MTP norms and the vision tower's norms. On CUDA
it runs as one fused Triton kernel forward and one backward (``megatron_glm5/kernels/rms_norm.py``); elsewhere as the
PyTorch formula.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_glm5.execution_plan import plan_of
from megatron_glm5.models.params import param_device


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32 (HF ``Glm5NextTextRMSNorm``).

    Normalises the last dim of any layout ([s, b, h] activations, [..., heads, d] per-head norms). Replicated over
    TP; with sequence parallelism the weight is tagged ``sequence_parallel`` so megatron-core all-reduces its grad.
    Built like megatron-core norms: ``RMSNorm(config=..., hidden_size=..., eps=...)``; positional
    ``RMSNorm(hidden_size, eps)`` also works.

    On CUDA with triton, when ``x`` and the weight share one float dtype and the normalised dim is at most
    ``kernels.rms_norm.MAX_D`` wide, the forward and backward run through the fused kernels of
    ``megatron_glm5/kernels/rms_norm.py`` (the same function: ``y`` bitwise up to the fp32 rounding of the sum of
    squares; the gradients in fp32 inside, rounded once to x's / the weight's dtype) when the execution plan has
    ``rms_norm_fused`` (``self.plan``, :func:`megatron_glm5.execution_plan.plan_of` of the config); CPU tensors always
    run the PyTorch formula below.
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
        self.plan = plan_of(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan.rms_norm_fused and x.is_cuda:
            from megatron_glm5.kernels import rms_norm as fused

            if fused.fused_rms_norm_applies(x, self.weight):
                return fused.fused_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
