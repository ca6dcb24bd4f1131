"""Linear building blocks shared by the attention modules (KDA, DSA, the KPool indexer)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_glm5.models.params import mark_replicated, param_device


def linear_output(y):
    """The output tensor of a linear (megatron's parallel linears return ``(output, bias)``, torch's a tensor)."""
    return y[0] if isinstance(y, tuple) else y


class ReplicatedLinear(torch.nn.Linear):
    """A bias-free ``torch.nn.Linear`` replicated over tensor parallelism (``y = x W^T``; ``weight [out, in]``).

    Built like a megatron linear (``config``, ``init_method``) so it can sit in a ``ModuleSpec``. Returns a tensor,
    not an ``(output, bias)`` tuple. With ``config.gradient_accumulation_fusion`` and a weight wrapped by megatron's
    DDP (it has ``main_grad``) it runs megatron-core's linear function, whose backward accumulates the weight gradient
    into ``main_grad`` as megatron-core's own linears do (:mod:`megatron_glm5.mcore_extensions`).
    """

    def __init__(self, input_size: int, output_size: int, *, config=None, init_method: Optional[Callable] = None,
                 bias: bool = False, **_unused):
        dtype = config.params_dtype if config is not None else None
        device = param_device(config) if config is not None else None
        super().__init__(input_size, output_size, bias=bias, device=device, dtype=dtype)
        if init_method is None and config is not None:
            init_method = config.init_method
        if init_method is not None and (config is None or config.perform_initialization):
            with torch.no_grad():
                init_method(self.weight)
                if self.bias is not None:
                    self.bias.zero_()
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        mark_replicated(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        if self.gradient_accumulation_fusion and hasattr(self.weight, "main_grad") and x.dim() in (2, 3):
            from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

            return linear_with_grad_accumulation_and_async_allreduce(
                x, self.weight, self.bias, gradient_accumulation_fusion=True, allreduce_dgrad=False,
                sequence_parallel=False)
        return super().forward(x)
