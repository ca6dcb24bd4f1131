"""TensorBoard scalars this model adds to Megatron-LM's: ``moe/expert-load-imbalance`` (mean over MoE layers of
max / mean tokens per expert, and per layer ``moe/expert-load-imbalance/layer_i``) and ``packing-efficiency`` (the
share of real tokens in the packed image+text rows), and the ``data/*`` counters of the training micro batches
(:func:`megatron_glm5.training.data_accounting.write_data_counts`), each once per iteration at
``--tensorboard-log-interval``. megatron-core's MTP metrics are written without their cumulative acceptance rate
(:func:`install`).

The expert loads are the routers' ``local_tokens_per_expert``, summed over the step's micro batches, which
megatron-core's ``finalize_model_grads`` uses for the aux-loss-free expert-bias update and then resets:
:func:`finalize_grads_and_log_expert_loads` (the model config's ``finalize_model_grads_func``) reads them first.
"""

from __future__ import annotations

import re
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads



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
    from megatron_glm5.training.data_accounting import PACKING_EFFICIENCY, write_data_counts

    if PACKING_EFFICIENCY[0] is not None and log_now:
        scalars["packing-efficiency"] = PACKING_EFFICIENCY[0]
    writer = get_tensorboard_writer()
    if writer is not None:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, iteration)
        if log_now:
            write_data_counts(writer, iteration)


_CUMULATIVE_MTP_RATE = re.compile(r"mtp_\d+_cumulative_acceptance_rate")


class _WithoutCumulativeMtpRates:
    """A TensorBoard / wandb writer that drops megatron-core's ``mtp_N_cumulative_acceptance_rate``: a total kept in
    the process only (not in checkpoints), so it restarts at every resume; the per-step ``mtp_N_acceptance_rate``
    is kept."""

    def __init__(self, writer):
        self._writer = writer

    def add_scalar(self, tag, *args, **kwargs):
        if not _CUMULATIVE_MTP_RATE.fullmatch(tag):
            self._writer.add_scalar(tag, *args, **kwargs)

    def log(self, values: dict, *args, **kwargs):
        kept = {k: v for k, v in values.items() if not _CUMULATIVE_MTP_RATE.fullmatch(k)}
        if kept:
            self._writer.log(kept, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._writer, name)


def install() -> None:
    """megatron-core's MTP metrics (``MTPLossLoggingHelper.track_mtp_metrics``, called by Megatron-LM's
    ``training_log``) written without the cumulative acceptance rate (:class:`_WithoutCumulativeMtpRates`)."""
    from megatron_glm5 import extensions

    record = extensions.BY_NAME["mtp_metrics"]
    track = extensions.current(record)

    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        return track(loss_scale, iteration, writer if writer is None else _WithoutCumulativeMtpRates(writer),
                     wandb_writer if wandb_writer is None else _WithoutCumulativeMtpRates(wandb_writer),
                     total_loss_dict)

    extensions.apply(record, staticmethod(track_mtp_metrics))
