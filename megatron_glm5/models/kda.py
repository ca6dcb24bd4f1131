"""Kimi Delta Attention (KDA), the linear-attention mixer of GLM-5.3-Flash, as a megatron-core module.

Layouts used in this file:

* megatron activations: ``[s, b, h]`` (sequence first);
* the delta-rule core: ``[b, s, H, D]`` (batch first, heads, head dim), ``beta`` ``[b, s, H]``;
* the short convolution: ``[b, s, c]`` with a depthwise weight ``[c, W]`` (``W`` = kernel width).

A *packed row* is ``b = 1`` with megatron-core ``PackedSeqParams``; ``cu_seqlens`` (int32 ``[n_docs + 1]``) gives
the document boundaries. Both the convolution state and the recurrent ``[K, V]`` state restart at every
document boundary, so a packed row gives exactly what running HF's ``Glm5NextTextLinearAttention`` on every
document separately gives. Without ``PackedSeqParams`` every batch row is one document.

Three backends compute the layer: ``'torch'`` (:func:`~megatron_glm5.kernels.kda.chunk_kda_torch`, a chunked WY
form in plain PyTorch, runs anywhere and is differentiable by autograd), ``'fla'`` (flash-linear-attention
``chunk_kda`` for the delta rule only, the rest of the layer in PyTorch) and ``'fla_fused'`` (the GPU fast path: the
short convolution with SiLU and document resets as our Triton kernel, ``kernels/short_conv.py``, or FLA's with
``kda_conv_kernel='fla'``, ``chunk_kda`` with the forget gate, ``sigmoid(beta)`` and the q/k L2 norm computed inside
its kernels, and FLA's fused gated RMSNorm; CUDA + triton, imported lazily). The fast path keeps the reference
numerics (fp32 convolution, gates and norms); it is tested against ``'torch'`` on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from megatron_glm5.execution_plan import plan_of
from megatron_glm5.models.linear import linear_output
from megatron_glm5.models.params import param_device
from megatron_glm5.config import Glm5Config
from megatron_glm5.kernels.kda import chunk_kda_fla, chunk_kda_torch, l2norm, recurrent_kda_reference
from megatron_glm5.kernels.short_conv import causal_depthwise_conv1d, short_conv_silu
from megatron_glm5.models.packing import fla_cu_seqlens, row_cu_seqlens, row_document_starts
from megatron_glm5.models.context_parallel import cp_group_of, sequence_layout
from megatron_glm5.models.kda_cp import cp_causal_depthwise_conv1d, cp_chunk_kda

__all__ = [
    "l2norm",
    "causal_depthwise_conv1d",
    "chunk_kda_torch",
    "chunk_kda_fla",
    "recurrent_kda_reference",
    "KDAGatedRMSNorm",
    "KimiDeltaAttentionSubmodules",
    "KimiDeltaAttention",
    "get_kda_module_spec",
]


# ============================================================================ megatron module
class KDAGatedRMSNorm(nn.Module):
    """Per-head RMSNorm over the head dim, times ``sigmoid(gate)``, all in fp32 (HF ``Glm5NextTextRMSNormGated``).

    ``forward(x [..., D], gate [..., D], weight=None) -> [..., D]`` in ``x.dtype``; ``weight`` overrides
    ``self.weight`` (the module passes a TP-gradient-reduced view of it).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = weight.float() * x * torch.sigmoid(gate.float())
        return x.to(dtype)


@dataclass
class KimiDeltaAttentionSubmodules:
    """Linear layers of :class:`KimiDeltaAttention` (a ``ModuleSpec`` or a class each).

    q/k/v/f_b/g_b/b_proj: column-parallel (output split over heads); f_a/g_a_proj: replicated ``[h -> D]``
    (built as ``cls(in, out, bias=False, device=, dtype=)``); o_proj: row-parallel.
    """

    q_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    k_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    v_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    f_a_proj: Union[ModuleSpec, type] = nn.Linear
    f_b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    g_a_proj: Union[ModuleSpec, type] = nn.Linear
    g_b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    o_proj: Union[ModuleSpec, type] = RowParallelLinear


