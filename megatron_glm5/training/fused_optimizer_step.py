"""The optimizer step of megatron-core's distributed optimizer on its torch Adam fallback in one pass per main
weight: the ``--clip-grad`` coefficient, the Adam / AdamW update and the write of the model's 16-bit weight
(``kernels/adam.py``: a Triton kernel on CUDA, its PyTorch reference elsewhere).

megatron-core's step reads and writes every main weight's data three times: ``clip_grad_by_total_norm_fp32``
scales the fp32 main gradients in place, the inner ``torch.optim.Adam`` / ``AdamW`` updates the fp32 main weights
and moments, and ``_copy_main_params_to_model_params`` copies each main weight into its slice of DDP's param
buffer (a Python loop of one copy per parameter). Installed on a ``DistributedOptimizer`` (:func:`install`):

* the inner optimizer's class becomes :class:`FusedStepAdam` / :class:`FusedStepAdamW` (subclasses of torch's:
  the same param groups, state and checkpoints); its ``step`` runs :func:`~megatron_glm5.kernels.adam.adam_step`
  per main weight with the gradient multiplied by ``grad_scale`` and writes the updated weight into the model's
  slice of the param buffer;
* megatron-core's ``clip_grad_by_total_norm_fp32``, called with exactly the main weights of such an optimizer,
  sets that optimizer's ``grad_scale`` to the clip coefficient instead of scaling the gradients (any other call
  scales them as before); every ``step`` until the weights are copied uses it, so an update tried on copies of the
  weights (:func:`~megatron_glm5.training.optimizer.update_keeps_weights_within`) is the update that is made;
* the optimizer's ``_copy_main_params_to_model_params`` returns at once after such a step (the weights are
  written) and resets ``grad_scale`` to 1; after a checkpoint load it copies as before.

The update is torch's single-tensor Adam's arithmetic in fp32 with its ``step`` counters on the host (the
reference is bitwise torch's single-tensor step on the same gradients; the kernel differs by fp32 rounding).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from megatron_glm5.kernels.adam import AdamScalars, adam_step

__all__ = ["FusedStepAdam", "FusedStepAdamW", "fused_step", "install"]

_OWNER = "_glm5_fused_step_owner"
"""Attribute of a main weight: a weak reference to the :class:`_FusedStep` optimizer that updates it."""


class _FusedStep:
    """``step`` of :class:`FusedStepAdam` / :class:`FusedStepAdamW` (mixed in before torch's class)."""

    grad_scale: float = 1.0
    """Factor of every gradient in the next steps (the clip coefficient of this iteration; 1 when not clipped)."""
    model_weights: Optional[dict] = None
    """Main weight -> ``(bucket, start, end)``: its model weight is ``bucket.param_data.view(-1)[start:end]``."""
    wrote_model_weights: bool = False
    """A step wrote model weights that megatron-core's copy has not yet been asked for."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the fused optimizer step takes no closure")
        for group in self.param_groups:
            decoupled = bool(group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW)))
            beta1, beta2 = (float(b) for b in group["betas"])
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step = float(state["step"]) + 1 if "step" in state else 1.0  # a device counter: read once, then host
                state["step"] = torch.tensor(step, dtype=torch.float32)  # a new tensor: loads may share one
                scalars = AdamScalars(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                                      weight_decay=group["weight_decay"], decoupled=decoupled, step=step,
                                      grad_scale=self.grad_scale)
                where = self.model_weights.get(p) if self.model_weights else None
                out = where[0].param_data.view(-1)[where[1]:where[2]] if where is not None else None
                adam_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], scalars, out)
                self.wrote_model_weights |= out is not None


class FusedStepAdam(_FusedStep, torch.optim.Adam):
    """``torch.optim.Adam`` whose ``step`` is :class:`_FusedStep`'s."""


class FusedStepAdamW(_FusedStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` is :class:`_FusedStep`'s."""


def _refusal(part) -> Optional[str]:
    """Why the fused step cannot replace ``part``'s (a megatron optimizer), or None."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(part, DistributedOptimizer):
        return "not the distributed optimizer (--use-distributed-optimizer)"
    inner = part.optimizer
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"the inner optimizer is {type(inner).__name__}, not torch's Adam / AdamW"
    ddp, config = part.ddp_config, part.config
    if ddp.use_megatron_fsdp or ddp.fp8_param_gather or config.use_precision_aware_optimizer or \
            getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return "Megatron-FSDP, FP8 parameters or the precision-aware optimizer"
    for group in inner.param_groups:
        if any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable")):
            return "amsgrad, maximize, capturable or differentiable Adam"
        if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
            return "a tensor learning rate or betas"
    return None


def _model_weights(part) -> dict:
    """Each main weight of distributed optimizer ``part`` -> where its model weight lies in DDP's param buffer (the
    slice ``_copy_main_params_to_model_params`` copies it into)."""
    where = {}
    for main_groups, model_groups in ((part.shard_fp32_from_float16_groups, part.model_float16_groups),
                                      (part.shard_fp32_groups, part.model_fp32_groups)):
        for main_group, model_group in zip(main_groups, model_groups):
            for main, model in zip(main_group, model_group):
                world_range = part._get_model_param_range_map(model)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = part.model_param_gbuf_map[model]
                bucket = part.buffers[gbuf_index].buckets[bucket_id]
                if bucket.param_data is None or world_range.size != main.numel():
                    return {}
                where[main] = (bucket, world_range.start, world_range.end)
    return where


def install(optimizer) -> tuple:
    """Install the fused step on every distributed-optimizer part of megatron optimizer ``optimizer`` that allows it
    (:func:`_refusal`). Returns ``(param groups fused, reasons of the parts left as they were)``."""
    from megatron_glm5.training.optimizer import optimizer_parts

    _install_clip_deferral()
    fused, refused = 0, []
    for part in optimizer_parts(optimizer):
        if getattr(part, "is_stub_optimizer", False):
            continue
        reason = _refusal(part)
        where = _model_weights(part) if reason is None else {}
        if reason is None and not where:
            reason = "no param buffer to write the model weights into"
        if reason is not None:
            refused.append(reason)
            continue
        inner = fused_step(part.optimizer, where)
        part._copy_main_params_to_model_params = _copy_unless_written(part, part._copy_main_params_to_model_params)
        fused += len(inner.param_groups)
    return fused, refused


def fused_step(inner: torch.optim.Adam, model_weights: Optional[dict] = None) -> _FusedStep:
    """Turn torch ``Adam`` / ``AdamW`` ``inner`` (plain, not amsgrad / maximize / capturable / differentiable) into
    :class:`FusedStepAdam` / :class:`FusedStepAdamW` in place (param groups and state kept; its ``step`` counters
    live on the host from its next step on) and mark its parameters as its own for the clip deferral.
    ``model_weights``: main weight -> ``(bucket, start, end)`` of its model weight in DDP's param buffer."""
    inner.__class__ = FusedStepAdamW if isinstance(inner, torch.optim.AdamW) else FusedStepAdam
    inner.grad_scale, inner.model_weights, inner.wrote_model_weights = 1.0, dict(model_weights or {}), False
    owner = weakref.ref(inner)
    for group in inner.param_groups:
        for p in group["params"]:
            setattr(p, _OWNER, owner)
    _host_counter_groups(inner)
    inner.register_load_state_dict_post_hook(_host_counter_groups)
    return inner


def _host_counter_groups(inner) -> None:
    """Flag every param group of ``inner`` as torch's plain single-tensor Adam (not fused, not foreach): torch keeps
    the ``step`` counters of such groups on the host, also when it loads a checkpoint (whose param groups replace
    the run's flags: hence also a ``load_state_dict`` post-hook)."""
    for group in inner.param_groups:
        group["fused"], group["foreach"] = False, False


def _copy_unless_written(part, copy):
    """``part._copy_main_params_to_model_params``: nothing after a fused step (it wrote the weights), ``copy``
    otherwise; the clip coefficient of the step is spent either way."""

    def copy_main_params_to_model_params():
        inner = part.optimizer
        inner.grad_scale = 1.0
        if inner.wrote_model_weights:
            inner.wrote_model_weights = False
            return None
        return copy()

    return copy_main_params_to_model_params


def _fused_owner(parameters) -> Optional[_FusedStep]:
    """The fused-step optimizer whose main weights ``parameters`` are, all of them and nothing else; else None."""
    params = list(parameters) if not torch.is_tensor(parameters) else [parameters]
    ref = getattr(params[0], _OWNER, None) if params else None
    owner = ref() if ref is not None else None
    if owner is None or any(getattr(p, _OWNER, None) is not ref for p in params):
        return None
    count = sum(len(g["params"]) for g in owner.param_groups)
    return owner if len(set(map(id, params))) == len(params) == count else None


def _install_clip_deferral() -> None:
    """Point megatron-core's optimizer module at :func:`clip_grad_by_total_norm_fp32` (idempotent)."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    current = mcore_optimizer.clip_grad_by_total_norm_fp32
    if getattr(current, "glm5_defers_to", None) is None:
        mcore_optimizer.clip_grad_by_total_norm_fp32 = _deferring(current)


def _deferring(clip):
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        """megatron-core's ``clip_grad_by_total_norm_fp32``; for exactly the main weights of a fused-step optimizer
        the coefficient (``max_norm / (total_norm + 1e-6)`` where below 1, else 1) becomes its ``grad_scale``."""
        owner = None if use_decoupled_grad or torch.is_tensor(total_norm) else _fused_owner(parameters)
        if owner is None:
            return clip(parameters, max_norm, total_norm, use_decoupled_grad=use_decoupled_grad)
        coeff = max_norm / (total_norm + 1.0e-6)
        owner.grad_scale = coeff if coeff < 1.0 else 1.0
        return None

    clip_grad_by_total_norm_fp32.glm5_defers_to = clip
    return clip_grad_by_total_norm_fp32
