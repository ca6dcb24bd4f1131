"""Where megatron-style modules put their parameters and how they mark them: the device to allocate on (CUDA, the
CPU, or whatever ``with torch.device(...)`` says, e.g. ``"meta"``) and the replicated-over-TP attributes."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes


def param_device(config):
    """Where megatron-style modules allocate parameters: the current CUDA device, or ``None`` (torch's default
    device, the CPU unless a ``with torch.device(...)`` context, e.g. ``"meta"``, says otherwise) with
    ``use_cpu_initialization`` or without CUDA."""
    if config is None or getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def mark_replicated(module: torch.nn.Module) -> None:
    """Tag every parameter of ``module`` as *not* tensor-parallel (replicated on all TP ranks).

    megatron-core reads ``tensor_model_parallel = False`` to count the parameter once in the grad norm, and its
    default ``sharded_state_dict`` saves such tensors as TP replicas.
    """
    for p in module.parameters(recurse=True):
        set_defaults_if_not_set_tensor_model_parallel_attributes(p)
