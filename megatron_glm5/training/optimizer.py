"""megatron-core optimizer details the trainer needs beyond Megatron-LM's: torch's fused Adam for the torch Adam
fallback, a state layout for SGD so that its checkpoints load, and the checkpoint map of megatron-core's bf16
optimizer without the distributed optimizer when fp32 parameters train beside the bf16 ones."""

from __future__ import annotations

import math

import torch


def use_torch_fused_adam(optimizer) -> int:
    """Switch the param groups of megatron-core's torch ``Adam`` / ``AdamW`` fallback (no Transformer Engine or
    Apex) to torch's fused kernel (``fused=True``: one pass over parameters, gradients and moments per step; torch
    defaults to its foreach form, a pass per operation). The group flag is what ``step`` reads; a group switched
    before its first step gets its ``step`` counters on the parameters' device, as fused Adam needs, and a checkpoint
    load keeps the groups fused and the counters there, whatever form saved it (:func:`_keep_fused_after_load`).
    Groups of parameters on more than one device, or on a device without the fused kernel, are left alone
    (:func:`_switch_to_fused`). Returns the number of groups switched."""
    switched = 0
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        here = sum(_switch_to_fused(inner, group) for group in inner.param_groups)
        if here and not getattr(inner, "_glm5_keeps_fused", False):
            inner.register_load_state_dict_post_hook(_keep_fused_after_load)
            inner._glm5_keeps_fused = True
        switched += here
    return switched


def _switch_to_fused(inner, group) -> bool:
    """Flag param group ``group`` of torch Adam ``inner`` fused (not foreach) where its parameters allow it (all
    floating point, on one CUDA or CPU device, not differentiable) and put its ``step`` counters on that device, as
    fused Adam needs; whether it did."""
    devices = {p.device for p in group["params"]}
    if len(devices) != 1 or group.get("differentiable") or not all(p.is_floating_point() for p in group["params"]):
        return False
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        return False
    group["fused"], group["foreach"] = True, False
    for p in group["params"]:
        step = inner.state.get(p, {}).get("step")
        if torch.is_tensor(step) and step.device != device:
            inner.state[p]["step"] = step.to(device=device, dtype=torch.float32)
    return True


def _keep_fused_after_load(inner) -> None:
    """``load_state_dict`` post-hook of an Adam switched by :func:`use_torch_fused_adam`: a checkpoint's param groups
    replace the run's flags (one saved by a foreach or host-counter run would turn the kernel off again), so the
    groups are switched back (:func:`_switch_to_fused`)."""
    for group in inner.param_groups:
        _switch_to_fused(inner, group)


def optimizer_parts(optimizer) -> list:
    """The megatron optimizers behind ``optimizer`` (a ``ChainedOptimizer`` holds one for the dense and one for the
    expert-parallel parameters, depending on the layout)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def sgd_init_state(opt: torch.optim.SGD, config=None) -> None:
    """Lay out torch SGD's state (a momentum buffer per parameter, when momentum is on) so that a checkpoint can be
    loaded into it, as megatron-core's ``init_state_fn`` does for Adam."""
    for group in opt.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            if opt.state[p].get("momentum_buffer") is None:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


FP32_ISLAND_KEY = "fp32_island"  # the param-group field that marks the fp32 islands' groups under bf16


def identify_fp32_island_groups() -> bool:
    """Add :data:`FP32_ISLAND_KEY` to the fields by which megatron-core pairs a checkpoint's param groups with the
    run's (``param_group_identifier_keys``, read by ``_filter_and_reorder_param_groups`` on load): without it an
    fp32 island group and the bf16 group of the same learning-rate and weight-decay settings share one identifier,
    and both take the same saved group. Idempotent; returns whether it added it now."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if FP32_ISLAND_KEY in mcore_optimizer.param_group_identifier_keys:
        return False
    mcore_optimizer.param_group_identifier_keys = (*mcore_optimizer.param_group_identifier_keys, FP32_ISLAND_KEY)
    return True


def map_fp32_params_in_checkpoints(optimizer) -> int:
    """Give each megatron-core ``Float16OptimizerWithFloat16Params`` behind ``optimizer`` (``--bf16`` without
    ``--use-distributed-optimizer``) the checkpoint map of :func:`_float16_sharded_state_dict`. Returns how many."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    changed = 0
    for part in optimizer_parts(optimizer):
        if type(part) is Float16OptimizerWithFloat16Params:
            part.sharded_state_dict = _float16_sharded_state_dict.__get__(part)
            part.load_state_dict = _float16_load_state_dict.__get__(part)
            changed += 1
    return changed