class KimiDeltaAttention(MegatronModule):
    """Kimi Delta Attention: ``[s, b, h] -> [s, b, h]`` (HF ``Glm5NextTextLinearAttention``).

    q, k, v = SiLU(causal depthwise conv(W x)); forget gate ``g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``
    (or ``-exp(A_log) * softplus(f + dt_bias)`` when ``linear_lower_bound`` is None) with ``f = f_b(f_a(x))``;
    ``beta = sigmoid(b_proj(x))``; o = delta rule over L2-normalised q, k; out = o_proj(RMSNorm_D(o) *
    sigmoid(g_b(g_a(x)))). Heads are split over tensor parallelism (``linear_num_heads / tp`` local heads).

    Parameter names mirror the HF checkpoint (``model.language_model.layers.{i}.self_attn.<name>``) except that
    HF fuses the three convolutions into ``conv1d.weight`` ``[3 H D, 1, W]`` (= cat(q, k, v)) and keeps
    ``f_a_proj`` / ``f_b_proj`` / ``A_log`` / ``dt_bias`` under ``forget_gate.``.
    ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (``[H D / tp, 1, W]``), ``A_log`` (``[H / tp]``) and ``dt_bias``
    (``[H D / tp]``) are fp32 and stay fp32 when the module is cast (attribute ``keep_fp32``).
    Context parallelism (contiguous chunks of a packed row): the conv inputs and the recurrent state at the chunk's
    left edge come from earlier CP ranks (:mod:`megatron_glm5.models.kda_cp`, around the per-rank kernel call).
    """

    def __init__(self, config: Glm5Config, submodules: KimiDeltaAttentionSubmodules, layer_number: int,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config)
        self.config = config
        self.layer_number = layer_number
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.tp_size = pg_collection.tp.size()
        self.cp_group = cp_group_of(pg_collection)
        self.cp_size = 1 if self.cp_group is None else self.cp_group.size()

        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        if self.num_heads % self.tp_size:
            raise ValueError(f"linear_num_heads ({self.num_heads}) must be divisible by the tensor-parallel size "
                             f"({self.tp_size})")
        self.num_heads_local = self.num_heads // self.tp_size
        self.kda_dim = self.num_heads * self.head_dim
        self.kda_dim_local = self.num_heads_local * self.head_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.lower_bound = config.linear_lower_bound
        self.chunk_size = config.kda_chunk_size
        plan = plan_of(config)  # the backend, its conv kernel (FLA's for more than MAX_TAPS taps) and what it keeps
        self.save_intermediates = plan.kda_save_intermediates
        self.conv_kernel_name = plan.kda_conv_kernel
        self.backend = plan.kda_backend
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp_size > 1
        device = param_device(config)

        def column(spec, in_size, out_size):
            return build_module(spec, in_size, out_size, config=config, init_method=config.init_method,
                                gather_output=False, bias=False, skip_bias_add=True, is_expert=False,
                                tp_group=self.tp_group)

        def replicated(spec, in_size, out_size):
            return build_module(spec, in_size, out_size, bias=False, device=device, dtype=config.params_dtype)

        h, D, HD = self.hidden_size, self.head_dim, self.kda_dim
        submodules = submodules if submodules is not None else KimiDeltaAttentionSubmodules()
        self.q_proj = column(submodules.q_proj, h, HD)
        self.k_proj = column(submodules.k_proj, h, HD)
        self.v_proj = column(submodules.v_proj, h, HD)
        self.f_a_proj = replicated(submodules.f_a_proj, h, D)
        self.f_b_proj = column(submodules.f_b_proj, D, HD)
        self.b_proj = column(submodules.b_proj, h, self.num_heads)
        self.g_a_proj = replicated(submodules.g_a_proj, h, D)
        self.g_b_proj = column(submodules.g_b_proj, D, HD)
        self.o_norm = KDAGatedRMSNorm(D, eps=config.layernorm_epsilon, device=device, dtype=config.params_dtype)
        self.o_proj = build_module(submodules.o_proj, HD, h, config=config,
                                   init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                   skip_bias_add=True, is_expert=False, tp_group=self.tp_group)

        def fp32_param(*shape):
            p = nn.Parameter(torch.empty(*shape, device=device, dtype=torch.float32))
            set_tensor_model_parallel_attributes(p, True, 0, 1)
            p.keep_fp32 = True
            return p

        self.q_conv1d = fp32_param(self.kda_dim_local, 1, self.conv_kernel)
        self.k_conv1d = fp32_param(self.kda_dim_local, 1, self.conv_kernel)
        self.v_conv1d = fp32_param(self.kda_dim_local, 1, self.conv_kernel)
        self.A_log = fp32_param(self.num_heads_local)
        self.dt_bias = fp32_param(self.kda_dim_local)
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self):
        """HF ``_init_weights``: conv ~ N(0, init_method_std); A_log = 0 (bounded gate) or log U(1, 16);
        dt_bias = inverse-softplus of a log-uniform value in [1e-3, 1e-1]; o_norm = 1; f_a/g_a via init_method.
        The TP-sharded tensors draw from megatron's model-parallel RNG (different per TP rank)."""
        if not self.config.perform_initialization:
            return
        with get_cuda_rng_tracker().fork():
            for w in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
                w.normal_(0.0, self.config.init_method_std)
            if self.lower_bound is not None:
                self.A_log.zero_()
            else:
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        for lin in (self.f_a_proj, self.g_a_proj):
            self.config.init_method(lin.weight)
        self.o_norm.weight.fill_(1.0)

    def _apply(self, fn, recurse=True):
        """Keep the ``keep_fp32`` parameters (and their grads) in fp32 across ``.to(dtype)`` / ``.bfloat16()``;
        device moves still apply."""
        keep = set()
        for p in self._parameters.values():
            if p is not None and getattr(p, "keep_fp32", False):
                keep.add(id(p))
                if p.grad is not None:
                    keep.add(id(p.grad))
        if not keep:
            return super()._apply(fn, recurse)

        def fn_keep(t):
            out = fn(t)
            if id(t) in keep and out.is_floating_point() and out.dtype != t.dtype:
                return t.to(device=out.device)
            return out

        return super()._apply(fn_keep, recurse)

    # ------------------------------------------------------------------ forward
    def _replicated_linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """f_a / g_a on the (possibly sequence-parallel) input. Under sequence parallelism each rank only sees its
        slice of the sequence, so the replicated weight's gradient is summed over the TP group in backward."""
        if self.sequence_parallel:
            w = copy_to_tensor_model_parallel_region(module.weight, group=self.tp_group)
            return F.linear(x, w)
        return linear_output(module(x))

    def _forget_gate(self, f: torch.Tensor) -> torch.Tensor:
        """``f`` [..., H_local * D] -> log decay ``g`` [..., H_local, D] (fp32)."""
        g = (f.float() + self.dt_bias.float()).view(*f.shape[:-1], self.num_heads_local, self.head_dim)
        a = torch.exp(self.A_log.float())[:, None]  # [H_local, 1]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(a * g)
        return -a * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, **kwargs):
        """``hidden_states`` ``[s, b, h]`` (``[s / tp, b, h]`` under sequence parallelism) -> ``(out [s, b, h],
        None)``. ``packed_seq_params.cu_seqlens_q`` (``b = 1``) marks document boundaries; ``attention_mask`` is
        ignored (the mixer is causal by construction)."""
        if self.backend == "fla_fused" and getattr(self, "cp_size", 1) == 1:
            return self._forward_fla_fused(hidden_states, packed_seq_params)
        # (under context parallelism 'fla_fused' takes this path with FLA's chunk_kda as the core)
        x = hidden_states
        q = linear_output(self.q_proj(x))  # [s, b, H_l * D]
        k = linear_output(self.k_proj(x))
        v = linear_output(self.v_proj(x))
        s, b = q.shape[:2]
        cu = None
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q is not None:
            if b != 1:
                raise ValueError(f"packed rows need batch size 1, got {b}")
            cu = row_cu_seqlens(packed_seq_params, s, q.device)
        # context parallelism: this rank holds one contiguous chunk of the row (models/kda_cp.py)
        cp_layout = None
        if self.cp_size > 1:
            cp_layout = sequence_layout(packed_seq_params, s, q.device, self.cp_group)
        act_dtype = q.dtype

        def conv(t, w):  # [s, b, c] -> [b, s, H_l, D]
            t = t.transpose(0, 1)
            y = causal_depthwise_conv1d(t, w, cu) if cp_layout is None else cp_causal_depthwise_conv1d(t, w, cp_layout)
            y = F.silu(y).to(act_dtype)
            return y.view(b, s, self.num_heads_local, self.head_dim)

        q, k, v = conv(q, self.q_conv1d), conv(k, self.k_conv1d), conv(v, self.v_conv1d)
        g = self._forget_gate(linear_output(self.f_b_proj(self._replicated_linear(self.f_a_proj, x)))).transpose(0, 1)
        beta = torch.sigmoid(linear_output(self.b_proj(x))).transpose(0, 1)  # [b, s, H_l]

        core = chunk_kda_fla if self.backend in ("fla", "fla_fused") else chunk_kda_torch
        if cp_layout is None:
            o = core(q, k, v, g, beta, scale=self.head_dim ** -0.5, cu_seqlens=cu, chunk_size=self.chunk_size,
                     use_qk_l2norm=True)  # [b, s, H_l, D]
        else:
            o = cp_chunk_kda(core, q, k, v, g, beta, self.head_dim ** -0.5, cp_layout, self.chunk_size)

        gate = linear_output(self.g_b_proj(self._replicated_linear(self.g_a_proj, x)))
        gate = gate.view(s, b, self.num_heads_local, self.head_dim)
        w = self.o_norm.weight
        if self.tp_size > 1:  # each rank normalises its own heads: sum the norm weight's gradient over TP
            w = copy_to_tensor_model_parallel_region(w, group=self.tp_group)
        o = self.o_norm(o.transpose(0, 1), gate, weight=w).reshape(s, b, self.kda_dim_local)
        out, bias = self.o_proj(o)
        return out, bias

    def _forward_fla_fused(self, x: torch.Tensor, packed_seq_params: Optional[PackedSeqParams]):
        """``kda_backend='fla_fused'``: the same function as :meth:`forward` with FLA's fused kernels around
        ``chunk_kda`` (see the module docstring). ``x [s, b, h]`` -> ``(out [s, b, h], bias)``."""
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda import chunk_kda

        q_lin = linear_output(self.q_proj(x))                                      # [s, b, H_l * D] (full s)
        s, b = q_lin.shape[:2]
        H, D = self.num_heads_local, self.head_dim
        cu = cu_cpu = None
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q is not None:
            if b != 1:
                raise ValueError(f"packed rows need batch size 1, got {b}")
            cu, cu_cpu = fla_cu_seqlens(packed_seq_params, s, x.device)

        def batch_first(t):  # [s, b, c] -> [b, s, c] (a free view for b = 1)
            return t.view(1, s, t.shape[-1]) if b == 1 else t.transpose(0, 1).contiguous()

        if self.conv_kernel_name == "triton":
            starts = row_document_starts(packed_seq_params if cu is not None else None, s, x.device)

        def conv(t, w):  # SiLU(causal conv) in fp32 inside the kernel, output in the activation dtype
            if self.conv_kernel_name == "triton":
                return short_conv_silu(batch_first(t), w, starts).view(b, s, H, D)
            y, _ = causal_conv1d(x=batch_first(t), weight=w.squeeze(1), activation="silu", cu_seqlens=cu,
                                 cu_seqlens_cpu=cu_cpu)
            return y.view(b, s, H, D)

        q = conv(q_lin, self.q_conv1d)
        k = conv(linear_output(self.k_proj(x)), self.k_conv1d)
        v = conv(linear_output(self.v_proj(x)), self.v_conv1d)
        f = batch_first(linear_output(self.f_b_proj(self._replicated_linear(self.f_a_proj, x)))).view(b, s, H, D)
        beta = batch_first(linear_output(self.b_proj(x)))                          # [b, s, H] logits
        lb = self.lower_bound
        o, _ = chunk_kda(q=q, k=k, v=v, g=f, beta=beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=lb,
                         safe_gate=lb is not None and -5.0 <= lb < 0.0, use_beta_sigmoid_in_kernel=True,
                         cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, disable_recompute=self.save_intermediates,
                         chunk_size=self.chunk_size if self.chunk_size in (32, 64) else 64)
        gate = batch_first(linear_output(self.g_b_proj(self._replicated_linear(self.g_a_proj, x))))
        w = self.o_norm.weight
        if self.tp_size > 1:  # each rank normalises its own heads: sum the norm weight's gradient over TP
            w = copy_to_tensor_model_parallel_region(w, group=self.tp_group)
        o = rms_norm_gated(o.reshape(b * s * H, D), gate.reshape(b * s * H, D), w, None, activation="sigmoid",
                           eps=self.o_norm.eps)
        o = o.view(b, s, H * D)
        o = o.view(s, 1, H * D) if b == 1 else o.transpose(0, 1).contiguous()
        return self.o_proj(o)

    # ------------------------------------------------------------------ checkpointing
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Conv weights, A_log and dt_bias are TP-sharded along dim 0; the parallel linears shard themselves;
        f_a_proj, g_a_proj and o_norm are replicated."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            own, prefix, {name: 0 for name in ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias")},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=self.tp_group))
        return sharded


def get_kda_module_spec() -> ModuleSpec:
    """``ModuleSpec`` of :class:`KimiDeltaAttention` with megatron-core's local parallel linears."""
    return ModuleSpec(module=KimiDeltaAttention, submodules=KimiDeltaAttentionSubmodules(
        q_proj=ColumnParallelLinear, k_proj=ColumnParallelLinear, v_proj=ColumnParallelLinear,
        f_a_proj=nn.Linear, f_b_proj=ColumnParallelLinear, b_proj=ColumnParallelLinear,
        g_a_proj=nn.Linear, g_b_proj=ColumnParallelLinear, o_proj=RowParallelLinear))
