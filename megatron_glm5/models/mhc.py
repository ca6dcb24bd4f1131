"""Manifold-constrained hyper-connections (mHC): one mixing site (attention or MLP) of a GLM-5.3 decoder layer.

GLM-5.3 keeps ``n = hc_mult`` residual streams per token instead of one. At every block (attention, then MLP) a
:class:`HyperConnection` reads the ``n`` streams and produces

* ``pre``  ``[s, b, n]``: weights that collapse the streams into the block input (consumed inside ``forward``);
* ``post`` ``[s, b, n]``: weights that expand the block output back onto the streams;
* ``comb`` ``[s, b, n, n]``: a (nearly) doubly-stochastic matrix (Sinkhorn-Knopp) that mixes the input streams
  into the output streams.

The caller then forms the new streams with :func:`apply_hyper_connection_output`::

    new[.., j, :] = post[.., j] * block_out + sum_i comb[.., i, j] * streams[.., i, :]

Stream layout between layers
----------------------------
Between decoder layers (and across pipeline stages) the streams travel as a plain ``[s, b, n * h]`` tensor,
stream-major along the last dim (``x.view(s, b, n, h)`` recovers them). Pipeline send/recv therefore only sees a
wider hidden size (``n * h``), and sequence-parallel scatter/gather along ``s`` needs no special case. Use
:func:`expand_streams` after the embedding (``n`` identical copies), :func:`streams_view` inside a layer, and
:func:`contract_streams` (mean over streams) before the final norm -- exactly HF's ``Glm5NextTextModel``.

Numerics follow HF's ``Glm5NextTextHyperConnection`` exactly: the weight computation runs in fp32 (``fn`` is read
as fp32; ``base`` and ``scale`` are fp32 parameters and carry ``keep_fp32 = True`` because rounding them to bf16
changes the model), the collapsed block input is cast back to the streams' dtype.

Parallelism: the three parameters are replicated over tensor parallelism. Under sequence parallelism each TP rank
sees a different slice of ``s``, so their gradients are partial sums; the parameters carry
``sequence_parallel = config.sequence_parallel`` so megatron-core's ``finalize_model_grads`` all-reduces them over
TP (the same treatment as layer-norm weights).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.transformer.module import MegatronModule

from megatron_glm5.execution_plan import plan_of
from megatron_glm5.kernels.sinkhorn import sinkhorn_reference
from megatron_glm5.models.sharding import replicated_sharded_state_dict

__all__ = [
    "HyperConnection",
    "apply_hyper_connection_output",
    "expand_streams",
    "contract_streams",
    "streams_view",
    "sinkhorn_normalize",
]


# ----------------------------------------------------------------------------------------------- stream layout
def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, h]`` -> ``[s, b, n * h]``: ``n`` identical copies of ``x`` (the streams entering layer 0)."""
    s, b, h = x.shape
    return x.unsqueeze(2).expand(s, b, n, h).reshape(s, b, n * h)


def streams_view(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, n * h]`` -> ``[s, b, n, h]`` (a view when ``x`` is contiguous in its last dim)."""
    s, b, nh = x.shape
    if nh % n:
        raise ValueError(f"streams_view: last dim {nh} is not divisible by hc_mult {n}")
    return x.reshape(s, b, n, nh // n)


def contract_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, n * h]`` -> ``[s, b, h]``: the unweighted mean over streams (HF ``Glm5NextTextHyperHead``)."""
    return streams_view(x, n).mean(dim=2)


# ----------------------------------------------------------------------------------------------- Sinkhorn
class _SinkhornRecompute(torch.autograd.Function):
    """Sinkhorn normalisation that saves only its input and re-runs the iterations in backward.

    The backward replays exactly the same ops through autograd, so values and gradients are bitwise equal to the
    plain version; it only avoids keeping ``2 * iters`` intermediate ``[s, b, n, n]`` tensors alive.
    """

    @staticmethod
    def forward(ctx, comb, iters, eps):
        ctx.iters, ctx.eps = iters, eps
        ctx.save_for_backward(comb)
        with torch.no_grad():
            return sinkhorn_reference(comb, iters, eps)

    @staticmethod
    def backward(ctx, grad_out):
        (comb,) = ctx.saved_tensors
        with torch.enable_grad():
            x = comb.detach().requires_grad_(True)
            y = sinkhorn_reference(x, ctx.iters, ctx.eps)
            (grad_in,) = torch.autograd.grad(y, x, grad_out)
        return grad_in, None, None


