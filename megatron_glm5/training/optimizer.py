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
