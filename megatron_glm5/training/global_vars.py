"""Run-wide state the training script reads where megatron-core's callback signatures leave no room to pass it
(Megatron-LM's ``get_args()``): the parsed arguments, the current iteration, and the last step's expert loads."""

from __future__ import annotations

from typing import List, Optional

import torch

_ARGS = None
_ITERATION = 0
_EXPERT_LOADS: List[torch.Tensor] = []


def set_args(args) -> None:
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("training arguments are not set (call pretrain first)")
    return _ARGS


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
    global _ARGS, _ITERATION, _EXPERT_LOADS
    _ARGS, _ITERATION, _EXPERT_LOADS = None, 0, []