def _float16_sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
    """megatron-core's ``Float16OptimizerWithFloat16Params.sharded_state_dict`` with the optimizer-state ids mapped
    to the model parameters in the torch optimizer's own order.

    torch numbers the state of every parameter of every param group in turn, fp32 ones (this model's fp32 islands,
    in param groups of their own under bf16) included; upstream maps those numbers onto its bf16 parameters alone
    (``float16_groups``), so every parameter after the first fp32 group got another parameter's sharded tensor (a
    shape mismatch or a missing id on save). Here the n-th id is the model parameter behind the n-th optimizer
    parameter (a bf16 parameter for its fp32 main copy, the fp32 parameter itself), and each group's fp32 main copies
    pair with the ids at their own positions in the group. The fp32 main copies are listed for the groups that have
    them only (megatron-core's checkpoint split drops an empty list's place, so an fp32 group's ``[]`` would shift the
    groups after it on load; :func:`_float16_load_state_dict` puts them back). Otherwise as upstream (megatron-core
    0.19.2)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor, optim_state_to_sharding_state)

    if is_loading:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    model_params, main_ids = [], []
    for group, float16, mains, saved in zip(self.optimizer.param_groups, self.float16_groups,
                                             self.fp32_from_float16_groups, state_dict["optimizer"]["param_groups"]):
        model_of = {id(main): p for main, p in zip(mains, float16)}
        model_params += [model_of.get(id(p), p) for p in group["params"]]
        main_ids.append([pid for p, pid in zip(group["params"], saved["params"]) if id(p) in model_of])
    id_to_sharded_param_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
    state_dict["fp32_from_fp16_params"] = [
        [make_sharded_optimizer_tensor(id_to_sharded_param_map[pid], main, prefix="optimizer.state.fp32_param")
         for pid, main in zip(ids, mains)]
        for ids, mains in zip(main_ids, state_dict["fp32_from_fp16_params"]) if mains]
    step = self._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def _float16_load_state_dict(self, state_dict):
    """megatron-core's ``Float16OptimizerWithFloat16Params.load_state_dict`` of a state dict made by
    :func:`_float16_sharded_state_dict`: the fp32 main copies of the groups that have them, put back in their
    groups' places (an empty list for each fp32 group)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    saved = list(state_dict["fp32_from_fp16_params"])
    if len(saved) != len(self.fp32_from_float16_groups):
        saved.reverse()
        state_dict = dict(state_dict, fp32_from_fp16_params=[saved.pop() if mains else []
                                                             for mains in self.fp32_from_float16_groups])
    return Float16OptimizerWithFloat16Params.load_state_dict(self, state_dict)


