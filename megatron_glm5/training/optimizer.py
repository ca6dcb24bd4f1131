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
