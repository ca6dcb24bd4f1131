"""The Apex / Transformer Engine extension calls megatron-core makes when one of them is installed, written on
torch, for the machines that have neither (this project's: it uses megatron-core's local modules).

Without them megatron-core falls back to per-tensor Python loops that also stop the GPU:

* **Multi-tensor L2 norm** (``get_grad_norm_fp32`` for ``--clip-grad`` and the logged grad norm, Megatron-LM's
  params norm): ``local_multi_tensor_l2_norm`` takes one ``torch.norm`` per tensor and collects them with
  ``torch.tensor(list)``, which copies each norm to the host, a GPU synchronisation per parameter tensor.
  :func:`multi_tensor_l2norm` computes them with one ``torch._foreach_norm`` and their norm on the device (the
  caller's single ``.item()`` remains).
* **Multi-tensor scale** (clipping the gradients, copying main weights to model weights): ``dst.copy_(src *
  scale)`` per tensor; :func:`multi_tensor_scale` is ``torch._foreach_mul_`` / ``_foreach_copy_``.
* **Gradient-accumulation fusion** (``config.gradient_accumulation_fusion``, Megatron-LM's default, off with
  ``--no-gradient-accumulation-fusion``): megatron-core's linears then accumulate their weight gradient straight
  into DDP's fp32 ``main_grad`` instead of writing a bf16 ``.grad`` that DDP's hook adds to ``main_grad`` (an
  element-wise pass over every weight, every micro-batch). :func:`wgrad_gemm_accum` is that GEMM with an fp32
  output accumulated in place (cuBLAS, ``torch.addmm(..., out_dtype=torch.float32)``), so the weight gradient is
  also summed without rounding it to bf16 first.

:func:`install` points megatron-core at them (only where it fell back to its local loops: an installed Apex or
Transformer Engine keeps its own); :func:`megatron_glm5.initialize.install_patches` calls it. The results equal the
local loops' up to the order of fp32 rounding.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                        per_tensor: bool, *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``amp_C.multi_tensor_l2norm``'s contract: ``(norm [1] fp32, per-tensor norms [n] fp32 or None)``, the L2 norm
    of every tensor of ``tensor_lists[0]`` taken together, on their device (no host synchronisation)."""
    tensors = tensor_lists[0]
    if not tensors:
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else None
        zero = torch.zeros(1, dtype=torch.float32, device=device)
        return zero, (zero[:0] if per_tensor else None)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))           # [n]
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, (norms if per_tensor else None)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                       scale: float) -> None:
    """``amp_C.multi_tensor_scale``'s contract: ``dst = src * scale`` for each pair of ``tensor_lists[0]`` (src) and
    ``tensor_lists[1]`` (dst), the product taken in src's dtype and cast to dst's."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad [out, in] += grad_output^T @ total_input``, ``grad_output [n, out]``, ``total_input [n, in]`` (the
    contract of Apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` / ``_fp16``). 16-bit inputs into
    an fp32 ``main_grad`` on CUDA: one cuBLAS GEMM with fp32 accumulation and output, in place; otherwise the
    product in ``main_grad``'s dtype (the CPU has no mixed-dtype GEMM)."""
    if main_grad.is_cuda and total_input.dtype != main_grad.dtype:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def describe_fusion(model_chunks) -> str:
    """One start-up line: how many linears accumulate their weight gradient into ``main_grad`` (fusion on; the
    routed experts' grouped GEMMs and the linears inside MoE CUDA graphs too) and how many leave it to DDP's hook.
    A routed expert's linear with the flag on whose tokens take the grouped GEMMs counts as fused only where they
    find the expert set's ``main_grad`` s back to back
    (:func:`~megatron_glm5.models.grouped_experts.main_grads_back_to_back`); the line says how many fall back so."""
    from megatron_glm5.models.grouped_experts import GroupedExperts, main_grads_back_to_back

    modules = [m for chunk in model_chunks for m in chunk.modules()]
    linears = [m for m in modules if isinstance(getattr(m, "gradient_accumulation_fusion", None), bool) and
               isinstance(getattr(m, "weight", None), torch.nn.Parameter)]
    falls_back = set()
    for m in (m for m in modules if isinstance(m, GroupedExperts)):
        for name, weights in zip(("linear_fc1", "linear_fc2"), m.expert_weight_sets()):
            experts = [getattr(e, name) for e in m.local_experts]
            if (experts[0].gradient_accumulation_fusion and m.takes_grouped_path(weights[0].device, weights[0].dtype)
                    and main_grads_back_to_back(weights, True, weights[0].device) is None):
                falls_back.update(id(lin) for lin in experts)
    fused = sum(m.gradient_accumulation_fusion and id(m) not in falls_back for m in linears)
    line = (f"gradient-accumulation fusion: {fused} linears add their weight gradient into main_grad in the GEMM, "
            f"{len(linears) - fused} through DDP's hook")
    if falls_back:
        line += (f" ({len(falls_back)} routed-expert linears: their main_grads are not one fp32 run in DDP's "
                 f"buffer)")
    return line


class FusedWeightGradientMlp:
    """Stands for Apex's ``fused_weight_gradient_mlp_cuda`` module in megatron-core's linears."""

    wgrad_gemm_accum_fp32 = staticmethod(wgrad_gemm_accum)  # fp32 main_grad
    wgrad_gemm_accum_fp16 = staticmethod(wgrad_gemm_accum)  # 16-bit main_grad


def install() -> List[str]:
    """Point megatron-core's fallbacks at this module's functions; returns what was replaced (idempotent; an Apex or
    Transformer Engine implementation megatron-core found is left alone)."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.tensor_parallel import layers

    from megatron_glm5 import extensions

    kernels, fusion = extensions.BY_NAME["multi_tensor_kernels"], extensions.BY_NAME["grad_accum_fusion"]
    replaced = []
    if getattr(clip_grads, "l2_norm_impl", None) in (mcore_utils.local_multi_tensor_l2_norm, multi_tensor_l2norm):
        extensions.apply(kernels, multi_tensor_l2norm, owner=clip_grads, attr="l2_norm_impl")
        replaced.append("multi_tensor_l2norm")
    for module in (clip_grads, mcore_optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) in (mcore_utils.local_multi_tensor_scale,
                                                                multi_tensor_scale):
            extensions.apply(kernels, multi_tensor_scale, owner=module, attr="multi_tensor_scale_impl")
            replaced.append(f"{module.__name__}.multi_tensor_scale")
    try:
        from megatron.training.utils import common_utils
    except ImportError:  # megatron-core without megatron.training
        common_utils = None
    if common_utils is not None and getattr(common_utils, "multi_tensor_l2norm", None) in (
            mcore_utils.local_multi_tensor_l2_norm, multi_tensor_l2norm):
        extensions.apply(kernels, multi_tensor_l2norm, owner=common_utils, attr="multi_tensor_l2norm")
        replaced.append("megatron.training multi_tensor_l2norm")
    if not layers._grad_accum_fusion_available or getattr(layers, "fused_weight_gradient_mlp_cuda", None) is \
            FusedWeightGradientMlp:
        extensions.apply(fusion, FusedWeightGradientMlp, owner=layers, attr="fused_weight_gradient_mlp_cuda")
        extensions.apply(fusion, True, owner=layers, attr="_grad_accum_fusion_available")
        replaced.append("fused_weight_gradient_mlp_cuda")
    return replaced
