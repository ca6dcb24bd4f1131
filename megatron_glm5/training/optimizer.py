"""megatron-core optimizer details the trainer needs beyond Megatron-LM's: torch's fused Adam for the torch Adam
fallback, and a state layout for SGD so that its checkpoints load."""

from __future__ import annotations

import torch


def use_torch_fused_adam(optimizer) -> int:
    """Switch the param groups of megatron-core's torch ``Adam`` / ``AdamW`` fallback (no Transformer Engine or
    Apex) to torch's fused kernel (``fused=True``: one pass over parameters, gradients and moments per step; torch
    defaults to its foreach form, a pass per operation). The group flag is what ``step`` reads; a group switched
    before its first step gets its ``step`` counters on the parameters' device, as fused Adam needs, and checkpoint
    loads keep them there (torch's ``load_state_dict`` for fused groups). Groups of parameters on more than one
    device, or on a device without the fused kernel, are left alone. Returns the number of groups switched."""
    switched = 0
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            devices = {p.device.type for p in group["params"]}
            if len(devices) != 1 or devices.pop() not in ("cuda", "cpu") or group.get("differentiable"):
                continue
            if not all(p.is_floating_point() for p in group["params"]):
                continue
            group["fused"], group["foreach"] = True, False
            switched += 1
    return switched


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


# ---------------------------------------------------------------------------- non-finite updates
class StepSnapshot:
    """What one step of a megatron optimizer writes, kept so that the step can be undone: per part (a megatron
    optimizer of a ``ChainedOptimizer``) the values of its torch optimizer's parameters (the fp32 main parameters,
    or their distributed-optimizer shards, or the model's own parameters in fp32 training) and its state (Adam's
    moments and step counts). Costs one copy of those tensors on their device while it is held."""

    def __init__(self, optimizer):
        self.parts = []
        for part in optimizer_parts(optimizer):
            inner = getattr(part, "optimizer", None)
            if inner is None or getattr(part, "is_stub_optimizer", False):
                continue
            params = [p for g in inner.param_groups for p in g["params"]]
            state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                     for p, s in inner.state.items()}
            self.parts.append((part, inner, params, [p.detach().clone() for p in params], state))

    @torch.no_grad()
    def restore(self, replay_step_with_ready_grads) -> None:
        """Put the parameters and state back, then run ``replay_step_with_ready_grads`` (the chained optimizer's
        ``step_with_ready_grads``) with every torch optimizer's update turned off: megatron's own copy of the main
        parameters into the model's (and, with the distributed optimizer, their all-gather) spreads them again."""
        for _, inner, params, saved, state in self.parts:
            if params:
                torch._foreach_copy_(params, saved)
            inner.state.clear()
            inner.state.update(state)
            inner.step = _no_update
        try:
            replay_step_with_ready_grads()
        finally:
            for _, inner, *_ in self.parts:
                del inner.step


def _no_update(*args, **kwargs):
    return None


def max_abs_weight(optimizer) -> torch.Tensor:
    """The largest magnitude over the parameters the torch optimizers of ``optimizer`` update on this rank (NaN if
    any is NaN), a float32 scalar on the parameters' device (0 when the rank updates none)."""
    groups = {}
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if inner is None or getattr(part, "is_stub_optimizer", False):
            continue
        for g in inner.param_groups:
            for p in g["params"]:
                if p.numel():
                    groups.setdefault((p.device, p.dtype), []).append(p.detach())
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    out = torch.zeros((), dtype=torch.float32, device=device)
    for tensors in groups.values():
        norms = torch._foreach_norm(tensors, float("inf"))
        m = torch.stack([n.float() for n in norms]).max().to(device)
        out = torch.maximum(out, m)  # NaN propagates
    return out


def weight_limit(config) -> float:
    """The largest magnitude a weight of a model trained with optimizer ``config`` can hold: its fp32 main weights
    are copied into bf16 / fp16 model weights under ``--bf16`` / ``--fp16``."""
    dtype = torch.bfloat16 if getattr(config, "bf16", False) else (
        torch.float16 if getattr(config, "fp16", False) else torch.float32)
    return float(torch.finfo(dtype).max)
