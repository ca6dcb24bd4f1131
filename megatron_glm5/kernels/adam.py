"""One Adam / AdamW step of one fp32 main weight that also writes the model's 16-bit copy of it (Triton on CUDA),
with its PyTorch reference.

Tensors (same number of elements ``n``, fp32, contiguous, updated in place): ``param`` (the fp32 main weight: a
distributed-optimizer shard), ``grad`` (its fp32 main gradient: a view of DDP's buffer, read only), ``exp_avg`` and
``exp_avg_sq`` (Adam's moments). ``out`` (optional, ``n`` elements of any float dtype, contiguous): the model weight
the updated ``param`` is copied into (the bf16 shard in DDP's param buffer), or None.

Per element, in fp32, torch's single-tensor Adam (``torch.optim.Adam`` / ``AdamW``) with the gradient first
multiplied by ``grad_scale`` (the ``--clip-grad`` coefficient, 1 when the norm is within the bound)::

    g = grad * grad_scale
    decoupled: p = p * (1 - lr * wd)            else: g = g + wd * p
    m = lerp(m, g, 1 - beta1)                   v = v * beta2 + (1 - beta2) * g * g
    p = p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps)
    out = p (rounded to out's dtype)

``step_size = lr / (1 - beta1 ** step)`` and ``bias_correction2_sqrt = sqrt(1 - beta2 ** step)`` are computed on the
host in double, as torch's single-tensor Adam does (its ``step`` counters stay on the host). The gradient is not
written.

Against megatron-core's optimizer step on the torch Adam fallback (``grads *= clip`` in a pass of its own, the Adam
step, then a copy of every main weight into the model's weights) this reads and writes 30 bytes an element instead
of 42: the clip's read and write of the gradient and the copy's read of the main weight go.

Kernel: a 1-D grid of ``BLOCK`` elements a program, int64 offsets; elements are independent.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["AdamScalars", "adam_step", "adam_step_reference"]

BLOCK = 1024
"""Elements per program (8 fp32 a thread at 4 warps: two 16-byte loads per tensor)."""
NUM_WARPS = 4


class AdamScalars:
    """The step's host scalars (Python floats; fp32 when they reach the kernel)."""

    def __init__(self, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
                 step: float, grad_scale: float = 1.0):
        self.lr, self.beta1, self.beta2, self.eps = float(lr), float(beta1), float(beta2), float(eps)
        self.weight_decay, self.decoupled, self.grad_scale = float(weight_decay), bool(decoupled), float(grad_scale)
        self.step_size = self.lr / (1 - self.beta1 ** step)
        self.bias_correction2_sqrt = (1 - self.beta2 ** step) ** 0.5
        self.decay_factor = 1 - self.lr * self.weight_decay


# ============================================================================ PyTorch reference
@torch.no_grad()
def adam_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        s: AdamScalars, out: Optional[torch.Tensor] = None) -> None:
    """The module docstring's step with torch operations (any device and dtype; torch's single-tensor Adam's
    operations in its order)."""
    g = grad * s.grad_scale if s.grad_scale != 1.0 else grad
    if s.weight_decay != 0:
        if s.decoupled:
            param.mul_(s.decay_factor)
        else:
            g = g.add(param, alpha=s.weight_decay)
    exp_avg.lerp_(g, 1 - s.beta1)
    exp_avg_sq.mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
    denom = (exp_avg_sq.sqrt() / s.bias_correction2_sqrt).add_(s.eps)
    param.addcdiv_(exp_avg, denom, value=-s.step_size)
    if out is not None:
        out.copy_(param.view(out.shape))


# ============================================================================ Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _adam_kernel(P, G, M, V, OUT, n, grad_scale, decay_factor, weight_decay, lerp_weight, beta2, one_minus_beta2,
                     eps, step_size, bias_correction2_sqrt, DECOUPLED: tl.constexpr, HAS_WD: tl.constexpr,
                     LERP_FROM_START: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        ok = offs < n
        p = tl.load(P + offs, mask=ok, other=0.0)
        g = tl.load(G + offs, mask=ok, other=0.0) * grad_scale
        m = tl.load(M + offs, mask=ok, other=0.0)
        v = tl.load(V + offs, mask=ok, other=0.0)
        if HAS_WD:
            if DECOUPLED:
                p = p * decay_factor
            else:
                g = g + weight_decay * p
        if LERP_FROM_START:  # torch's lerp: the form exact at the end nearer the weight
            m = m + lerp_weight * (g - m)
        else:
            m = g - (g - m) * (1.0 - lerp_weight)
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(P + offs, p, mask=ok)
        tl.store(M + offs, m, mask=ok)
        tl.store(V + offs, v, mask=ok)
        if HAS_OUT:
            tl.store(OUT + offs, p.to(OUT.dtype.element_ty), mask=ok)


def _launch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            s: AdamScalars, out: Optional[torch.Tensor]) -> None:
    """Run the Triton kernel (on whatever device Triton targets; its interpreter takes CPU tensors)."""
    n = param.numel()
    if not n:
        return
    _adam_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, out if out is not None else param, n, s.grad_scale, s.decay_factor,
        s.weight_decay, 1 - s.beta1, s.beta2, 1 - s.beta2, s.eps, s.step_size, s.bias_correction2_sqrt,
        DECOUPLED=s.decoupled, HAS_WD=s.weight_decay != 0, LERP_FROM_START=(1 - s.beta1) < 0.5,
        HAS_OUT=out is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


def kernel_applies(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   out: Optional[torch.Tensor]) -> bool:
    """Whether :func:`adam_step` takes the Triton kernel for these tensors: CUDA, fp32 and contiguous, ``out``
    (if any) contiguous on the same device with as many elements."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if not (HAVE_TRITON and param.is_cuda):
        return False
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device != param.device or
           t.numel() != param.numel() for t in tensors):
        return False
    return out is None or (out.is_contiguous() and out.device == param.device and out.numel() == param.numel()
                           and out.is_floating_point())


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              s: AdamScalars, out: Optional[torch.Tensor] = None) -> None:
    """:func:`adam_step_reference` as one Triton kernel where :func:`kernel_applies`; the reference elsewhere."""
    if kernel_applies(param, grad, exp_avg, exp_avg_sq, out):
        _launch(param, grad, exp_avg, exp_avg_sq, s, out)
    else:
        adam_step_reference(param, grad, exp_avg, exp_avg_sq, s, out)