# ---------------------------------------------------------------------------- non-finite updates
@torch.no_grad()
def update_keeps_weights_within(optimizer, limit: float) -> bool:
    """Whether the next ``step()`` of the torch optimizers behind megatron optimizer ``optimizer`` leaves every
    parameter they update on this rank (the fp32 main weights, their distributed-optimizer shards, or the model's own
    weights in fp32 training) within ``[-limit, limit]`` (NaN is outside), without changing anything.

    Each parameter is tried alone: a copy of it, of its gradient and of its state is put in its param group in its
    place (every other group emptied) and stepped by the optimizer itself, so the result is bitwise what the real
    step computes for it (the optimizers megatron-core builds update each tensor on its own: Adam, SGD, their fused
    and multi-tensor forms); an update the optimizer cannot compute in the parameters' dtype (torch's "value cannot
    be converted to type float without overflow") is out of range too. Costs one more pass of the optimizer's
    arithmetic and, at a time, a copy of one parameter with its gradient and state; the param groups (their step
    counters included) are put back as they were."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    worst = None
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if inner is None or getattr(part, "is_stub_optimizer", False):
            continue
        if isinstance(inner, HybridDeviceOptimizer):  # --optimizer-cpu-offload: steps copies it keeps per param
            continue
        groups = inner.param_groups
        saved = [dict(g) for g in groups]
        try:
            for i, group in enumerate(saved):
                for p in group["params"]:
                    if p.grad is None:  # not updated by the step either
                        continue
                    trial = p.detach().clone()
                    trial.grad = p.grad.detach().clone()
                    if p in inner.state:
                        inner.state[trial] = {k: v.clone() if torch.is_tensor(v) else v
                                              for k, v in inner.state[p].items()}
                    for g, g_saved in zip(groups, saved):
                        g.clear()
                        g.update(g_saved, params=[])
                    groups[i]["params"] = [trial]
                    try:
                        inner.step()
                    except RuntimeError as e:  # a factor (lr x weight decay, ...) beyond the dtype's range
                        if "without overflow" not in str(e):
                            raise
                        return False
                    finally:
                        inner.state.pop(trial, None)
                    largest = torch.linalg.vector_norm(trial.float(), float("inf")) if trial.numel() else None
                    if largest is not None:
                        worst = largest if worst is None else torch.maximum(worst, largest.to(worst.device))
        finally:
            for g, g_saved in zip(groups, saved):
                g.clear()
                g.update(g_saved)
    return worst is None or bool(worst <= limit)


def weight_limit(config) -> float:
    """The largest magnitude a weight of a model trained with optimizer ``config`` can hold: its fp32 main weights
    are copied into bf16 / fp16 model weights under ``--bf16`` / ``--fp16``."""
    dtype = torch.bfloat16 if getattr(config, "bf16", False) else (
        torch.float16 if getattr(config, "fp16", False) else torch.float32)
    return float(torch.finfo(dtype).max)


def max_magnitude(tensors) -> float:
    """The largest |value| over ``tensors`` (0.0 for none; NaN/inf when one holds it): one fused max-magnitude pass
    per device and dtype, one host sync."""
    groups = {}
    for t in tensors:
        if t is not None and t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    worst = 0.0
    for ts in groups.values():
        m = float(torch.stack([n.float() for n in torch._foreach_norm(ts, float("inf"))]).max())
        worst = m if not (m <= worst) else worst  # NaN wins
    return worst


_FP32_MAX = float(torch.finfo(torch.float32).max)
_MARGIN = 2.0  # headroom for the rounding of the optimizer's own arithmetic and of the bounds'


class WeightRangeGuard:
    """Whether the next step of megatron optimizer ``optimizer`` keeps every weight it updates on this rank within
    ``[-limit, limit]``, decided from bounds in O(param groups) Python arithmetic on almost every step.

    For each torch optimizer behind it the guard keeps ``P``, a bound on this rank's largest |weight|, and ``X``:
    for Adam a bound ``K`` on ``|m| / sqrt(v)`` over the elements (first over second moment), for SGD a bound ``M`` on
    the largest |momentum buffer|. With ``G`` a bound on the largest |gradient| (the step's gradient norm, measured
    when there is none) and each group's ``lr``, ``weight_decay`` (wd), betas / momentum, one step moves them at most
    to, whatever the gradients hold:

    * Adam / AdamW (torch, Transformer Engine, Apex; decoupled or L2 weight decay, amsgrad): by Cauchy-Schwarz on
      ``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``: ``K'^2 = b1^2 K^2 / b2 + (1 - b1)^2 / (1 - b2)``, so
      the bias-corrected ``m / (sqrt(v) + eps)`` is at most ``R = K' / (1 - b1)`` and
      ``P' = P max(1, |1 - lr wd|) + lr R`` (L2 decay only changes the gradient, which ``K'`` does not depend on);
      ``G`` enters through ``(1 - b2) (G + wd P)^2``, which must stay within fp32 (``v``).
    * SGD: ``M' = mu M + |1 - dampening| (G + wd P)``, ``P' = P + lr (M' + G + wd P)``.

    When ``P'`` and the intermediates stay within the limits by a margin, the bounds move on and nothing is read.
    Otherwise ``P`` and ``X`` are measured (one fused pass over the weights and the state) and, if the bound still
    does not hold, the update is tried exactly (:func:`update_keeps_weights_within`). An optimizer of another kind
    is always tried exactly. The first call measures (the trainer loads a checkpoint before it)."""

    def __init__(self, optimizer, limit: float):
        self.optimizer, self.limit = optimizer, limit
        self.bounds = None  # per torch optimizer: [P, X]
        self.measured = self.tried = 0  # how often the fallbacks ran

    def _inners(self) -> list:
        return [getattr(part, "optimizer", None) for part in optimizer_parts(self.optimizer)
                if getattr(part, "optimizer", None) is not None and not getattr(part, "is_stub_optimizer", False)]

    @staticmethod
    def _kind(inner) -> str:
        groups = inner.param_groups
        if groups and all("betas" in g and "eps" in g for g in groups):
            return "adam"
        if isinstance(inner, torch.optim.SGD):
            return "sgd"
        return ""

    @staticmethod
    def _moment_ratio(inner, params) -> float:
        """max over elements of ``|m| / sqrt(v)`` (amsgrad: its running max of ``v``), 0 where both are 0, inf where
        only ``v`` is; 0.0 before the first step (no state)."""
        worst = 0.0
        for p in params:
            st = inner.state.get(p, {})
            m, v = st.get("exp_avg"), st.get("max_exp_avg_sq", st.get("exp_avg_sq"))
            if not (torch.is_tensor(m) and torch.is_tensor(v)) or not m.numel():
                continue
            r = m.float().abs() / v.float().sqrt()
            r = torch.where(m == 0, torch.zeros_like(r), r)
            largest = float(r.max())
            worst = largest if not (largest <= worst) else worst  # NaN wins
        return worst

    def _measure(self) -> None:
        self.measured += 1
        self.bounds = []
        for inner in self._inners():
            params = [p for g in inner.param_groups for p in g["params"]]
            if self._kind(inner) == "adam":
                x = self._moment_ratio(inner, params)
            else:
                x = max_magnitude([inner.state[p].get("momentum_buffer") for p in params if p in inner.state
                                    and torch.is_tensor(inner.state[p].get("momentum_buffer"))])
            self.bounds.append([max_magnitude(params), x])

    def _next(self, grad_bound: float):
        """The bounds after the step ([P', X'] per torch optimizer), or None when they do not prove it safe."""
        out = []
        for inner, (p_max, x) in zip(self._inners(), self.bounds):
            kind = self._kind(inner)
            if not kind:
                return None
            p_next, x_next = p_max, x
            for g in inner.param_groups:
                if not g["params"]:
                    continue
                lr, wd = float(g["lr"]), float(g.get("weight_decay", 0.0))
                grad = grad_bound + wd * p_max
                if kind == "adam":
                    b1, b2 = float(g["betas"][0]), float(g["betas"][1])
                    if not (0 <= b1 < 1 and 0 < b2 < 1):
                        return None
                    k = math.sqrt(b1 * b1 * x * x / b2 + (1 - b1) ** 2 / (1 - b2))
                    p = p_max * max(1.0, abs(1 - lr * wd)) + lr * k / (1 - b1)
                    widest, x_new = (1 - b2) * grad * grad, k
                else:
                    x_new = float(g["momentum"]) * x + abs(1 - float(g.get("dampening", 0.0))) * grad
                    p = p_max + lr * (x_new + grad)
                    widest = x_new + grad
                if not (widest * _MARGIN <= _FP32_MAX and p * _MARGIN <= self.limit):  # NaN fails too
                    return None
                p_next, x_next = max(p_next, p), max(x_next, x_new)
            out.append([p_next, x_next])
        return out

    @torch.no_grad()
    def keeps_within(self, grad_norm=None) -> bool:
        """Whether the coming ``step()`` keeps every weight on this rank within the limit (nothing is changed).
        ``grad_norm``: the step's gradient norm (it bounds every |gradient|); measured when None or not finite."""
        inners = self._inners()
        if self.bounds is None or len(self.bounds) != len(inners):
            self._measure()

        def grad_bound():
            if grad_norm is not None and math.isfinite(float(grad_norm)):
                return float(grad_norm)
            return max_magnitude([p.grad for inner in inners for g in inner.param_groups for p in g["params"]])

        g_max = grad_bound()
        nxt = self._next(g_max)
        if nxt is None:
            self._measure()
            nxt = self._next(g_max)
        if nxt is not None:
            self.bounds = nxt
            return True
        self.tried += 1
        ok = update_keeps_weights_within(self.optimizer, self.limit)
        self.bounds = None  # the step may run: measure again next time
        return ok
