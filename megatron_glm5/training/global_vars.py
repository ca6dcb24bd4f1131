"""Run-wide state the training script reads where megatron-core's callback signatures leave no room to pass it
(Megatron-LM's ``get_args()``): the parsed arguments, the current iteration, and the last step's expert loads."""

from __future__ import annotations

from typing import List

import torch

_ARGS = None
_CONFIG = None
_ITERATION = 0
_EXPERT_LOADS: List[torch.Tensor] = []


def set_args(args) -> None:
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("training arguments are not set (call pretrain first)")
    return _ARGS


def set_config(config) -> None:
    """The run's model config (Glm5Config)."""
    global _CONFIG
    _CONFIG = config


def get_config():
    if _CONFIG is None:
        raise RuntimeError("the model config is not set (call pretrain first)")
    return _CONFIG


def set_iteration(iteration: int) -> None:
    """The iteration being computed (1-based, as logged)."""
    global _ITERATION
    _ITERATION = iteration


def get_iteration() -> int:
    return _ITERATION


def record_expert_loads(loads: List[torch.Tensor]) -> None:
    global _EXPERT_LOADS
    _EXPERT_LOADS = loads


def expert_loads() -> List[torch.Tensor]:
    return _EXPERT_LOADS


def reset() -> None:
    """Forget everything (tests run several trainings in one process)."""
    global _ARGS, _CONFIG, _ITERATION, _EXPERT_LOADS
    _ARGS, _CONFIG, _ITERATION, _EXPERT_LOADS = None, None, 0, []