def sinkhorn_normalize(comb: torch.Tensor, iters: int, eps: float, recompute: bool = True,
                       fused: bool = False) -> torch.Tensor:
    """HF's Sinkhorn-Knopp on the last two dims of ``comb``; ``recompute`` trades memory for a backward replay.

    With ``fused`` (the plan's ``mhc_fused``) on a CUDA fp32 ``comb`` the whole iteration runs as one Triton kernel
    forward and one backward (``megatron_glm5/kernels/sinkhorn.py``, which saves only the input, like
    ``recompute``)."""
    if fused and comb.is_cuda and comb.dtype == torch.float32:
        from megatron_glm5.kernels import sinkhorn

        return sinkhorn.sinkhorn(comb, iters, eps)
    if recompute and torch.is_grad_enabled() and comb.requires_grad:
        return _SinkhornRecompute.apply(comb, iters, eps)
    return sinkhorn_reference(comb, iters, eps)


# ----------------------------------------------------------------------------------------------- module
class HyperConnection(MegatronModule):
    """One mHC site. ``forward(streams [s, b, n, h]) -> (post [s, b, n] fp32, comb [s, b, n, n] fp32,
    collapsed [s, b, h] in streams' dtype)``; ``forward(streams, pass_streams=True)`` adds the streams for the
    site's output side (:func:`apply_hyper_connection_output`) as a fourth value: the input itself, or, on the fused
    path with ``config.mhc_stream_grad_fusion``, a view whose gradient the fused input-side backward adds in its
    projection kernel (one pass over the streams gradient fewer than autograd adding the two).

    Parameters (HF names, under ``...attn_hc.`` / ``...ffn_hc.``): ``fn`` ``[(2 + n) * n, n * h]`` (used in fp32),
    ``base`` ``[(2 + n) * n]`` fp32 and ``scale`` ``[3]`` fp32 (both ``keep_fp32 = True``).

    ``recompute_sinkhorn`` (default ``True``, also read from ``config.hc_recompute_sinkhorn`` when present) saves
    activation memory with bitwise-identical results.

    On CUDA tensors, with the execution plan's ``mhc_fused`` (``self.plan``), the forward runs through the fused
    kernels of ``megatron_glm5/kernels/mhc.py`` (the same function to fp32 rounding); otherwise the PyTorch ops below.
    """

    def __init__(self, config, layer_number: Optional[int] = None, recompute_sinkhorn: Optional[bool] = None):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.hc_mult = n = int(config.hc_mult)
        self.hidden_size = int(config.hidden_size)
        self.hc_eps = float(config.hc_eps)
        self.hc_sinkhorn_iters = int(config.hc_sinkhorn_iters)
        self.norm_eps = float(config.layernorm_epsilon)
        if recompute_sinkhorn is None:
            recompute_sinkhorn = bool(getattr(config, "hc_recompute_sinkhorn", True))
        self.recompute_sinkhorn = recompute_sinkhorn
        self.plan = plan_of(config)

        out = (2 + n) * n
        fn_dtype = getattr(config, "params_dtype", torch.float32) or torch.float32
        self.fn = nn.Parameter(torch.empty(out, n * self.hidden_size, dtype=fn_dtype))
        self.base = nn.Parameter(torch.empty(out, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.reset_parameters()

        sp = bool(getattr(config, "sequence_parallel", False))
        for p in (self.fn, self.base, self.scale):
            setattr(p, "sequence_parallel", sp)  # replicated over TP; grads all-reduced over TP under SP
        for p in (self.base, self.scale):
            setattr(p, "keep_fp32", True)

    @torch.no_grad()
    def reset_parameters(self):
        """HF's init: fn ~ N(0, 0.02), base = 0, scale = 1 (nothing on the meta device: a meta ``normal_`` imports
        torch's reference ops, about 1 s of a checkpoint converter's start)."""
        if self.fn.is_meta:
            return
        self.fn.normal_(mean=0.0, std=0.02)
        self.base.zero_()
        self.scale.fill_(1.0)

    def compute_weights(self, streams: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [.., n, h]`` -> fp32 ``(pre [.., n], post [.., n], comb [.., n, n])``."""
        n = self.hc_mult
        lead = streams.shape[:-2]
        x = streams.reshape(*lead, n * streams.shape[-1]).float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        mixes = F.linear(x, self.fn.float())
        return self.weights_from_mixes(mixes, self.base, self.scale)

    def weights_from_mixes(self, mixes: torch.Tensor, base: torch.Tensor,
                           scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 ``mixes [.., (2 + n) n]`` (the normalised projection) -> ``(pre, post, comb)``; ``base`` / ``scale``
        are passed in (not read from ``self``) so the fused path can replay this map under autograd. On CUDA with
        the fused kernels on, the whole map is one Triton kernel each way (``kernels/sinkhorn.py: mhc_weights``)."""
        n = self.hc_mult
        if self.plan.mhc_fused and mixes.dtype == torch.float32 and mixes.is_cuda:
            from megatron_glm5.kernels.sinkhorn import mhc_weights

            return mhc_weights(mixes, base, scale, n, self.hc_sinkhorn_iters, self.hc_eps)
        lead = mixes.shape[:-1]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        base = base.float()
        scale = scale.float()
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre_s, post_s, comb_s = scale.unbind(0)

        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = comb_w.view(*lead, n, n) * comb_s + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = sinkhorn_normalize(comb, self.hc_sinkhorn_iters, self.hc_eps, recompute=self.recompute_sinkhorn,
                                  fused=self.plan.mhc_fused)
        return pre, post, comb

    def forward(self, streams: torch.Tensor, pass_streams: bool = False) -> tuple:
        if streams.dim() != 4 or streams.shape[-2] != self.hc_mult:
            raise ValueError(
                f"HyperConnection expects streams [s, b, {self.hc_mult}, h], got {tuple(streams.shape)} "
                "(use streams_view(x, hc_mult) on the flat [s, b, n*h] layout)")
        if self.plan.mhc_fused and streams.is_cuda:
            from megatron_glm5.kernels import mhc as fused

            fuse = pass_streams and self.plan.mhc_stream_grad_fusion
            out = fused.hyper_connection(streams, self.fn, self.base, self.scale, self.weights_from_mixes,
                                         self.norm_eps, pass_streams=fuse)
            return out if fuse or not pass_streams else (*out, streams)
        pre, post, comb = self.compute_weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return (post, comb, collapsed, streams) if pass_streams else (post, comb, collapsed)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """All three parameters are replicated over TP (and DP)."""
        return replicated_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def extra_repr(self):
        return (f"hc_mult={self.hc_mult}, hidden_size={self.hidden_size}, sinkhorn_iters={self.hc_sinkhorn_iters}, "
                f"hc_eps={self.hc_eps}, norm_eps={self.norm_eps}")


def apply_hyper_connection_output(block_out: torch.Tensor, residual_streams: torch.Tensor, post: torch.Tensor,
                                  comb: torch.Tensor, fused: Optional[bool] = None) -> torch.Tensor:
    """New streams ``[s, b, n, h]`` = ``post[.., j] * block_out + sum_i comb[.., i, j] * residual_streams[.., i, :]``
    (HF's decoder-layer formula; ``post``/``comb`` are cast to the activations' dtype first).

    ``fused`` (default: the process plan's ``mhc_fused`` on CUDA tensors) runs one Triton kernel forward and one
    backward instead, in fp32 with a single rounding to the streams' dtype (``megatron_glm5.kernels.mhc.apply_output``)."""
    if fused is None:
        fused = plan_of(None).mhc_fused and residual_streams.is_cuda
    if fused:
        from megatron_glm5.kernels import mhc as fused_mhc

        return fused_mhc.apply_output(block_out, residual_streams, post, comb)
    dtype = residual_streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), residual_streams)
