"""sharded_state_dict helpers for modules whose tensors are all replicated over tensor parallelism."""

from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint


def replicated_sharded_state_dict(module, prefix: str = "", sharded_offsets: tuple = (),
                                  metadata: Optional[dict] = None):
    """ShardedTensors for every tensor of ``module``, replicated over TP (and DP/CP), PP offsets applied."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(
        state, prefix, {}, sharded_offsets,
        tp_group=getattr(module, "tp_group", None) or parallel_state.get_tensor_model_parallel_group(),
        dp_cp_group=metadata["dp_cp_group"])
