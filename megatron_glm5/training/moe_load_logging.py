"""TensorBoard scalars this model adds to Megatron-LM's: ``moe/expert-load-imbalance`` (mean over MoE layers of
max / mean tokens per expert, and per layer ``moe/expert-load-imbalance/layer_i``) and ``packing-efficiency`` (the
share of real tokens in the packed image+text rows).

The expert loads are the routers' ``local_tokens_per_expert``, summed over the step's micro batches, which
megatron-core's ``finalize_model_grads`` uses for the aux-loss-free expert-bias update and then resets:
:func:`finalize_grads_and_log_expert_loads` (the model config's ``finalize_model_grads_func``) reads them first.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

PACKING_EFFICIENCY: List[Optional[float]] = [None]  # set by the datasets provider (packed rows)


def _routers(model) -> list:
    from megatron.core.utils import unwrap_model

    return [m for chunk in unwrap_model(model) for m in chunk.modules()
            if getattr(m, "local_tokens_per_expert", None) is not None and hasattr(m, "expert_bias")]


def expert_load_imbalance(loads: List[torch.Tensor]) -> Dict[str, float]:
    """{'moe/expert-load-imbalance': mean over MoE layers, '.../layer_i': each} of max/mean tokens per expert,
    loads summed over the tensor x data x context parallel ranks (as the expert-bias update sums them)."""
    if not loads:
        return {}
    stacked = torch.stack(loads).double()
    dist.all_reduce(stacked, group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    ratio = stacked.max(dim=1).values / stacked.mean(dim=1).clamp(min=1e-9)
    out = {"moe/expert-load-imbalance": float(ratio.mean())}
    out.update({f"moe/expert-load-imbalance/layer_{i}": float(r) for i, r in enumerate(ratio)})
    return out


def finalize_grads_and_log_expert_loads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron-core's ``finalize_model_grads``, with this step's expert loads and the packing efficiency written to
    TensorBoard at Megatron-LM's ``--tensorboard-log-interval`` (the loads are read before megatron resets them)."""
    from megatron.training import get_args, get_tensorboard_writer

    args = get_args()
    iteration = args.curr_iteration + 1
    log_now = args.tensorboard_dir and iteration % args.tensorboard_log_interval == 0
    scalars = expert_load_imbalance([r.local_tokens_per_expert.detach().clone() for r in _routers(model)]) \
        if log_now else {}
    finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if PACKING_EFFICIENCY[0] is not None and log_now:
        scalars["packing-efficiency"] = PACKING_EFFICIENCY[0]
    writer = get_tensorboard_writer()
    if writer is not None:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, iteration)
