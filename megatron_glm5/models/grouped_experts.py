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
``torch.stack``'s copy of every expert weight each step (2 copies of all expert weights per MoE layer and step).
The parameters stay separate ``nn.Parameter`` s with their own keys and gradients.

megatron-core's DDP moves every parameter into its own buffer, placed by the distributed optimizer's layout
(``DistributedOptimizer.compute_full_param_layout``), which walks the parameters in reverse module order: expert 7's
fc2, expert 7's fc1, expert 6's fc2, ... :func:`install_expert_buffer_layout` hands that layout each
``GroupedExperts``' weights in the order that lays them out as ``fc1[0..E-1], fc2[0..E-1]`` back to back
(:func:`expert_weights_back_to_back`), so the alias survives the trainer. Where the buffer still splits a set (a
bucket boundary inside it), :func:`stacked_weights` falls back to ``torch.stack``: same numbers, one copy.

**Gradient-accumulation fusion** (megatron-core's ``gradient_accumulation_fusion``, on in the trainer): the same
layout places the experts' fp32 ``main_grad`` s back to back, so the weight gradient of each grouped GEMM is summed
in fp32 and added straight into them (:class:`GroupedLinearIntoMainGrad`, ``kernels/grouped_wgrad.py``) instead of
being written in bf16 for DDP's hook to add to ``main_grad`` each micro batch; autograd gets megatron-core's dummy
gradient and ``grad_added_to_main_grad`` is set, as megatron-core's fused linears do.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_glm5.execution_plan import plan_of

__all__ = ["GroupedExperts", "GroupedLinearIntoMainGrad", "expert_weights_back_to_back", "grouped_glu",
           "install_expert_buffer_layout", "main_grads_back_to_back", "stacked_weights"]


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


def _stacked(weights) -> torch.Tensor:
    """``[E, *w.shape]``: the alias of :func:`_stacked_alias` where there is one (no copy), else ``torch.stack``."""
    alias = _stacked_alias(weights)
    return torch.stack(weights) if alias is None else alias


def expert_weights_back_to_back(params: list) -> list:
    """``params`` (a model chunk's trainable parameters, in module order) with each :class:`GroupedExperts`' expert
    weights reordered in place of their block: ``fc2[E-1], ..., fc2[0], fc1[E-1], ..., fc1[0]``, so that a layout
    walking the list in reverse (megatron-core's distributed-optimizer buffer) places ``fc1[0..E-1]`` and then
    ``fc2[0..E-1]`` back to back. A block is reordered only where it is contiguous in ``params`` (nothing else in
    between), so every other parameter keeps its position and index; the same input gives the same order on every
    rank."""
    slots = {}
    for i, p in enumerate(params):
        slot = getattr(p, "grouped_expert_slot", None)
        if slot is not None:
            slots.setdefault(slot[0], []).append(i)
    out = list(params)
    for positions in slots.values():
        if positions[-1] - positions[0] + 1 != len(positions):
            continue
        block = sorted((params[i] for i in positions), key=lambda p: p.grouped_expert_slot[1:], reverse=True)
        out[positions[0]:positions[-1] + 1] = block
    return out


BUFFER_LAYOUT = "expert-order-1"  # the name of this order, recorded beside every checkpoint (parallel_layout.json)


def install_expert_buffer_layout() -> bool:
    """Have ``DistributedOptimizer.compute_full_param_layout`` (what megatron-LM's ``get_model`` and megatron-core's
    DDP call to place parameters in the gradient / parameter buffers) lay the parameters out in
    :func:`expert_weights_back_to_back`'s order. Idempotent; returns True when it installed the wrapper now."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_glm5 import extensions

    record = extensions.BY_NAME["expert_buffer_layout"]
    compute = DistributedOptimizer.compute_full_param_layout
    if extensions.installed(DistributedOptimizer, "compute_full_param_layout"):
        return False

    def compute_full_param_layout(params, *args, **kwargs):
        return compute(expert_weights_back_to_back(list(params)), *args, **kwargs)

    compute_full_param_layout.wrapped = compute
    compute_full_param_layout.__doc__ = compute.__doc__
    return extensions.apply(record, staticmethod(compute_full_param_layout), owner=DistributedOptimizer,
                            attr="compute_full_param_layout")


class _StackedWeights(torch.autograd.Function):
    """``(*weights) -> [E, *w.shape]``: forward the alias of :func:`_stacked_alias` where there is one (no copy),
    else ``torch.stack``'s copy; backward ``grad.unbind(0)`` (views, as ``torch.stack``'s backward)."""

    @staticmethod
    def forward(ctx, *weights):
        return _stacked(weights)

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def stacked_weights(weights) -> torch.Tensor:
    """``torch.stack(weights)`` (``[E, *w.shape]``, differentiable w.r.t. every weight) without copying when the
    weights are back-to-back slices of one storage (:meth:`GroupedExperts.pack_expert_weights`); else the copy.

    The alias is a new tensor to autograd: in-place edits of the weights between forward and backward (which no
    training step makes) are not caught by its version counter."""
    return _StackedWeights.apply(*weights)


def main_grads_back_to_back(weights, fusion: bool, device: torch.device) -> torch.Tensor | None:
    """``[E, out, in]`` alias of the weights' ``main_grad`` s where the fused weight gradient applies to them, else
    ``None``: ``fusion`` on (their linears' ``gradient_accumulation_fusion``), every weight carrying megatron DDP's
    ``main_grad`` and ``grad_added_to_main_grad``, the main gradients back to back in one buffer (the expert buffer
    layout) and, on CUDA, fp32 (the kernel's accumulator; a 16-bit ``main_grad`` keeps DDP's add)."""
    if not fusion or not all(hasattr(w, "grad_added_to_main_grad") and getattr(w, "main_grad", None) is not None
                             for w in weights):
        return None
    grads = [w.main_grad for w in weights]
    if device.type == "cuda" and grads[0].dtype != torch.float32:
        return None
    if any(g.shape != w.shape or g.device != device for g, w in zip(grads, weights)):
        return None
    return _stacked_alias(grads)


class GroupedLinearIntoMainGrad(torch.autograd.Function):
    """``(x [T, in], offs [E], main_grads [E, out, in], *weights [out, in]) -> y [T, out]``, ``y = x @ W[e]^T`` on
    each group's rows (``torch._grouped_mm``), whose backward returns ``dx = dy @ W[e]`` and adds ``dy^T @ x`` per
    group into ``main_grads`` (:func:`megatron_glm5.kernels.grouped_wgrad.grouped_wgrad_accum`: fp32 sums, no
    host synchronisation). The weights get megatron-core's contract of a fused weight gradient: a dummy gradient
    (zeros where a weight is marked ``zero_out_wgrad``) and ``grad_added_to_main_grad = True``, so DDP's hook does
    not add it again."""

    @staticmethod
    def forward(ctx, x, offs, main_grads, *weights):
        w = _stacked(weights)                                                           # [E, out, in]
        ctx.save_for_backward(x, offs, w)
        ctx.main_grads, ctx.weights = main_grads, weights
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        from megatron_glm5.kernels.grouped_wgrad import grouped_wgrad_accum

        x, offs, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, w, offs=offs) if ctx.needs_input_grad[0] else None
        grouped_wgrad_accum(x, dy, offs, ctx.main_grads)
        zero = any(getattr(wt, "zero_out_wgrad", False) for wt in ctx.weights)
        dummy = (torch.zeros if zero else torch.empty)(w.shape, dtype=x.dtype, device=x.device)
        for wt in ctx.weights:
            wt.grad_added_to_main_grad = True
        return (dx, None, None, *dummy.unbind(0))


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
        key = object()  # this module's weights, for expert_weights_back_to_back
        for s, weights in enumerate(self.expert_weight_sets()):
            for e, w in enumerate(weights):
                w.grouped_expert_slot = (key, s, e)
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
        return x.dim() == 2 and x.shape[0] > 0 and self.takes_grouped_path(x.device, x.dtype)

    def takes_grouped_path(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether tokens on ``device`` in ``dtype`` run as grouped GEMMs (else the per-expert loop of
        ``SequentialMLP``): CUDA bf16 (or CPU under the plan's ``grouped_experts_on_cpu``), two or more local
        experts, a gated linear unit without biases, no TP inside the experts, no FP8 / FP4."""
        cfg = self.config
        if not (device.type == "cuda" or self.plan.grouped_experts_on_cpu) or not hasattr(torch, "_grouped_mm"):
            return False
        if self.num_local_experts < 2:
            return False
        if cfg.fp8 or getattr(cfg, "fp4", None) or cfg.moe_apply_probs_on_input or not cfg.gated_linear_unit:
            return False
        if self.tp_group is not None and self.tp_group.size() > 1:
            return False
        fc1, fc2 = self.local_experts[0].linear_fc1, self.local_experts[0].linear_fc2
        if getattr(fc1, "bias", None) is not None or getattr(fc2, "bias", None) is not None:
            return False
        if device.type == "cuda" and dtype != torch.bfloat16:
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
        y1 = self._grouped_linear(x, offs, fc1_weights, self.local_experts[0].linear_fc1)       # [T, 2F]
        a = self._glu(y1, permuted_probs)                                                        # [T, F]
        return self._grouped_linear(a, offs, fc2_weights, self.local_experts[0].linear_fc2), None

    @staticmethod
    def _grouped_linear(x: torch.Tensor, offs: torch.Tensor, weights, linear) -> torch.Tensor:
        """``x [T, in]`` times each group's weight ``[out, in]`` transposed -> ``[T, out]``: with the weight
        gradient added into ``main_grad`` (:class:`GroupedLinearIntoMainGrad`) where ``linear`` (the experts' fc1
        or fc2) has gradient-accumulation fusion on and :func:`main_grads_back_to_back` finds the buffer, else
        through autograd of ``torch._grouped_mm``."""
        main_grads = None
        if weights[0].dtype == x.dtype and torch.is_grad_enabled() and weights[0].requires_grad:
            main_grads = main_grads_back_to_back(weights, getattr(linear, "gradient_accumulation_fusion", False),
                                                 x.device)
        if main_grads is not None:
            return GroupedLinearIntoMainGrad.apply(x, offs, main_grads, *weights)
        w = stacked_weights(weights).transpose(1, 2)                                             # [E, in, out]
        return torch._grouped_mm(x, w.to(x.dtype), offs=offs)
