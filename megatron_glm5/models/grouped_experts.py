"""Routed experts as two grouped GEMMs (``torch._grouped_mm``) with megatron-core's ``SequentialMLP`` parameters.

megatron-core's ``SequentialMLP`` runs the local experts one after another (two GEMMs and an activation per expert,
plus a host sync to split the tokens). :class:`GroupedExperts` is a ``SequentialMLP`` -- the same ``local_experts.
{e}.linear_fc1 / linear_fc2`` parameters, so ``state_dict``, ``sharded_state_dict``, the HF key table and the
converters are unchanged -- whose forward on CUDA runs all experts at once::

    x      [T, h]            tokens sorted by local expert (the token dispatcher's output), T = sum(tokens_per_expert)
    offs   [E] int32         cumulative token counts (end row of every expert's group)
    W1     [E, h, 2F]        stacked fc1 weights, transposed views ([gate; up] rows of each expert)
    y1 = grouped_mm(x, W1, offs)                                  [T, 2F]
    a  = (silu(clamp(gate)) * clamp(up)) * probs -> x.dtype        [T, F]   (megatron MLP's clamped GLU)
    y  = grouped_mm(a, W2, offs)                                  [T, h]

``torch._grouped_mm(mat_a [T, K], mat_b [E, K, N], offs=[E] int32)``: rows ``offs[e-1]:offs[e]`` of ``mat_a``
multiply ``mat_b[e]`` (empty groups allowed); autograd gives the input and the 3-D weight gradient, whose slices
flow back to every expert's weight through ``torch.stack``. The fallback (CPU, FP8, expert tensor parallelism,
biases, probabilities applied on the input) is ``SequentialMLP.forward`` itself, so the CPU reference numerics are
megatron-core's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

__all__ = ["GroupedExperts", "grouped_glu"]


def grouped_glu(y1: torch.Tensor, probs: torch.Tensor, config) -> torch.Tensor:
    """megatron-core MLP's GLU for experts: ``[T, 2F] -> [T, F]``, ``act(clamp(gate)) * (clamp(up) + offset)``
    times the per-token routing probability, cast back to ``y1.dtype`` (the same op order as ``MLP.forward``)."""
    gate, up = torch.chunk(y1, 2, dim=-1)
    val = config.activation_func_clamp_value
    if val is not None:
        gate = gate.clamp(min=None, max=val)
        up = up.clamp(min=-val, max=val)
    out = config.activation_func(gate) * (up + config.glu_linear_offset)
    return (out * probs.unsqueeze(-1)).to(y1.dtype)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` whose forward runs all local experts as grouped GEMMs on CUDA (see the module docstring).

    ``force_grouped = True`` also takes the grouped path on CPU (``torch._grouped_mm`` has a CPU kernel in recent
    PyTorch), which the tests use to check the grouped arithmetic against the per-expert loop.
    """

    force_grouped: bool = False

    def _grouped_ok(self, x: torch.Tensor) -> bool:
        cfg = self.config
        if not (x.is_cuda or self.force_grouped) or not hasattr(torch, "_grouped_mm"):
            return False
        if self.num_local_experts < 2 or x.shape[0] == 0 or x.dim() != 2:
            return False
        if cfg.fp8 or getattr(cfg, "fp4", None) or cfg.moe_apply_probs_on_input or not cfg.gated_linear_unit:
            return False
        if self.tp_group is not None and self.tp_group.size() > 1:
            return False
        fc1, fc2 = self.local_experts[0].linear_fc1, self.local_experts[0].linear_fc2
        if getattr(fc1, "bias", None) is not None or getattr(fc2, "bias", None) is not None:
            return False
        if x.is_cuda and x.dtype != torch.bfloat16:
            return False
        return True

    def _glu(self, y1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """:func:`grouped_glu`; on CUDA with SiLU one Triton kernel each way (``megatron_glm5/kernels/glu.py``)."""
        cfg = self.config
        if y1.is_cuda and cfg.activation_func is torch.nn.functional.silu:
            from megatron_glm5.kernels import glu

            if glu.HAVE_TRITON:
                return glu.clamped_swiglu(y1, probs, cfg.activation_func_clamp_value, cfg.glu_linear_offset)
        return grouped_glu(y1, probs, cfg)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """``permuted_local_hidden_states [T, h]`` sorted by local expert, ``tokens_per_expert [E]``,
        ``permuted_probs [T]`` -> ``(output [T, h], None)``."""
        x = permuted_local_hidden_states
        if not self._grouped_ok(x):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert).to(device=x.device, non_blocking=True)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)   # [E, h, 2F]
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)   # [E, F, h]
        y1 = torch._grouped_mm(x, w1.to(x.dtype), offs=offs)
        a = self._glu(y1, permuted_probs)
        return torch._grouped_mm(a, w2.to(x.dtype), offs=offs), None
