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
flow back to every expert's weight. The fallback (CPU, FP8, expert tensor parallelism, biases, probabilities
applied on the input) is ``SequentialMLP.forward`` itself, so the CPU reference numerics are megatron-core's.

**Weights without a copy.** The experts' fc1 (and fc2) weights live as the slices ``[e]`` of one ``[E, out, in]``
storage (:meth:`GroupedExperts.pack_expert_weights`, at construction and after every ``.to()`` / ``.cuda()`` /
``.bfloat16()``), so :func:`stacked_weights` hands the grouped GEMM a view of that storage instead of
``torch.stack``'s copy of every expert weight each step (2 copies of all expert weights per MoE layer and step:
~1.6 ms of the 4K proxy step on the H200). The parameters stay separate ``nn.Parameter`` s with their own keys and
gradients. Whoever re-homes them elsewhere (megatron's DDP with the distributed optimizer puts every parameter in
its own buffer, in reverse order) gets ``torch.stack`` again: same numbers, one copy.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_glm5.execution_plan import plan_of

__all__ = ["GroupedExperts", "grouped_glu", "stacked_weights"]


def _stacked_alias(weights) -> torch.Tensor | None:
    """``[E, *w.shape]`` tensor over the storage the ``weights`` already share -- weight ``e`` at slice ``e`` --, or
    ``None`` unless they are equally shaped, contiguous and laid out back to back in that order in one storage."""
    w0 = weights[0]
    if not w0.is_contiguous() or w0.device.type == "meta":
        return None
    n, ptr, esize = w0.numel(), w0.data_ptr(), w0.element_size()
    storage = w0.untyped_storage()
    for e, w in enumerate(weights):
        if (w.shape != w0.shape or w.dtype != w0.dtype or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != storage.data_ptr() or w.data_ptr() != ptr + e * n * esize):
            return None
    return w0.detach().new_empty(0).set_(storage, w0.storage_offset(), (len(weights), *w0.shape),
                                         (n, *w0.stride()))


class _StackedWeights(torch.autograd.Function):
    """``(*weights) -> [E, *w.shape]``: forward the alias of :func:`_stacked_alias` where there is one (no copy),
    else ``torch.stack``'s copy; backward ``grad.unbind(0)`` (views, as ``torch.stack``'s backward)."""

    @staticmethod
    def forward(ctx, *weights):
        alias = _stacked_alias(weights)
        return torch.stack(weights) if alias is None else alias

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def stacked_weights(weights) -> torch.Tensor:
    """``torch.stack(weights)`` (``[E, *w.shape]``, differentiable w.r.t. every weight) without copying when the
    weights are back-to-back slices of one storage (:meth:`GroupedExperts.pack_expert_weights`); else the copy.

    The alias is a new tensor to autograd: in-place edits of the weights between forward and backward (which no
    training step makes) are not caught by its version counter."""
    return _StackedWeights.apply(*weights)


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

    The execution plan's ``grouped_experts_on_cpu`` (``self.plan``) also takes the grouped path on CPU tensors
    (``torch._grouped_mm`` has a CPU kernel in recent PyTorch), which the tests use to check the grouped arithmetic
    against the per-expert loop; the plan's ``triton_kernels`` runs the GLU as one Triton kernel on CUDA.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan_of(self.config)
        self.pack_expert_weights()

    def expert_weight_sets(self):
        """``[fc1 weights, fc2 weights]``, each the list of the local experts' weights in expert order."""
        return [[getattr(e, name).weight for e in self.local_experts] for name in ("linear_fc1", "linear_fc2")]

    @torch.no_grad()
    def pack_expert_weights(self) -> None:
        """Move every local expert's fc1 (and fc2) weight into one ``[E, out, in]`` storage, expert ``e`` at slice
        ``e`` (``param.data`` reassigned: same parameters, values and keys), so :func:`stacked_weights` needs no
        copy. Weights already packed, of different shapes or dtypes, or on the meta device are left as they are."""
        for weights in self.expert_weight_sets():
            w0 = weights[0]
            if (len(weights) < 2 or w0.device.type == "meta" or _stacked_alias(weights) is not None
                    or any(w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device for w in weights)):
                continue
            packed = torch.stack([w.detach() for w in weights])
            for e, w in enumerate(weights):
                w.data = packed[e]

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.cuda()`` / ``.bfloat16()`` give every parameter its own new storage: pack them again."""
        out = super()._apply(fn, recurse)
        self.pack_expert_weights()
        return out

    def _grouped_ok(self, x: torch.Tensor) -> bool:
        cfg = self.config
        if not (x.is_cuda or self.plan.grouped_experts_on_cpu) or not hasattr(torch, "_grouped_mm"):
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
        if self.plan.triton_kernels and y1.is_cuda and cfg.activation_func is torch.nn.functional.silu:
            from megatron_glm5.kernels import glu

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
        fc1_weights, fc2_weights = self.expert_weight_sets()
        w1 = stacked_weights(fc1_weights).transpose(1, 2)   # [E, h, 2F]
        w2 = stacked_weights(fc2_weights).transpose(1, 2)   # [E, F, h]
        y1 = torch._grouped_mm(x, w1.to(x.dtype), offs=offs)
        a = self._glu(y1, permuted_probs)
        return torch._grouped_mm(a, w2.to(x.dtype), offs=offs), None
